"""MXFP4 weights (the OCP microscaling format gpt-oss's experts ship in) dequantized at load time,
as transformers' ``integrations/mxfp4.py`` dequantizes them.

A tensor [E, R, C] is stored as ``<name>_blocks`` [E, R, C / 32, 16] (uint8: two 4-bit E2M1
values a byte, the low nibble first) and ``<name>_scales`` [E, R, C / 32] (uint8: each block of
32 values' power of two, biased by 127). Every value is a 4-bit float times its block's power of
two, so the float32 (and bfloat16) result is exact. transformers hands the experts' weights on
as [E, C, R]: the last two axes swapped, which this does too."""

from __future__ import annotations

import numpy as np

from common.cli import UserError

# The 16 values of an E2M1 nibble (sign, 2 exponent bits, 1 mantissa bit).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS, SCALES = "_blocks", "_scales"  # the suffixes of a quantized tensor's two parts


def dequantized(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [E, R, G, 16] uint8, scales [E, R, G] uint8 -> float32 [E, G * 32, R]."""
    if blocks.shape[:-1] != scales.shape or blocks.ndim != 4:
        raise UserError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
                        "([experts, rows, groups, 16] and [experts, rows, groups])")
    values = np.empty(blocks.shape[:-1] + (2 * blocks.shape[-1],), np.float32)  # [E, R, G, 32]
    values[..., 0::2] = E2M1[blocks & 0x0F]
    values[..., 1::2] = E2M1[blocks >> 4]
    np.ldexp(values, scales.astype(np.int32)[..., None] - 127, out=values)  # in place: one float32 copy
    e, r, g, _ = values.shape
    return np.ascontiguousarray(values.reshape(e, r, g * 32).transpose(0, 2, 1))
