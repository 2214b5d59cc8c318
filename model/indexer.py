"""DeepSeek sparse attention's lightning indexer (``model.config.Indexer``: DeepSeek-V3.2): which
earlier keys each query of a latent attention block attends to.

Per query, an index score for every earlier key, sum_h w_h relu(q_h . k / sqrt(D)), from index
queries of the normed low-rank query and one index key per position; the query keeps the
``topk`` keys of highest score (every earlier key while there are no more), and attention's mask
is narrowed to them. The scores are computed in float32, one block of queries at a time, so that
their [queries, index heads, keys] never exist for the whole sequence at once. A decoding cache
holds each position's index key.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import DecoderConfig
from model.layers import LayerNorm, accumulation, dense
from model.rope import apply_rope

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
    ``weights_proj``, as transformers names them)."""
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None

    @nn.compact
    def __call__(self, x, q_resid, cos, sin, mask, cached: Callable[[jax.Array], jax.Array] | None = None):
        """x [B, S, H]; ``q_resid`` [B, S, q_lora_rank] (the normed low-rank query); ``cos``, ``sin``
        [B, S, qk_rope_head_dim]; ``mask`` [B, S, T]; ``cached``: decoding, the index keys [B, S, 1, D]
        written into their cache -> the cache's [B, T, 1, D] (None: no cache). -> (the mask narrowed to
        each query's chosen keys [B, S, T], their positions [B, S, topk] int32, the keys scored)."""
        c, ix = self.config, self.config.mla.indexer
        b, s, _ = x.shape
        accumulate = accumulation(self.dtype, self.residual_dtype)
        rotated = c.mla.qk_rope_head_dim
        rotate = lambda y: jnp.concatenate([apply_rope(y[..., :rotated], cos, sin), y[..., rotated:]], axis=-1)
        q = dense(ix.num_heads * ix.head_dim, False, "wq_b", self.dtype, accumulate)(q_resid)
        q = rotate(q.reshape(b, s, ix.num_heads, ix.head_dim))                           # [B, S, Hi, D]
        k = LayerNorm(K_NORM_EPS, self.dtype, name="k_norm")(dense(ix.head_dim, False, "wk", self.dtype,
                                                                   accumulate)(x))
        k = rotate(k[:, :, None])                                                        # [B, S, 1, D]
        if cached is not None:
            k = cached(k)                                                                # [B, T, 1, D]
        weights = dense(ix.num_heads, False, "weights_proj", self.dtype, accumulate)(x)
        weights = weights.astype(jnp.float32) * ix.num_heads ** -0.5                     # [B, S, Hi]
        keys = k[:, :, 0].astype(jnp.float32) * ix.head_dim ** -0.5                      # [B, T, D]
        index = index_scores(q.astype(jnp.float32), keys, weights)                       # [B, S, T]
        allowed, ids = chosen_keys(index, mask, ix.topk)
        return allowed, ids, k


def index_scores(q: jax.Array, keys: jax.Array, weights: jax.Array) -> jax.Array:
    """sum_h weights_h relu(q_h . k): q [B, S, Hi, D], keys [B, T, D] (scaled), weights [B, S, Hi]
    -> [B, S, T] float32, in blocks of ``QUERY_BLOCK`` queries (the last zero-padded, then cut)."""
    b, s = q.shape[:2]

    def scored(args):
        q_block, w_block = args                                                          # [B, Q, Hi, D], [B, Q, Hi]
        per_head = jnp.einsum("bqhd,btd->bqht", q_block, keys, precision=jax.lax.Precision.HIGHEST)
        return jnp.einsum("bqh,bqht->bqt", w_block, jax.nn.relu(per_head), precision=jax.lax.Precision.HIGHEST)

    if s <= QUERY_BLOCK:
        return scored((q, weights))
    n = -(-s // QUERY_BLOCK)
    pad = lambda y: jnp.pad(y, ((0, 0), (0, n * QUERY_BLOCK - s)) + ((0, 0),) * (y.ndim - 2))
    blocks = lambda y: jnp.moveaxis(pad(y).reshape(b, n, QUERY_BLOCK, *y.shape[2:]), 1, 0)  # [n, B, Q, ...]
    out = jax.lax.map(scored, (blocks(q), blocks(weights)))                                 # [n, B, Q, T]
    return jnp.moveaxis(out, 0, 1).reshape(b, n * QUERY_BLOCK, -1)[:, :s]
