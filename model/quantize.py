"""Float8 storage: each stored row scaled into float8 e4m3's range by a float32 scale of its own.

A row is one token's values at one site and layer (or a pooled selection's one row). Its scale is
the row's absolute maximum x ``INVERSE_MAX`` (1/448 in float32; 448 is the largest finite
``float8_e4m3fn``), so the row's largest value becomes +-448 (to within float32 rounding) and
every other value keeps e4m3's 3 mantissa bits relative to its own magnitude (a rounding error of
at most 2^-4 of it), down to e4m3's smallest normal value (2^-6, 1/28,672 of the row's maximum),
below which the step is fixed (2^-9 of the scale). The division and the rounding run on the device
inside the compiled step, before the copy to the host: a quarter of float32's bytes cross and are
stored, plus 4 bytes a row for the scale. A row of zeros has scale 0 and stays zeros. Reading
multiplies back in float32 (``dequantize``): exact, so every reader, and a plain numpy read, gets
the same float32 rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value (no infinities: 0x7f/0xff are NaN)
# The scale is a product, not a quotient: XLA turns a division by a constant into this product
# anyway, so written so it is the same number on every backend and in numpy.
INVERSE_MAX = np.float32(1 / E4M3_MAX)
SCALE_BYTES = np.dtype(np.float32).itemsize  # what each stored row's scale adds


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., W] -> (values [..., W] float8_e4m3fn, scale [...] float32): x / scale rounded to the
    nearest e4m3 value (ties to even), scale = max |x| over W x ``INVERSE_MAX``."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) * INVERSE_MAX  # [...]
    divisor = jnp.where(scale > 0, scale, 1.0)[..., None]  # a zero row divides by 1: zeros, not NaN
    return (x / divisor).astype(jnp.float8_e4m3fn), scale


def dequantized_rows(values: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 [..., W] of ``quantize_rows``' output, on the device (what a reader gets)."""
    return values.astype(jnp.float32) * scale[..., None]


def dequantize(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 [..., W] of stored float8 ``values`` [..., W] and their rows' ``scale`` [...]."""
    return values.astype(np.float32) * np.asarray(scale, np.float32)[..., None]


class Float8Rows(NamedTuple):
    """Rows as a float8 store holds them, for a reader asked not to dequantize."""
    values: np.ndarray  # [rows, width] float8_e4m3fn
    scale: np.ndarray   # [rows] float32

    def dequantized(self) -> np.ndarray:
        return dequantize(self.values, self.scale)
