"""MXFP4 weights (the OCP microscaling format gpt-oss's experts and DeepSeek-V4's routed experts ship
in) dequantized at load time, as transformers dequantizes them (``integrations/mxfp4.py``;
``integrations/finegrained_fp8.py``'s ``Fp8Dequantize`` for DeepSeek-V4's).

Every value is a 4-bit E2M1 float (two a byte, the low nibble first) times its block of 32's power
of two (a byte: e8m0, the exponent biased by 127), so the float32 (and bfloat16) result is exact.

* gpt-oss: a tensor [E, R, C] is stored as ``<name>_blocks`` [E, R, C / 32, 16] (uint8) and
  ``<name>_scales`` [E, R, C / 32] (uint8). transformers hands the experts' weights on as [E, C, R]:
  the last two axes swapped, which ``dequantized`` does too.
* DeepSeek-V4 (``quantization_config`` ``fp8`` with ``expert_dtype`` ``fp4``): an expert's weight
  [R, C] is stored as ``<module>.weight`` [R, C / 2] (int8) and ``<module>.scale`` [R, C / 32]
  (float8 e8m0): ``rows``, [R, C] as torch holds a Linear weight."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from common.cli import UserError

# The 16 values of an E2M1 nibble (sign, 2 exponent bits, 1 mantissa bit).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS, SCALES = "_blocks", "_scales"  # the suffixes of a quantized tensor's two parts (gpt-oss's)
GROUP = 32  # values a scale


def values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., G, 16] (uint8 or int8: bytes), scales [..., G] (uint8 or e8m0: bytes) -> float32
    [..., G, 32]: each byte's low nibble, then its high one, times 2 ** (its group's byte - 127)."""
    blocks, scales = blocks.view(np.uint8), scales.view(np.uint8)
    out = np.empty(blocks.shape[:-1] + (2 * blocks.shape[-1],), np.float32)
    out[..., 0::2] = E2M1[blocks & 0x0F]
    out[..., 1::2] = E2M1[blocks >> 4]
    np.ldexp(out, scales.astype(np.int32)[..., None] - 127, out=out)  # in place: one float32 copy
    return out


def dequantized(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [E, R, G, 16] uint8, scales [E, R, G] uint8 -> float32 [E, G * 32, R]."""
    if blocks.shape[:-1] != scales.shape or blocks.ndim != 4:
        raise UserError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
                        "([experts, rows, groups, 16] and [experts, rows, groups])")
    e, r, g, _ = blocks.shape
    return np.ascontiguousarray(values(blocks, scales).reshape(e, r, g * GROUP).transpose(0, 2, 1))


def rows(weight: np.ndarray, scale: np.ndarray, name: str = "weight") -> np.ndarray:
    """weight [R, C / 2] int8 (packed), scale [R, C / 32] e8m0 -> float32 [R, C] (DeepSeek-V4's experts;
    a scale of e8m0 byte 255, NaN, makes its values NaN, as transformers' widening does)."""
    if weight.ndim != 2 or weight.shape[-1] % (GROUP // 2) or scale.shape != (weight.shape[0],
                                                                             2 * weight.shape[1] // GROUP):
        raise UserError(f"FP4 weight {name!r} {list(weight.shape)} (two values a byte) and its scales "
                        f"{list(scale.shape)} do not match (one scale per {GROUP} values of a row: expected "
                        f"{[weight.shape[0], 2 * weight.shape[-1] // GROUP] if weight.ndim == 2 else '?'})")
    r, half = weight.shape
    out = values(weight.reshape(r, half // (GROUP // 2), GROUP // 2), scale)  # [R, G, 32]
    if scale.dtype == ml_dtypes.float8_e8m0fnu:  # e8m0's NaN (byte 255), as float8_e8m0fnu widens it in torch
        out[scale.view(np.uint8) == 255] = np.nan
    return out.reshape(r, 2 * half)
