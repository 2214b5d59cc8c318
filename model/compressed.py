"""DeepSeek-V4's attention (``model.config.CompressedAttention``), as transformers'
``DeepseekV4Attention`` computes it: one key/value head attended through a sliding window and,
beside it, compressed entries of the whole past.

A block's query (low rank, then each head RMS-normed without a weight) and its one key/value head
(read as key and as value) rotate their last ``rope_dim`` dims by interleaved pairs; the heads'
outputs are rotated back at the query's position (the values' rotation undone), then projected in
groups (``o_a_proj``, a block-diagonal [groups, N D / groups, rank]) and together (``o_b_proj``).
gpt-oss's sinks join every query's softmax.

Compressed entries (``Compressor``): the positions in windows of ``rate`` from position 0 (a row's
first real token: rows are right-padded); a window's entry, per channel, the softmax over its slots
of (gate + position bias)-weighted ``kv_proj`` rows, RMS-normed and rotated at the window's first
position. A query at p sees the entries of windows closed at p, those w with (w + 1) rate - 1 <= p:
all of them in a heavily compressed (HCA) block, only its indexer's ``topk`` best in a compressed
sparse (CSA) one, whose entries also overlap the window before (2 rate slots: the previous window's
first projection series, then the window's own second one). The indexer is DeepSeek-V3.2's scoring
(``model.indexer.index_scores``) over its own compressor's entries at its head size.

Keys and entries are attended together, one block of ``QUERY_BLOCK`` queries at a time (each over
every key, the window's mask applied). A decoding cache holds per position the key/value row and
each compressor's projections, from which every step recomputes the entries (what transformers'
cache accumulates, without its buffering).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention import cache_written, dense_attention, over_query_blocks, windowed
from model.config import CSA, DecoderConfig
from model.heads import heads_output
from model.indexer import chosen_keys, index_scores
from model.layers import RMSNorm, accumulation, dense, precision_for, rms_normalized
from model.rope import apply_rope, rope_cos_sin
from model.sites import INDEXED_KEYS

QUERY_BLOCK = 128  # queries attended together, at most: [B, heads, 128, keys + entries] float32 at a time
Cached = Callable[[jax.Array], jax.Array] | None  # per-position rows [B, S, 1, W] -> the cache's [B, T, 1, W]


def rotated_tail(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, S, heads, D] with its last R dims rotated by interleaved pairs (tables [B, S, R])."""
    r = cos.shape[-1]
    return jnp.concatenate([x[..., :-r], apply_rope(x[..., -r:], cos, sin, interleaved=True)], axis=-1)


def window_entries(kv: jax.Array, gate: jax.Array, bias: jax.Array, rate: int, overlap: bool) -> jax.Array:
    """Each whole window's entry before its norm: ``kv``, ``gate`` [B, T, W] (W = 2 D with ``overlap``:
    two series), ``bias`` [rate, W] -> [B, T // rate, D], per channel sum over the window's slots of
    softmax(gate + bias) x kv (with ``overlap`` over the previous window's first series and its own
    second: 2 rate slots, the first window's previous ones weightless)."""
    b, t, w = kv.shape
    n = t // rate
    if n == 0:  # shorter than a window: no entry yet
        return jnp.zeros((b, 0, w // 2 if overlap else w), kv.dtype)
    windows = lambda y: y[:, :n * rate].reshape(b, n, rate, w)                        # [B, n, rate, W]
    kv, gate = windows(kv), windows(gate).astype(jnp.float32) + bias.astype(jnp.float32)
    if overlap:
        d = w // 2
        before = lambda y, fill: jnp.pad(y[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=fill)
        kv = jnp.concatenate([before(kv, 0), kv[..., d:]], axis=2)                     # [B, n, 2 rate, D]
        gate = jnp.concatenate([before(gate, -jnp.inf), gate[..., d:]], axis=2)
    weights = jax.nn.softmax(gate, axis=2).astype(kv.dtype)
    # As transformers: the weights rounded to kv's dtype, the products in it, their sum rounded once.
    return jnp.sum(kv * weights, axis=2)                                               # [B, n, D]


def entry_visible(positions: jax.Array, entries: int, rate: int) -> jax.Array:
    """[B, S, n]: whether the query at each position sees entry w (its window closed at it)."""
    return jnp.arange(entries)[None, None, :] < ((positions + 1) // rate)[:, :, None]


class Compressor(nn.Module):
    """One compressor's parameters (``kv_proj``, ``gate_proj``, ``position_bias`` [rate, W] in float32,
    ``kv_norm``) and its entries."""
    config: DecoderConfig
    head_dim: int
    rate: int
    overlap: bool
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, cached: Cached = None) -> tuple[jax.Array, jax.Array]:
        """x [B, S, H] -> (the entries of every whole window [B, T // rate, D] (T: the cache's length,
        else S), rotated; the projections per position [B, T, 1, 2 W]: the cache ``cached`` wrote them
        into, or x's)."""
        c = self.config
        width = self.head_dim * (2 if self.overlap else 1)
        accumulate = accumulation(self.dtype, self.residual_dtype)
        kv = dense(width, False, "kv_proj", self.dtype, accumulate)(x)                 # [B, S, W]
        gate = dense(width, False, "gate_proj", self.dtype, accumulate)(x)             # [B, S, W]
        rows = jnp.concatenate([kv, gate.astype(kv.dtype)], axis=-1)[:, :, None]      # [B, S, 1, 2 W]
        every = rows if cached is None else cached(rows)                               # [B, T, 1, 2 W]
        bias = self.param("position_bias", nn.initializers.zeros, (self.rate, width), jnp.float32)
        entries = window_entries(every[:, :, 0, :width], every[:, :, 0, width:], bias, self.rate, self.overlap)
        entries = RMSNorm(c.norm_eps, self.dtype, self.residual_dtype, weight_in_float32=True,
                          name="kv_norm")(entries)                                     # [B, n, D]
        n = entries.shape[1]
        cos, sin = rope_cos_sin(jnp.arange(n)[None] * self.rate, c.compressed.rope_dim, c.compressed.rope)
        return rotated_tail(entries[:, :, None], cos, sin)[:, :, 0], every


class CompressedIndexer(nn.Module):
    """A CSA block's indexer: its own compressor (at the index head size), ``q_b_proj`` from the
    normed low-rank query and ``weights_proj``, as transformers' ``DeepseekV4Indexer``."""
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, q_resid: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array,
                 cached: Cached = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, S, H]; ``q_resid`` [B, S, q_lora_rank] (the normed low-rank query); ``cos``, ``sin`` [B, S,
        rope_dim] (the block's rotary at the queries' positions); ``positions`` [B, S]; ``cached``: as
        ``Compressor``'s. -> (each query's chosen entries as a mask [B, S, n], their numbers [B, S, topk] int32, best
        first, -1 past the entries a query sees; its compressor's projections per position, as
        ``Compressor`` returns them)."""
        c = self.config
        ca, ix = c.compressed, c.compressed.indexer
        b, s, _ = x.shape
        accumulate = accumulation(self.dtype, self.residual_dtype)
        entries, rows = Compressor(c, ix.head_dim, ca.csa_rate, True, self.dtype, self.residual_dtype,
                                   name="compressor")(x, cached)                      # [B, n, Di]
        q = dense(ix.num_heads * ix.head_dim, False, "q_b_proj", self.dtype, accumulate)(q_resid)
        q = rotated_tail(q.reshape(b, s, ix.num_heads, ix.head_dim), cos, sin)         # [B, S, Hi, Di]
        weights = dense(ix.num_heads, False, "weights_proj", self.dtype, accumulate)(x)
        weights = weights.astype(jnp.float32) * ix.num_heads ** -0.5                   # [B, S, Hi]
        index = index_scores(q.astype(jnp.float32), entries.astype(jnp.float32) * ix.head_dim ** -0.5, weights)
        visible = entry_visible(positions, entries.shape[1], ca.csa_rate)             # [B, S, n]
        allowed, ids = chosen_keys(index, visible, ix.topk)
        return allowed, ids, rows


class CompressedAttention(nn.Module):
    """One DeepSeek-V4 attention block of ``kind`` (``model.config.SLIDING_ONLY``, ``CSA``, ``HCA``)."""
    config: DecoderConfig
    kind: str
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None
    window: int | None = None

    @nn.compact
    def __call__(self, x, cos, sin, mask, positions, cache=None, cache_index=None, heads=None, norms=None):
        """x [B, S, H]; ``cos``, ``sin`` [B, S, rope_dim]; ``mask`` [B, S, T] (causal, its window applied
        here); ``cache``: (keys [B, T, 1, D], the compressor's projections[, the indexer's]) written from
        ``cache_index``; ``heads``, ``norms``: as ``model.decoder.Attention``'s. -> ([B, S, H], the new
        cache, or None without one)."""
        c, ca = self.config, self.config.compressed
        b, s, _ = x.shape
        n, d = c.num_attention_heads, c.head_dim
        accumulate = accumulation(self.dtype, self.residual_dtype)
        project = lambda width, name: dense(width, False, name, self.dtype, accumulate)
        norm = lambda name, y: RMSNorm(c.norm_eps, self.dtype, self.residual_dtype, weight_in_float32=True,
                                       name=name)(y, norms)
        q_resid = norm("q_a_norm", project(ca.q_lora_rank, "q_a_proj")(x))            # [B, S, Rq]
        q = project(n * d, "q_b_proj")(q_resid).reshape(b, s, n, d)                    # [B, S, N, D]
        q = rotated_tail(rms_normalized(q, c.norm_eps).astype(q.dtype), cos, sin)
        kv = rotated_tail(norm("kv_norm", project(d, "kv_proj")(x))[:, :, None], cos, sin)  # [B, S, 1, D]
        written = lambda slot: lambda rows: cache_written(cache[slot], rows.astype(cache[slot].dtype), cache_index)
        keys = kv if cache is None else written(0)(kv)                                 # [B, T, 1, D]
        allowed = windowed(mask, positions, self.window)                               # [B, S, T]
        new_cache = [keys]
        rate = ca.rate(self.kind)
        if rate:
            entries, rows = Compressor(c, d, rate, self.kind == CSA, self.dtype, self.residual_dtype,
                                       name="compressor")(x, None if cache is None else written(1))
            new_cache.append(rows)
            if self.kind == CSA:
                seen, ids, index_rows = CompressedIndexer(c, self.dtype, self.residual_dtype, name="indexer")(
                    x, q_resid, cos, sin, positions, None if cache is None else written(2))
                new_cache.append(index_rows)
                self.sow("sites", INDEXED_KEYS, ids)                                   # [B, S, topk] int32
            else:
                seen = entry_visible(positions, entries.shape[1], rate)                 # [B, S, n]
            keys = jnp.concatenate([keys, entries[:, :, None].astype(keys.dtype)], axis=1)  # [B, T + n, 1, D]
            allowed = jnp.concatenate([allowed, seen], axis=-1)                        # [B, S, T + n]
        sinks = self.param("sinks", nn.initializers.zeros, (n,), jnp.float32).reshape(1, n)  # [K, G]
        out = blocked_attention(q.reshape(b, s, 1, n, d), keys, allowed, d ** 0.5, sinks, precision_for(self.dtype),
                                accumulate)                                            # [B, S, 1, N, D]
        out = rotated_tail(out.reshape(b, s, n, d).astype(self.dtype), cos, -sin)     # the values' rotation undone
        out = heads_output(self, out, heads)                                           # [B, S, N*D]
        groups = ca.output_groups
        # As torch holds it, [G x rank, N D / G]: group g's rows project its heads' outputs.
        grouped = self.param("o_a_proj", nn.initializers.normal(0.02), (groups * ca.output_rank, n * d // groups),
                             self.dtype).reshape(groups, ca.output_rank, -1)          # [G, rank, N D / G]
        out = jnp.einsum("bsgi,gri->bsgr", out.reshape(b, s, groups, -1), grouped, precision=precision_for(self.dtype),
                         preferred_element_type=accumulate)                           # [B, S, G, rank]
        out = project(c.hidden_size, "o_b_proj")(out.reshape(b, s, -1).astype(self.dtype))
        return out, None if cache is None else tuple(new_cache)


def blocked_attention(q: jax.Array, keys: jax.Array, allowed: jax.Array, divisor: float, sinks: jax.Array,
                      precision, accumulate) -> jax.Array:
    """q [B, S, 1, N, D] over keys [B, T, 1, D] (also the values) where ``allowed`` [B, S, T], one block
    of ``QUERY_BLOCK`` queries at a time -> [B, S, 1, N, D]."""
    attend = lambda q_block, allowed_block: dense_attention(q_block, keys, keys, allowed_block, precision, accumulate,
                                                            divisor, None, sinks)
    return over_query_blocks(attend, q, allowed, block=QUERY_BLOCK)
