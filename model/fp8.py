"""Block-FP8 weights (DeepSeek-V3's, GLM-4.5's and MiniMax-M2's FP8 checkpoints,
``quantization_config`` ``fp8``) dequantized at load time, as transformers'
``integrations/finegrained_fp8.py`` does.

A weight [R, C] is stored as float8 (e4m3) with ``<name>_scale_inv`` [ceil(R / r), ceil(C / c)]
(float32, bfloat16 or ue8m0 powers of two): block (i, j) of r x c values is multiplied by its
entry (``weight_block_size`` [r, c], 128 x 128 on the hub). Both are widened to float32 and
multiplied once: the result equals transformers' dequantization (loading with ``dequantize=True``)
bit for bit in float32, and its rounding to bfloat16 is the same single rounding. A last, partial
block (V3's ``kv_a_proj_with_mqa``: 576 rows) takes the entry of its place in the ceil grid, as
DeepSeek's own code and transformers' backward do (its load-time path takes whole blocks only)."""

from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np

from common.cli import UserError

SCALE = "_scale_inv"  # the suffix of a quantized weight's scales
# quantization_config.fmt as the hub's files spell e4m3: DeepSeek's and GLM's "e4m3", MiniMax-M2's "float8_e4m3fn".
# (transformers' FineGrainedFP8Config reads no fmt at all: the weights are the tensors' own float8_e4m3fn.)
E4M3 = ("e4m3", "float8_e4m3fn")
DEFAULT_BLOCK = (128, 128)  # FineGrainedFP8Config's weight_block_size where config.json has none


def block_size(quantization: dict | None, refuse: Callable[[str, Any, str], UserError]) -> tuple[int, int] | None:
    """The ``weight_block_size`` of a block-FP8 ``quantization_config`` (None where there is none);
    ``refuse(key, value, why)``: the family's one-line refusal (``Fields.refuse``), raised for an
    fmt other than e4m3 and for per-tensor scales (``weight_block_size`` null: Mistral's FP8 files)."""
    if not quantization:
        return None
    fmt = quantization.get("fmt", "e4m3")
    if fmt not in E4M3:
        raise refuse("quantization_config.fmt", fmt, f"the FP8 weights read are e4m3 ({' or '.join(E4M3)})")
    block = quantization.get("weight_block_size", list(DEFAULT_BLOCK))
    if block is None:
        raise refuse("quantization_config.weight_block_size", None, "per-tensor FP8 scales are not read (block-FP8 "
                     "only: a [rows, columns] block per weight_scale_inv entry)")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise refuse("quantization_config.weight_block_size", block, "two positive integers: rows, columns")
    return tuple(block)


def dequantized(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """weight [..., R, C] float8, scale_inv [..., ceil(R / r), ceil(C / c)] -> float32 [..., R, C]."""
    (rows, cols), (r, c) = weight.shape[-2:], block
    grid = (-(-rows // r), -(-cols // c))
    if scale_inv.shape[-2:] != grid or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise UserError(f"FP8 weight {list(weight.shape)} and its scales {list(scale_inv.shape)} do not match "
                        f"weight_block_size {list(block)} (expected scales {list(weight.shape[:-2]) + list(grid)})")
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), r, axis=-2)[..., :rows, :], c, axis=-1)[..., :cols]
    return weight.astype(np.float32) * scale  # [..., R, C]


def read(checkpoint, name: str, block: tuple[int, int] | None) -> np.ndarray:
    """Tensor ``name`` of a ``model.checkpoint.Checkpoint``, dequantized where it is a block-FP8
    weight (it has ``<name>_scale_inv``; ``block``: the config's ``weight_block_size``)."""
    tensor = checkpoint.tensor(name)
    if name + SCALE not in checkpoint:
        if tensor.dtype == ml_dtypes.float8_e4m3fn:  # raw float8 values are no weights without their scales
            raise UserError(f"checkpoint tensor {name!r} is float8 and has no {name + SCALE!r} (its FP8 scales)")
        return tensor
    if block is None:
        raise UserError(f"checkpoint tensor {name!r} has FP8 scales, and config.json no quantization_config "
                        "with a weight_block_size")
    return dequantized(tensor, checkpoint.tensor(name + SCALE), block)
