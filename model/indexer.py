"""DeepSeek sparse attention's lightning indexer (``model.config.Indexer``: DeepSeek-V3.2): which
earlier keys each query of a latent attention block attends to.

Per query, an index score for every earlier key, sum_h w_h relu(q_h . k / sqrt(D)), from index
queries of the normed low-rank query and one index key per position; the query keeps the
``topk`` keys of highest score (every earlier key while there are no more), and attention's mask
is narrowed to them. The scores are computed in float32, one block of queries at a time, so that
their [queries, index heads, keys] never exist for the whole sequence at once. A decoding cache
holds each position's index key.

GLM-5-next's k-pool (``Indexer.pool`` > 1, as transformers' ``Glm5NextTextIndexer``): the keys in
pools of ``pool`` consecutive positions from position 0 (a row's first real token: rows are
right-padded), a pool's key sum_i softmax_i(g_i + ape_i) k_i per channel over its positions (g:
each position's gate scores, x @ index_kpool_compress_gate); a query scores pools, may choose only
those it sees whole, keeps its ``topk // pool`` best, and with ``pool_tail`` also the keys it sees
past its last whole pool. Their positions, ``Indexer.width`` a query: the chosen pools best first,
each pool's positions ascending (-1 for a pool the query could not choose), then the ``pool - 1``
tail slots (its tail's positions ascending, then -1). Transformers puts the tail right after
min(topk // pool, pools whole in any row of the batch) pools: the same layout wherever the batch
has that many. A decoding cache holds each position's index key and gate scores.

Qwen4-Exp's QSA (``Indexer.mean_pool``, an attention block's ``DecoderConfig.attention_indexer``, as
transformers' ``Qwen4ExpTextQSAIndexer``): the same pools and choice, with unweighted heads; a
pool's key is the mean of its positions' raw index keys, then (1 + w) RMS-normed and rotated at the
pool's first position. A decoding cache holds each position's raw index key.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention import over_query_blocks
from model.config import DecoderConfig
from model.layers import LayerNorm, RMSNorm, accumulation, dense, precision_for
from model.rope import apply_rope, rope_cos_sin

QUERY_BLOCK = 128  # queries scored together, at most: [B, 128, index heads, T] float32 at a time
K_NORM_EPS = 1e-6  # transformers builds the index key's LayerNorm with it


def chosen_keys(index: jax.Array, mask: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """From index scores [B, S, T] (float32) and the mask [B, S, T] of the keys each query may see:
    (the mask narrowed to each query's ``topk`` best keys [B, S, T], those keys' positions [B, S,
    topk] int32, best first, -1 where a query sees fewer)."""
    index = jnp.where(mask, index, -jnp.inf)
    values, ids = jax.lax.top_k(index, min(topk, index.shape[-1]))  # [B, S, k]
    found = jnp.isfinite(values)
    b, s, t = index.shape
    rows, queries = jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None]
    allowed = jnp.zeros((b, s, t), bool).at[rows, queries, ids].max(found)
    ids = jnp.where(found, ids, -1)
    return mask & allowed, jnp.pad(ids, ((0, 0), (0, 0), (0, topk - ids.shape[-1])), constant_values=-1)


class LightningIndexer(nn.Module):
    """The indexer of one latent attention block (parameters ``wq_b``, ``wk``, ``k_norm``,
    ``weights_proj``, and with pools ``index_kpool_compress_gate`` [H, D] (transformers' [D, H]
    transposed, as a kernel) and ``index_kpool_compress_ape`` [pool, D], as transformers names them)."""
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None

    @nn.compact
    def __call__(self, x, q_resid, cos, sin, mask, cached: Callable[[jax.Array], jax.Array] | None = None):
        """x [B, S, H]; ``q_resid`` [B, S, q_lora_rank] (the normed low-rank query); ``cos``, ``sin``
        [B, S, qk_rope_head_dim] (None: no rotation); ``mask`` [B, S, T]; ``cached``: decoding, the
        index keys [B, S, 1, D] (with pools [B, S, 1, 2D]: keys, then gate scores) written into their
        cache -> the cache's [B, T, 1, D | 2D] (None: no cache). -> (the mask narrowed to each query's
        chosen keys [B, S, T], their positions [B, S, ``Indexer.width``] int32, the keys scored, as
        ``cached`` takes them)."""
        c, ix = self.config, self.config.mla.indexer
        b, s, _ = x.shape
        accumulate = accumulation(self.dtype, self.residual_dtype)
        rotated = c.mla.qk_rope_head_dim
        rotate = lambda y: (y if cos is None  # (GLM-5-next's NoPE blocks)
                            else jnp.concatenate([apply_rope(y[..., :rotated], cos, sin), y[..., rotated:]], axis=-1))
        q = dense(ix.num_heads * ix.head_dim, False, "wq_b", self.dtype, accumulate)(q_resid)
        q = rotate(q.reshape(b, s, ix.num_heads, ix.head_dim))                           # [B, S, Hi, D]
        k = LayerNorm(K_NORM_EPS, self.dtype, name="k_norm")(dense(ix.head_dim, False, "wk", self.dtype,
                                                                   accumulate)(x))
        k = rotate(k[:, :, None])                                                        # [B, S, 1, D]
        if ix.pool > 1:  # each position's gate scores beside its key
            gate = self.param("index_kpool_compress_gate", nn.initializers.normal(0.02), (x.shape[-1], ix.head_dim),
                              self.dtype)
            gate = jnp.einsum("bsh,hd->bsd", x.astype(self.dtype), gate, precision=precision_for(self.dtype),
                              preferred_element_type=accumulate)
            k = jnp.concatenate([k, gate[:, :, None].astype(k.dtype)], axis=-1)         # [B, S, 1, 2D]
        if cached is not None:
            k = cached(k)                                                                # [B, T, 1, D | 2D]
        weights = dense(ix.num_heads, False, "weights_proj", self.dtype, accumulate)(x)
        weights = weights.astype(jnp.float32) * ix.num_heads ** -0.5                     # [B, S, Hi]
        if ix.pool > 1:
            ape = self.param("index_kpool_compress_ape", nn.initializers.zeros, (ix.pool, ix.head_dim), self.dtype)
            keys = pooled_keys(k[:, :, 0, :ix.head_dim], k[:, :, 0, ix.head_dim:], ape, ix.pool)  # [B, T/P, D]
            index = index_scores(q.astype(jnp.float32), keys * ix.head_dim ** -0.5, weights)  # [B, S, T/P]
            allowed, ids = chosen_pools(index, mask, ix.topk // ix.pool, ix.pool, ix.pool_tail)
            return allowed, ids, k
        keys = k[:, :, 0].astype(jnp.float32) * ix.head_dim ** -0.5                      # [B, T, D]
        index = index_scores(q.astype(jnp.float32), keys, weights)                       # [B, S, T]
        allowed, ids = chosen_keys(index, mask, ix.topk)
        return allowed, ids, k


class MeanPoolIndexer(nn.Module):
    """Qwen4-Exp's QSA indexer of one attention block (parameters ``index_qk_proj``: the index
    queries' rows, then the key's; ``q_layernorm``, ``k_layernorm``, as transformers names them)."""
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None

    @nn.compact
    def __call__(self, x, cos, sin, mask, cached: Callable[[jax.Array], jax.Array] | None = None):
        """x [B, S, H]; ``cos``, ``sin`` [B, S, R]: the queries' rotary tables (the pools' are computed
        at their first positions, with the config's RoPE); ``mask`` [B, S, T]; ``cached`` as
        ``LightningIndexer``'s (raw keys [B, S, 1, D]). -> (the mask narrowed to each query's chosen
        pools and tail [B, S, T], their positions [B, S, ``Indexer.width``] int32, the raw keys)."""
        c, ix = self.config, self.config.attention_indexer
        b, s, _ = x.shape
        heads, d = ix.num_heads, ix.head_dim
        accumulate = accumulation(self.dtype, self.residual_dtype)
        qk = dense((heads + 1) * d, False, "index_qk_proj", self.dtype, accumulate)(x).astype(self.dtype)
        norm = lambda name, y: RMSNorm(c.norm_eps, self.dtype, unit_offset=True, name=name)(y)
        q = apply_rope(norm("q_layernorm", qk[..., :heads * d].reshape(b, s, heads, d)), cos, sin)  # [B, S, Hi, D]
        raw = qk[:, :, None, heads * d:]                                                 # [B, S, 1, D]
        if cached is not None:
            raw = cached(raw)                                                            # [B, T, 1, D]
        t, pool = raw.shape[1], ix.pool
        n = -(-t // pool)
        grouped = jnp.pad(raw[:, :, 0], ((0, 0), (0, n * pool - t), (0, 0))).reshape(b, n, pool, d)
        # The mean in float32, rounded (transformers'); a last pool past T is never whole, never chosen.
        keys = norm("k_layernorm", jnp.mean(grouped.astype(jnp.float32), axis=2).astype(self.dtype))  # [B, T/P, D]
        starts = jnp.broadcast_to(jnp.arange(n) * pool, (b, n))                          # each pool's first position
        key_cos, key_sin = rope_cos_sin(starts, cos.shape[-1], c.rope)
        keys = apply_rope(keys[:, :, None], key_cos.astype(cos.dtype), key_sin.astype(sin.dtype))[:, :, 0]
        index = index_scores(q.astype(jnp.float32), keys.astype(jnp.float32) * d ** -0.5,
                             jnp.ones((b, s, heads), jnp.float32))                       # [B, S, T/P]
        allowed, ids = chosen_pools(index, mask, ix.topk // pool, pool, ix.pool_tail)
        return allowed, ids, raw


def pooled_keys(keys: jax.Array, gates: jax.Array, ape: jax.Array, pool: int) -> jax.Array:
    """Each pool's key, in float32: keys and gate scores [B, T, D], ``ape`` [pool, D] -> [B, ceil(T /
    pool), D], pool j's sum over its positions j*pool + i of softmax_i(gates + ape_i) * keys, per
    channel (a last pool past T, never whole, zero-padded)."""
    b, t, d = keys.shape
    n = -(-t // pool)
    grouped = lambda y: jnp.pad(y, ((0, 0), (0, n * pool - t), (0, 0))).reshape(b, n, pool, d)
    weights = jax.nn.softmax(grouped(gates).astype(jnp.float32) + ape.astype(jnp.float32), axis=2)  # [B, T/P, P, D]
    # As transformers: the weights rounded to the keys' dtype, the products in it, summed and rounded once.
    products = weights.astype(keys.dtype) * grouped(keys)
    return products.astype(jnp.float32).sum(axis=2).astype(keys.dtype).astype(jnp.float32)


def chosen_pools(index: jax.Array, mask: jax.Array, count: int, pool: int,
                 tail: bool) -> tuple[jax.Array, jax.Array]:
    """From pools' index scores [B, S, T/P] (float32) and the mask [B, S, T] of the keys each query
    may see: (the mask narrowed to the positions of each query's ``count`` best pools among those it
    sees whole, and with ``tail`` the up to pool - 1 keys it sees past its last whole pool [B, S, T];
    those positions [B, S, count * pool (+ pool - 1)] int32: the pools best first, each ascending, then
    the tail ascending, -1 where a query has fewer)."""
    b, s, t = mask.shape
    n = index.shape[-1]
    seen = jnp.pad(mask, ((0, 0), (0, 0), (0, n * pool - t)))                           # [B, S, T/P * P]
    whole = seen.reshape(b, s, n, pool).all(-1)                                         # [B, S, T/P]
    _, pools = chosen_keys(index, whole, count)                                         # [B, S, count]
    ids = jnp.where(pools[..., None] >= 0, pools[..., None] * pool + jnp.arange(pool), -1).reshape(b, s, -1)
    if tail and pool > 1:
        after = jnp.max(jnp.where(whole, jnp.arange(1, n + 1), 0), axis=-1) * pool     # [B, S]: past the last one
        position = jnp.arange(t)
        past = mask & (position >= after[..., None])                                    # [B, S, T]
        first = jax.lax.top_k(jnp.where(past, -position, -t), min(pool - 1, t))[0]      # the earliest, negated
        tails = jnp.where(first > -t, -first, -1)
        ids = jnp.concatenate([ids, jnp.pad(tails, ((0, 0), (0, 0), (0, pool - 1 - tails.shape[-1])),
                                            constant_values=-1)], axis=-1)
    rows, queries = jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None]
    allowed = jnp.zeros((b, s, t), bool).at[rows, queries, ids].max(ids >= 0)          # (-1: no write)
    return mask & allowed, ids.astype(jnp.int32)


def index_scores(q: jax.Array, keys: jax.Array, weights: jax.Array) -> jax.Array:
    """sum_h weights_h relu(q_h . k): q [B, S, Hi, D], keys [B, T, D] (scaled), weights [B, S, Hi]
    -> [B, S, T] float32, in blocks of ``QUERY_BLOCK`` queries."""

    def scored(q_block, w_block):                                                        # [B, Q, Hi, D], [B, Q, Hi]
        per_head = jnp.einsum("bqhd,btd->bqht", q_block, keys, precision=jax.lax.Precision.HIGHEST)
        return jnp.einsum("bqh,bqht->bqt", w_block, jax.nn.relu(per_head), precision=jax.lax.Precision.HIGHEST)

    return over_query_blocks(scored, q, weights, block=QUERY_BLOCK)
