"""Block-FP8 weights (DeepSeek-V3's, GLM-4.5's and MiniMax-M2's FP8 checkpoints,
``quantization_config`` ``fp8``) dequantized at load time, as transformers'
``integrations/finegrained_fp8.py`` does.

A weight [R, C] is stored as float8 (e4m3) with ``<name>_scale_inv`` [ceil(R / r), ceil(C / c)]
(float32, bfloat16 or ue8m0 powers of two): block (i, j) of r x c values is multiplied by its
entry (``weight_block_size`` [r, c], 128 x 128 on the hub). Both are widened to float32 and
multiplied once: the result equals transformers' dequantization (loading with ``dequantize=True``)
bit for bit in float32, and its rounding to bfloat16 is the same single rounding. A last, partial
block (V3's ``kv_a_proj_with_mqa``: 576 rows) takes the entry of its place in the ceil grid, as
DeepSeek's own code and transformers' backward do (its load-time path takes whole blocks only).

Per-tensor FP8 (Mistral's files: ``weight_block_size`` null, ``activation_scheme`` static) is read
where the family allows it (``block_size(..., per_tensor=True)``: Mistral 4's): each weight's block
is then derived from its scales' grid, as transformers' ``Fp8Dequantize`` derives it (rows over
the grid's rows, columns over its columns, dividing exactly; a 0-d or [1] scale: the whole weight,
one block), so a linear's scalar ``weight_scale_inv`` scales it whole and a stack of experts'
``gate_up_proj_scale_inv`` [E, 2, 1] its gate half and its up half apart. The static activation
scales (``activation_scale``, ``*_activation_scale``) are not read: what is computed is the model
transformers loads with ``dequantize=True`` (weights dequantized to the compute dtype, activations
not quantized).

DeepSeek-V4's hub files (``scale_fmt`` ``ue8m0``) name the scales ``<module>.scale`` beside
``<module>.weight`` (transformers renames them ``weight_scale_inv``), float8 e8m0 (a power of two:
exact in float32; e8m0 bytes held as uint8 are read as transformers reads them, 2 ** (byte - 127)),
and hold the routed experts in FP4 (``expert_dtype`` ``fp4``: an int8 weight, two e2m1 values a
byte, a scale per 32 values of a row: ``model.mxfp4.rows``), which transformers' ``Fp8Dequantize``
tells apart by the weight's dtype, as ``read`` does.

compressed-tensors' FP8 (``quantization_config`` ``compressed-tensors``, format ``float-quantized``:
Llama 4 Maverick's ``-Instruct-FP8``) names a float8 weight's scale ``<name>_scale``
(``<module>.weight_scale``, [out, 1] per channel or one per tensor) and multiplies by it as the
others do; its block is derived from the scale's grid (``FROM_SCALES``: a row each for a
per-channel scale)."""

from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np

from common.cli import UserError
from model import mxfp4

SCALE = "_scale_inv"  # the suffix of a quantized weight's scales
HUB_SCALE = ".scale"  # DeepSeek-V4's: <module>.scale beside a quantized <module>.weight
COMPRESSED_SCALE = "_scale"  # compressed-tensors': <module>.weight_scale beside a float8 <module>.weight
QUANTIZED = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.int8))  # FP8 weights; FP4 ones (packed two a byte)
# quantization_config.fmt as the hub's files spell e4m3: DeepSeek's and GLM's "e4m3", MiniMax-M2's "float8_e4m3fn".
# (transformers' FineGrainedFP8Config reads no fmt at all: the weights are the tensors' own float8_e4m3fn.)
E4M3 = ("e4m3", "float8_e4m3fn")
DEFAULT_BLOCK = (128, 128)  # FineGrainedFP8Config's weight_block_size where config.json has none
FROM_SCALES = (0, 0)  # weight_block_size null (per-tensor FP8): each weight's block derived from its scales' grid


def block_size(quantization: dict | None, refuse: Callable[[str, Any, str], UserError],
               per_tensor: bool = False) -> tuple[int, int] | None:
    """The ``weight_block_size`` of a block-FP8 ``quantization_config`` (None where there is none);
    ``refuse(key, value, why)``: the family's one-line refusal (``Fields.refuse``), raised for an
    fmt other than e4m3 and, unless ``per_tensor``, for per-tensor scales (``weight_block_size``
    null: Mistral's FP8 files), which ``per_tensor`` reads as ``FROM_SCALES``."""
    if not quantization:
        return None
    fmt = quantization.get("fmt", "e4m3")
    if fmt not in E4M3:
        raise refuse("quantization_config.fmt", fmt, f"the FP8 weights read are e4m3 ({' or '.join(E4M3)})")
    block = quantization.get("weight_block_size", list(DEFAULT_BLOCK))
    if block is None and per_tensor:
        return FROM_SCALES
    if block is None:
        raise refuse("quantization_config.weight_block_size", None, "per-tensor FP8 scales are not read (block-FP8 "
                     "only: a [rows, columns] block per weight_scale_inv entry)")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise refuse("quantization_config.weight_block_size", block, "two positive integers: rows, columns")
    return tuple(block)


def dequantized(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """weight [..., R, C] float8, scale_inv [..., ceil(R / r), ceil(C / c)] -> float32 [..., R, C]
    (``block`` ``FROM_SCALES``: the block ``scale_grid_block`` derives)."""
    if block == FROM_SCALES:
        scale_inv, block = scale_grid_block(weight, scale_inv)
    (rows, cols), (r, c) = weight.shape[-2:], block
    grid = (-(-rows // r), -(-cols // c))
    if scale_inv.shape[-2:] != grid or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise UserError(f"FP8 weight {list(weight.shape)} and its scales {list(scale_inv.shape)} do not match "
                        f"weight_block_size {list(block)} (expected scales {list(weight.shape[:-2]) + list(grid)})")
    scale = np.repeat(np.repeat(scale_values(scale_inv), r, axis=-2)[..., :rows, :], c, axis=-1)[..., :cols]
    return weight.astype(np.float32) * scale  # [..., R, C]


def scale_grid_block(weight: np.ndarray, scale_inv: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
    """(scale_inv as a grid [..., R / r, C / c], the block (r, c) of weight [..., R, C] each entry
    scales), derived from the scales' shape as transformers' ``Fp8Dequantize`` derives it: a 0-d
    or [1] scale is the whole (2-D) weight's; ``UserError`` where the grid does not divide it."""
    if scale_inv.ndim < 2 and scale_inv.size == 1:  # per-tensor: a scalar
        scale_inv = scale_inv.reshape(1, 1)
    grid = scale_inv.shape[-2:]
    if (scale_inv.ndim != weight.ndim or scale_inv.shape[:-2] != weight.shape[:-2]
            or weight.shape[-2] % grid[0] or weight.shape[-1] % grid[1]):
        raise UserError(f"FP8 weight {list(weight.shape)} is not divided evenly by its scales' grid "
                        f"{list(scale_inv.shape)} (weight_block_size null: each scale's block is the weight's "
                        "rows and columns over the grid's)")
    return scale_inv, (weight.shape[-2] // grid[0], weight.shape[-1] // grid[1])


def scale_values(scale_inv: np.ndarray) -> np.ndarray:
    """Scales as float32: float ones widened, e8m0 bytes held as uint8 read as 2 ** (byte - 127) (as
    transformers' ``Fp8Dequantize`` reads MXFP8's)."""
    if scale_inv.dtype == np.uint8:
        return np.ldexp(np.float32(1), scale_inv.astype(np.int32) - 127)
    return scale_inv.astype(np.float32)


def scale_name(checkpoint, name: str) -> str | None:
    """The name of tensor ``name``'s FP8 (or FP4) scales in a ``model.checkpoint.Checkpoint``:
    ``<name>_scale_inv``; for a float8 or int8 ``<module>.weight`` DeepSeek-V4's ``<module>.scale``;
    for a float8 one compressed-tensors' ``<name>_scale``; None where it has none."""
    if name + SCALE in checkpoint:
        return name + SCALE
    if not name.endswith(".weight"):
        return None
    hub = name.removesuffix(".weight") + HUB_SCALE
    if hub in checkpoint and checkpoint.dtype(name) in QUANTIZED:
        return hub
    # (a float weight beside a *_scale is no quantized one: compressed-tensors' other formats, or not its own)
    if name + COMPRESSED_SCALE in checkpoint and checkpoint.dtype(name) == ml_dtypes.float8_e4m3fn:
        return name + COMPRESSED_SCALE
    return None


def shape(checkpoint, name: str) -> tuple[int, ...]:
    """Tensor ``name``'s shape once read (``read``): an FP4 weight's columns twice its bytes."""
    stored = checkpoint.shape(name)
    if checkpoint.dtype(name) == np.int8 and scale_name(checkpoint, name) is not None:
        return (*stored[:-1], 2 * stored[-1])
    return stored


def read(checkpoint, name: str, block: tuple[int, int] | None,
         experts: tuple[int, int] | None = None) -> np.ndarray:
    """Tensor ``name`` of a ``model.checkpoint.Checkpoint``, dequantized where it is a block-FP8
    weight (it has scales: ``scale_name``; ``block``: the config's ``weight_block_size``) or an FP4
    one (int8 with scales: ``model.mxfp4.rows``); ``experts``: of a stack of experts' weights
    [E, ...], only experts [first, last), their scales read for the same range."""
    tensor = checkpoint.tensor(name, experts)
    scales = scale_name(checkpoint, name)
    if scales is None:
        if tensor.dtype == ml_dtypes.float8_e4m3fn:  # raw float8 values are no weights without their scales
            hub = (f", {name + COMPRESSED_SCALE!r} or {name.removesuffix('.weight') + HUB_SCALE!r}"
                   if name.endswith(".weight") else "")
            raise UserError(f"checkpoint tensor {name!r} is float8 and has no {name + SCALE!r}{hub} (its FP8 scales)")
        return tensor
    if block is None:
        raise UserError(f"checkpoint tensor {name!r} has FP8 scales, and config.json no fp8 quantization_config")
    # (a scalar scale has no experts to range over: dequantized refuses it for a stack)
    scale_inv = checkpoint.tensor(scales, experts if checkpoint.shape(scales) else None)
    if tensor.dtype == np.int8:  # FP4 (transformers' Fp8Dequantize: an int8 weight is two e2m1 values a byte)
        return mxfp4.rows(tensor, scale_inv, name)
    try:
        return dequantized(tensor, scale_inv, block)
    except UserError as e:  # the scales' mismatch, naming the tensor
        raise UserError(f"checkpoint tensor {name!r}: {e}") from None
