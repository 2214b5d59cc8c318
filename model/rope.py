"""Rotary position embeddings: the frequencies of each implemented RoPE type (default, linear,
llama3, YaRN, Gemma 4's proportional), as transformers computes them (float32), and their
application in the rotate-half form."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from model.config import RoPE


def inverse_frequencies(head_dim: int, rope: RoPE) -> jax.Array:
    """[D/2] float32 rotation frequencies of one head's dimension pairs."""
    inv_freq = 1.0 / (rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rope.kind == "proportional":  # the first pairs at the whole head's frequencies, the rest still
        rotated = int(rope.fraction * head_dim // 2)
        return jnp.where(jnp.arange(head_dim // 2) < rotated, inv_freq, 0.0) / rope.factor
    if rope.kind == "linear":  # positions stretched by factor
        return inv_freq / rope.factor
    if rope.kind == "yarn":
        return yarn_frequencies(head_dim, rope)
    if rope.kind == "llama3":  # long wavelengths stretched by factor, short ones kept, smooth between
        context = rope.original_max_position_embeddings
        wavelength = 2 * math.pi / inv_freq
        stretched = jnp.where(wavelength > context / rope.low_freq_factor, inv_freq / rope.factor, inv_freq)
        smooth = (context / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * stretched / rope.factor + smooth * stretched
        medium = ~(wavelength < context / rope.high_freq_factor) & ~(wavelength > context / rope.low_freq_factor)
        return jnp.where(medium, smoothed, stretched)
    return inv_freq


def yarn_frequencies(head_dim: int, rope: RoPE) -> jax.Array:
    """YaRN: the pairs that turn more than ``beta_fast`` times over the original context keep
    their frequency, those turning less than ``beta_slow`` times have it divided by ``factor``,
    and a linear ramp over the pairs between blends the two."""
    def pair_turning(turns: float) -> float:  # the pair index that turns ``turns`` times over the context
        return head_dim * math.log(rope.original_max_position_embeddings / (turns * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = pair_turning(rope.beta_fast), pair_turning(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # no zero-width ramp
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)  # [D/2]
    kept = 1 - ramp  # the share of each pair's own frequency
    wavelength = rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # [D/2], / 2 pi
    return 1.0 / (rope.factor * wavelength) * (1 - kept) + 1.0 / wavelength * kept


def rope_cos_sin(positions: jax.Array, head_dim: int, rope: RoPE) -> tuple[jax.Array, jax.Array]:
    """Rotary tables for ``positions`` [B, S] -> cos, sin [B, S, D] in float32 (``head_dim``: the
    dims rotated, D), each multiplied by the RoPE's ``attention_factor`` (YaRN's) where it is not 1."""
    freqs = positions.astype(jnp.float32)[..., None] * inverse_frequencies(head_dim, rope)  # [B, S, D/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # [B, S, D]
    if rope.attention_factor != 1.0:
        return jnp.cos(angles) * rope.attention_factor, jnp.sin(angles) * rope.attention_factor
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool = False) -> jax.Array:
    """Rotates ``x`` [B, S, heads, D] by the tables [B, S, R] (Hugging Face's rotate_half form):
    its first R dims, the rest passed through where R < D (partial rotary, as GPT-NeoX and Phi-3
    compute it: rotate_half within the first R). ``interleaved``: dims (2i, 2i + 1) rotate together
    by pair i's angle (Llama 4's complex product, in float32 and rounded once, as it computes it)."""
    if cos.shape[-1] < x.shape[-1]:
        rotary = cos.shape[-1]
        return jnp.concatenate([apply_rope(x[..., :rotary], cos, sin, interleaved), x[..., rotary:]], axis=-1)
    if interleaved:
        half = x.shape[-1] // 2
        cos, sin = cos[:, :, None, :half], sin[:, :, None, :half]  # [B, S, 1, D/2]: one angle per pair
        even, odd = x[..., 0::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)  # [B, S, heads, D/2]
        pairs = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
        return pairs.reshape(x.shape).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
