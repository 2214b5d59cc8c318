"""Qwen4-Exp's hashed n-gram injection (``NGram``; transformers' ``Qwen4ExpTextPLELayer``, its "PLE").

On its blocks, before the attention collapse, each token's n-grams of orders 2 to ``order`` within
its segment (an eos token ends one) are hashed into prime-sized tables, the rows concatenated; a key
and a value projection of that gate, per stream, a copy of the value by the signed square root of the
key's match with the RMS-normed stream, and that plus a dilated causal convolution of it is added to
the streams. This module holds:

* ``ngram_constants``: a block's hash constants (splitmix64 multipliers, per-head primes, offsets,
  table rows), in plain Python, as transformers builds its buffers;
* ``segment_shifts`` and ``hashed_rows``: the table rows of each token, exactly transformers' int64
  hash, computed in 32-bit JAX integers (JAX runs without x64 here): 64-bit products and XORs held
  as 16-bit limbs and (hi, lo) uint32 pairs, the remainder by Horner over chunks small enough that
  nothing passes 2^32;
* ``NGramInjection``: the whole layer, with its decoding cache (``ngram_cache_shapes``).

Axis names in shape comments: B batch, S positions, N streams, H hidden_size, C = order - 1 (the
context an n-gram reads), P heads (tables) a token looks up, W = (conv_kernel - 1) * order (the
convolution's window).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import NGram
from model.layers import RMSNorm, dense

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15       # splitmix64's increment (the golden ratio's 64 bits)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LAYER_STRIDE = 10007             # transformers' _PRIME_1: each block's seed is seed + 10007 * rank


class NGramConstants(NamedTuple):
    """One block's hash constants: transformers' buffers ``layer_multipliers`` [order],
    ``ngram_heads_vocab_sizes`` [P] (primes), ``ngram_heads_offsets`` [P], and its table's rows."""
    multipliers: tuple[int, ...]
    primes: tuple[int, ...]
    offsets: tuple[int, ...]
    rows: int


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _MIX1) & _MASK64
    value = ((value ^ (value >> 27)) * _MIX2) & _MASK64
    return value ^ (value >> 31)


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def _primes_from(start: int, skip: int, count: int) -> list[int]:
    """The ``count`` primes >= ``start`` that follow the first ``skip`` of them."""
    found, value = [], start
    while len(found) < skip + count:
        if _is_prime(value):
            found.append(value)
        value += 1
    return found[skip:]


@functools.lru_cache(maxsize=None)
def ngram_constants(ngram: NGram, rank: int, vocab_size: int) -> NGramConstants:
    """The hash constants of the ``rank``-th n-gram block (its place in ``ngram.layers``) for a
    vocabulary of ``vocab_size`` tokens, as transformers' ``Qwen4ExpTextNGramEmbedding`` builds them."""
    # Odd multipliers below 2^63 / vocab_size: a token times one never overflows int64.
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    seed = ngram.seed + _LAYER_STRIDE * rank
    multipliers = tuple(2 * (_splitmix64((seed + _GAMMA * (t + 1)) & _MASK64) % half) + 1
                        for t in range(ngram.order))
    # One series of consecutive primes from vocab_base on, across the blocks in rank order.
    primes = tuple(_primes_from(ngram.vocab_base, rank * ngram.heads, ngram.heads))
    offsets = tuple(sum(primes[:h]) for h in range(ngram.heads))
    rows = -(-sum(primes) // ngram.rows_multiple) * ngram.rows_multiple
    return NGramConstants(multipliers, primes, offsets, rows)


def ngram_cache_shapes(ngram: NGram, hidden_size: int, streams: int, batch: int) -> tuple[tuple[int, ...], ...]:
    """The decoding cache's shapes: (the normed gated values' window [B, W, N*H] in the compute
    dtype, the last C token ids [B, C] int32)."""
    window = (ngram.conv_kernel - 1) * ngram.order
    return (batch, window, streams * hidden_size), (batch, ngram.order - 1)


def empty_ngram_cache(ngram: NGram, hidden_size: int, streams: int, batch: int,
                      dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """A cache as of before a sequence's first token: zeros, and eos for the ids (a prefill reads
    neither; a step from it starts a fresh segment, as transformers' does without a cache)."""
    conv, ids = ngram_cache_shapes(ngram, hidden_size, streams, batch)
    return jnp.zeros(conv, dtype), jnp.full(ids, ngram.eos, jnp.int32)


# -- 64-bit hashing in 32-bit integers ----------------------------------------------------------------

def _times(tokens: jax.Array, constant: int) -> tuple[jax.Array, jax.Array]:
    """tokens [B, S] (0 <= id < 2^31) times a 64-bit constant, mod 2^64, as (hi, lo) uint32 [B, S]."""
    t = tokens.astype(jnp.uint32)
    t_limbs = (t & 0xFFFF, t >> 16)                                    # 16-bit limbs, low first
    m_limbs = [(constant >> (16 * j)) & 0xFFFF for j in range(4)]
    # Columns of 16 bits: each partial product (< 2^32) split between its column and the next, so a
    # column sums at most four 16-bit halves (< 2^18) and no uint32 overflows; past 2^64 is dropped.
    columns = [jnp.zeros_like(t) for _ in range(4)]
    for i, ti in enumerate(t_limbs):
        for j, mj in enumerate(m_limbs):
            if i + j > 3 or mj == 0:
                continue
            product = ti * jnp.uint32(mj)
            columns[i + j] = columns[i + j] + (product & 0xFFFF)
            if i + j < 3:
                columns[i + j + 1] = columns[i + j + 1] + (product >> 16)
    for k in range(3):  # carries up, each column back to 16 bits
        columns[k + 1] = columns[k + 1] + (columns[k] >> 16)
        columns[k] = columns[k] & 0xFFFF
    return ((columns[3] & 0xFFFF) << 16) | columns[2], (columns[1] << 16) | columns[0]


def _bits(hi: jax.Array, lo: jax.Array, start: int, width: int) -> jax.Array:
    """Bits [start, start + width) of the 64-bit (hi, lo), as uint32 (width < 32)."""
    mask = jnp.uint32((1 << width) - 1)
    if start >= 32:
        return (hi >> (start - 32)) & mask
    if start + width <= 32:
        return (lo >> start) & mask
    return ((lo >> start) | (hi << (32 - start))) & mask


def _remainder(hi: jax.Array, lo: jax.Array, primes: Sequence[int]) -> jax.Array:
    """The unsigned 64-bit (hi, lo) [B, S] mod each prime (< 2^31) -> [B, S, len(primes)] uint32."""
    # Horner from the top over chunks of w bits: r < q, so r * 2^w + chunk < q * 2^w <= 2^32.
    w = 32 - max(primes).bit_length()
    q = jnp.asarray(primes, jnp.uint32)                                # [P]
    hi, lo = hi[..., None], lo[..., None]                              # [B, S, 1]
    r = jnp.zeros(hi.shape[:-1] + (len(primes),), jnp.uint32)          # [B, S, P]
    for start in reversed(range(0, 64, w)):
        width = min(w, 64 - start)
        r = ((r << width) | _bits(hi, lo, start, width)) % q
    return r


def segment_shifts(token_ids: jax.Array, context: jax.Array, order: int, eos: int) -> list[jax.Array]:
    """The tokens each n-gram reads: shift s (0 .. order - 1) [B, S] int32 is the token s places
    back, or eos where an eos lies between (an eos token belongs to the segment it ends: its own
    n-grams read the tokens before it). ``context`` [B, C]: the C tokens before ``token_ids`` [B, S]
    (eos before a sequence's start), as transformers' token history and its cache slot 2."""
    c, s = order - 1, token_ids.shape[1]
    history = jnp.concatenate([context.astype(jnp.int32), token_ids.astype(jnp.int32)], axis=1)  # [B, C + S]
    shifts, ended = [history[:, c:]], jnp.zeros(token_ids.shape, bool)
    for back in range(1, order):
        earlier = history[:, c - back:c - back + s]                    # [B, S]
        # An eos at the read position or after it (before the current one) starts a later segment.
        ended = ended | (earlier == eos)
        shifts.append(jnp.where(ended, eos, earlier))
    return shifts


def hashed_rows(shifts: Sequence[jax.Array], constants: NGramConstants, heads_per_order: int) -> jax.Array:
    """Each token's table rows [B, S, P] int32 from ``segment_shifts``: for order n, the XOR over
    s < n of shift_s * multiplier_s (int64, exactly), mod each of the order's primes, plus its offset;
    heads in transformers' order (order 2's, then 3's, ...)."""
    hi, lo = _times(shifts[0], constants.multipliers[0])
    blocks = []
    for n in range(2, len(shifts) + 1):
        term_hi, term_lo = _times(shifts[n - 1], constants.multipliers[n - 1])
        hi, lo = hi ^ term_hi, lo ^ term_lo
        heads = slice((n - 2) * heads_per_order, (n - 1) * heads_per_order)
        rows = _remainder(hi, lo, constants.primes[heads]) + jnp.asarray(constants.offsets[heads], jnp.uint32)
        blocks.append(rows.astype(jnp.int32))                          # [B, S, heads_per_order]
    return jnp.concatenate(blocks, axis=-1)                            # [B, S, P]


# -- the layer --------------------------------------------------------------------------------------

def _window_at(padded: jax.Array, lengths: jax.Array, width: int) -> jax.Array:
    """padded [B, width + S, ...] (``width`` leading positions before the sequence) -> each row's
    last ``width`` positions before its length [B, width, ...]."""
    where = lengths[:, None] + jnp.arange(width)[None, :]              # [B, width]
    where = where.reshape(where.shape + (1,) * (padded.ndim - 2))
    return jnp.take_along_axis(padded, where, axis=1)


def _dilated_conv(padded: jax.Array, weight: jax.Array, dilation: int, s: int, dtype) -> jax.Array:
    """SiLU of the depthwise conv: padded [B, W + S, C] (W = (K - 1) * dilation earlier positions
    first), weight [C, K] -> [B, S, C], position t from t, t - d, ..., t - (K - 1) d. Accumulated
    in float32 and rounded, then SiLU rounded, as torch's conv1d and F.silu in the model dtype."""
    taps = weight.shape[-1]
    w = weight.astype(jnp.float32)
    x = padded.astype(jnp.float32)
    out = sum(x[:, k * dilation:k * dilation + s] * w[:, k] for k in range(taps))  # [B, S, C]
    return jax.nn.silu(out.astype(dtype).astype(jnp.float32)).astype(dtype)


class NGramInjection(nn.Module):
    """One block's n-gram injection (transformers' ``Qwen4ExpTextPLELayer``, ``model.layers.{i}.ple``).

    Parameters: ``ngram_embedding`` [rows, embed_dim // P] (a plain param: ``ple_embedding.
    ngram_embedding.weight``), ``key_proj``/``value_proj`` kernels [embed_dim, N*H] / [embed_dim, H]
    (the torch weights transposed), ``norm_key``/``norm_query``/``norm_conv`` (RMSNorms per stream, (1 + w)
    weights), ``conv1d`` [N*H, 1, K] as torch holds it.

    Cache (decoding): (the last W normed gated values [B, W, N*H] in ``dtype``, zeros before the
    first; the last C token ids [B, C] int32, eos before the first): transformers' conv states 1 and
    2 (time on axis 1 here, last in torch)."""
    ngram: NGram
    rank: int              # the block's place among the n-gram blocks
    hidden_size: int
    streams: int
    vocab_size: int
    norm_eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, streams: jax.Array, token_ids: jax.Array, lengths: jax.Array | None = None,
                 cache: tuple[jax.Array, jax.Array] | None = None):
        """streams [B, S, N*H] in ``dtype``, token_ids [B, S] int32; ``lengths`` [B]: each row's real
        positions (right padding), None for all. With ``cache`` and ``lengths``: a prefill (the
        cache's contents are not read), returning each row's cache at its length; with ``cache``
        and no ``lengths``: decoding steps after the cached positions. -> (the addition to the
        streams [B, S, N*H] in ``dtype``, the new cache or None)."""
        g, dt, f32 = self.ngram, self.dtype, jnp.float32
        h, n = self.hidden_size, self.streams
        b, s = token_ids.shape
        c, window = g.order - 1, (g.conv_kernel - 1) * g.order
        constants = ngram_constants(g, self.rank, self.vocab_size)
        decoding = cache is not None and lengths is None
        real = None if lengths is None else jnp.arange(s)[None, :] < lengths[:, None]  # [B, S]

        # Padding reads eos (transformers' ple_input_ids), so it stands as a segment boundary.
        ids = (token_ids if real is None else jnp.where(real, token_ids, g.eos)).astype(jnp.int32)  # [B, S]
        context = cache[1] if decoding else jnp.full((b, c), g.eos, jnp.int32)            # [B, C]
        rows = hashed_rows(segment_shifts(ids, context, g.order, g.eos), constants, g.heads_per_order)
        table = self.param("ngram_embedding", nn.initializers.normal(0.02),
                           (constants.rows, g.embed_dim // g.heads), dt)
        embedded = jnp.take(table, rows, axis=0).reshape(b, s, g.embed_dim)              # [B, S, E]

        # transformers' grouped Qwen4ExpTextRMSNorm: each stream of H normed apart, (1 + w) in float32, rounded.
        norm = lambda name, x: RMSNorm(self.norm_eps, dt, unit_offset=True, groups=n, name=name)(x)
        keys = norm("norm_key", dense(n * h, False, "key_proj", dt)(embedded))
        value = dense(h, False, "value_proj", dt)(embedded)                               # [B, S, H]
        queries = norm("norm_query", streams)
        keys, queries = keys.reshape(b, s, n, h), queries.reshape(b, s, n, h)            # [B, S, N, H]
        # Every step in the model dtype as torch rounds it: the product, its sum, the scaling.
        match = (keys.astype(f32) * queries.astype(f32)).astype(dt)
        score = jnp.sum(match.astype(f32), axis=-1, keepdims=True).astype(dt)           # [B, S, N, 1]
        score = (score.astype(f32) / math.sqrt(h)).astype(dt)
        # The signed square root, kept away from 0 where its slope is infinite.
        root = jnp.sqrt(jnp.maximum(jnp.abs(score), jnp.asarray(1e-6, dt)).astype(f32)).astype(dt)
        score = root * jnp.sign(score)
        gate = jax.nn.sigmoid(score.astype(f32)).astype(dt)
        gated = (gate.astype(f32) * value[:, :, None, :].astype(f32)).astype(dt).reshape(b, s, n * h)  # [B, S, N*H]
        gated_normed = norm("norm_conv", gated)
        if real is not None:  # transformers zeros both at padding (its conv_mask)
            gated = jnp.where(real[..., None], gated, 0).astype(dt)
            gated_normed = jnp.where(real[..., None], gated_normed, 0).astype(dt)

        conv = self.param("conv1d", nn.initializers.zeros, (n * h, 1, g.conv_kernel), dt)
        before = cache[0].astype(dt) if decoding else jnp.zeros((b, window, n * h), dt)
        padded = jnp.concatenate([before, gated_normed], axis=1)                          # [B, W + S, N*H]
        addition = (gated.astype(f32) + _dilated_conv(padded, conv[:, 0, :], g.order, s, dt).astype(f32)).astype(dt)

        if cache is None:
            return addition, None
        history = jnp.concatenate([context, ids], axis=1)                                 # [B, C + S]
        if decoding:
            return addition, (padded[:, s:], history[:, s:])
        return addition, (_window_at(padded, lengths, window), _window_at(history, lengths, c))
