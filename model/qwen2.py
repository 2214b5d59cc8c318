"""The Qwen2 decoder in Flax linen, returning the residual stream after chosen blocks.

Axis names in shape comments:
    B batch, S query positions, T key positions (T = S without a cache), H hidden_size,
    N attention heads, K key/value heads, G = N // K query heads per kv head, D head_dim,
    F intermediate_size, V vocab_size, L decoder blocks computed.

Parameter names follow Hugging Face's (``layers_3/self_attn/q_proj/kernel`` for
``model.layers.3.self_attn.q_proj.weight``, transposed), so loading is a rename.
Attention takes an explicit boolean mask ``[B, S, T]``: a key that is masked (padding, or in the
future) never influences a query. Without a cache, attention is causal: the mask must allow no
future key, and the masked upper triangle is skipped (``causal_attention``). Softmax and
normalisation statistics are computed in float32, as Hugging Face does.

Numerics: ``dtype`` is the compute dtype (weights and matmul operands). ``residual_dtype`` is the
residual stream's: by default (None) the compute dtype, every sum rounded to it as Hugging Face's
bfloat16 forward does. float32 with bfloat16 compute keeps the stream in float32 (the embedding
output, every residual add, the norms, the block outputs) while matmul operands stay bfloat16 and
accumulate in float32 (``preferred_element_type``): the sum of a sublayer's output and the
residual is never rounded, and the error grows far less with depth. A float32 compute dtype gives
the same graph either way.

Interventions (``model.interventions``) enter as arrays, per block: which heads, sublayers or
blocks to keep, and what replaces the others (zero or a mean), so that one compiled forward
serves every intervention of a grid. Without them the graph is the plain model's. Each block
also ``sow``s its heads' outputs, sublayer outputs and contribution into the ``stats``
collection, which only a caller that asks for it (the mean pass) receives.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from model.config import ATTENTION_KINDS, Qwen2Config

KVCache = tuple[jax.Array, jax.Array]  # keys, values: [B, T, K, D] each
MASKED = -1e30  # finite, so a fully masked row (a padding row) gives no NaN


def precision_for(dtype) -> jax.lax.Precision:
    """float32 asks for full-precision matmuls (TPUs default to bfloat16 passes otherwise)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def accumulation(dtype, residual_dtype) -> Any:
    """The dtype matmuls of ``dtype`` operands return: None (their own dtype: the plain graph)
    unless the residual stream is wider, then the residual dtype."""
    if residual_dtype is None or jnp.dtype(residual_dtype) == jnp.dtype(dtype):
        return None
    return jnp.dtype(residual_dtype)


def dense(features: int, use_bias: bool, name: str, dtype, accumulate=None) -> nn.Dense:
    """A linear layer of ``dtype`` weights and operands; ``accumulate``: the dtype it accumulates
    in and returns (a bias is then added in it too), None for ``dtype``."""
    dot = None if accumulate is None else functools.partial(jax.lax.dot_general,
                                                             preferred_element_type=accumulate)
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name,
                    precision=precision_for(dtype), dot_general=dot)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Rotary tables for ``positions`` [B, S] -> cos, sin [B, S, D] in float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # [B, S, D]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x`` [B, S, heads, D] by the tables [B, S, D] (Hugging Face's rotate_half form)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def masked_softmax(scores: jax.Array, mask: jax.Array, dtype) -> jax.Array:
    """Softmax over the last axis in float32 where ``mask`` [B, S, T] allows, cast to ``dtype``.

    scores: [B, K, G, S, T], already divided by sqrt(D)."""
    scores = jnp.where(mask[:, None, None, :, :], scores.astype(jnp.float32), MASKED)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                    precision: jax.lax.Precision, accumulate=None, scaled: bool = False) -> jax.Array:
    """Attention over every key at once: q [B, S, K, G, D], k, v [B, T, K, D], mask [B, S, T]
    -> [B, S, K, G, D]. Materialises all [B, K, G, S, T] scores; used with a cache, where S or T
    is small. ``accumulate``: the dtype the matmuls accumulate in (None: q's); ``scaled``: q comes
    divided by sqrt(D) already."""
    q = q if scaled else q / math.sqrt(q.shape[-1])  # a Python scale keeps q's dtype
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, precision=precision,
                        preferred_element_type=accumulate)  # [B, K, G, S, T]
    probs = masked_softmax(scores, mask, q.dtype)
    return jnp.einsum("bkgst,btkd->bskgd", probs, v, precision=precision, preferred_element_type=accumulate)


ATTENTION_BLOCK = 128  # queries and keys per tile: a tile's [K, G*128, 128] scores fit in L2


def row_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                         precision: jax.lax.Precision, accumulate=None, scaled: bool = False) -> jax.Array:
    """Causal self-attention of one sequence in tiles (flash-style online softmax):
    q [S, K, G, D], k, v [S, K, D], mask [S, S] (which must allow no future key) -> [S, K, G, D].

    Each block of queries walks the key blocks up to its own (the upper triangle is never
    computed) and up to the last key the mask allows (none of the padding past the sequence),
    keeping a running max and sum in float32 so the scores never exist whole. ``accumulate``: the
    dtype the matmuls accumulate in (None: q's); ``scaled``: q comes divided by sqrt(D) already.
    """
    s, kv_heads, groups, d = q.shape
    block = min(s, ATTENTION_BLOCK)
    padded = -(-s // block) * block  # tiles are whole: pad, mask the extra keys, drop the queries
    q = jnp.pad(q if scaled else q / math.sqrt(d), ((0, padded - s), (0, 0), (0, 0), (0, 0)))
    q = q.transpose(1, 2, 0, 3)  # [K, G, S', D]
    k, v = (jnp.pad(x, ((0, padded - s), (0, 0), (0, 0))).transpose(1, 0, 2)
            for x in (k, v))  # [K, S', D]
    mask = jnp.pad(mask, ((0, padded - s), (0, padded - s)))  # [S', S']
    # Key blocks holding any key some query may attend to (at least one, so no sum is zero).
    last_key = jnp.max(jnp.where(mask.any(axis=0), jnp.arange(padded) + 1, 0))
    key_blocks = jnp.maximum(1, -(-last_key // block))

    def query_block(i):
        q_block = jax.lax.dynamic_slice_in_dim(q, i * block, block, axis=2)
        q_block = q_block.reshape(kv_heads, groups * block, d)  # [K, G*bq, D]

        def add_key_block(j, state):
            running_max, running_sum, acc = state  # [K, G, bq], [K, G, bq], [K, G, bq, D]
            k_block = jax.lax.dynamic_slice_in_dim(k, j * block, block, axis=1)  # [K, bk, D]
            v_block = jax.lax.dynamic_slice_in_dim(v, j * block, block, axis=1)
            allowed = jax.lax.dynamic_slice(mask, (i * block, j * block), (block, block))
            scores = jnp.einsum("kmd,ktd->kmt", q_block, k_block, precision=precision,
                                preferred_element_type=accumulate)
            scores = scores.reshape(kv_heads, groups, block, block).astype(jnp.float32)
            scores = jnp.where(allowed[None, None], scores, MASKED)  # [K, G, bq, bk]
            new_max = jnp.maximum(running_max, scores.max(axis=-1))
            probs = jnp.exp(scores - new_max[..., None])
            rescale = jnp.exp(running_max - new_max)
            values = jnp.einsum("kmt,ktd->kmd", probs.reshape(kv_heads, groups * block, block)
                                .astype(v.dtype), v_block, precision=precision,
                                preferred_element_type=accumulate)  # [K, G*bq, D]
            acc = acc * rescale[..., None] + values.reshape(acc.shape).astype(jnp.float32)
            return new_max, running_sum * rescale + probs.sum(axis=-1), acc

        # Built from q_block so that, under shard_map, the loop state varies over the same axes.
        acc = jnp.zeros_like(q_block, jnp.float32).reshape(kv_heads, groups, block, d)
        state = (acc[..., 0] + MASKED, acc[..., 0], acc)
        _, total, acc = jax.lax.fori_loop(0, jnp.minimum(i + 1, key_blocks), add_key_block, state)
        return (acc / total[..., None]).astype(q.dtype)  # [K, G, bq, D]

    out = jax.lax.map(query_block, jnp.arange(padded // block))  # [S'/bq, K, G, bq, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(padded, kv_heads, groups, d)[:s]


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     precision: jax.lax.Precision, mesh: Mesh | None = None, accumulate=None,
                     scaled: bool = False) -> jax.Array:
    """Causal self-attention: q [B, S, K, G, D], k, v [B, S, K, D], mask [B, S, S] (which must
    allow no future key) -> [B, S, K, G, D].

    Sequences are taken one tile at a time (``row_causal_attention``) so that scores stay in
    cache through the softmax's passes. Materialised whole ([B, K, G, S, S], ~1 GB per layer at
    B = 4, S = 2048) they went to memory on every pass, and attention took 3/4 of a layer's time
    on CPU. The loops are compiled once per layer, not unrolled per tile.
    Over a ``mesh`` this runs per device (``shard_map``) on the rows and kv heads it holds, so
    the loop never crosses a sharded axis.
    """
    def local(q, k, v, mask):
        return jax.lax.map(lambda row: row_causal_attention(*row, precision, accumulate, scaled), (q, k, v, mask))

    if mesh is None:
        return local(q, k, v, mask)
    heads = "model" if q.shape[2] % mesh.shape["model"] == 0 else None
    q_spec, kv_spec = P("data", None, heads, None, None), P("data", None, heads, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P("data")),
                         out_specs=q_spec)(q, k, v, mask)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                    precision: jax.lax.Precision, scaled: bool = False) -> jax.Array:
    """Causal self-attention through ``jax.nn.dot_product_attention`` (a fused kernel where the
    backend has one: cuDNN on GPU; XLA's fusion elsewhere): q [B, S, K, G, D], k, v [B, S, K, D],
    mask [B, S, S] (causal, padding keys masked) -> [B, S, K, G, D].

    The kernel takes the causal structure and each row's length instead of a mask, so it can skip
    masked tiles; the length is read off the mask (the keys some query may attend to). A padding
    row (length 0) gets length 1: its outputs are discarded, and no row is fully masked.
    ``scaled``: q comes divided by sqrt(D) already.
    """
    b, s, kv_heads, groups, d = q.shape
    lengths = jnp.maximum(mask.any(axis=1).sum(axis=-1), 1).astype(jnp.int32)  # [B]
    with jax.default_matmul_precision("highest" if precision == jax.lax.Precision.HIGHEST else None):
        out = jax.nn.dot_product_attention(q.reshape(b, s, kv_heads * groups, d), k, v, is_causal=True,
                                           key_value_seq_lengths=lengths,
                                           scale=1.0 if scaled else None)  # [B, S, N, D]
    return out.reshape(b, s, kv_heads, groups, d)


def attention_for(mesh: Mesh | None, choice: str = "auto") -> str:
    """``auto``: the per-tile loop on CPU (``causal_attention``), the fused kernel on TPU and GPU."""
    if choice not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {choice!r} (choose from {', '.join(ATTENTION_KINDS)})")
    if choice != "auto":
        return choice
    cpu = mesh is None or mesh.devices.flat[0].platform == "cpu"
    return "tiled" if cpu else "fused"


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None  # wider than dtype: the weight applies in float32, one rounding

    @nn.compact
    def __call__(self, x: jax.Array, ablation: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """x: [..., H] -> [..., H] in ``dtype`` (a matmul operand). ``ablation`` (keep, fill),
        scalars: unless kept, the weights become ones, or with ``fill`` their mean."""
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        wide = accumulation(self.dtype, self.residual_dtype) is not None
        if wide:
            weight = weight.astype(jnp.float32)
        if ablation is not None:
            keep, fill = ablation
            weight = jnp.where(keep, weight, jnp.where(fill, jnp.mean(weight), jnp.ones_like(weight)))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if wide:
            return (weight * normed).astype(self.dtype)
        # Hugging Face's order: the normalised values rounded to dtype, then scaled in it.
        return weight * normed.astype(self.dtype)


class Attention(nn.Module):
    config: Qwen2Config
    dtype: jnp.dtype = jnp.float32
    mesh: Mesh | None = None  # where the batch lives; causal attention then runs per device
    attention: str = "tiled"  # without a cache: tiled (causal_attention) | fused (fused_attention)
    residual_dtype: Any = None  # wider than dtype: matmuls accumulate in it, o_proj returns it

    @nn.compact
    def __call__(self, x, cos, sin, mask, cache: KVCache | None = None, cache_index=None, heads=None):
        """x: [B, S, H] in ``dtype``. ``heads`` (keep [N] bool, fill [N] bool, mean [N, D]): a head
        not kept has its output (its slice of the o_proj input) replaced by zero, or with
        ``fill`` by its mean."""
        c = self.config
        b, s, _ = x.shape
        accumulate = accumulation(self.dtype, self.residual_dtype)
        project = lambda n, bias, name: dense(n, bias, name, self.dtype, accumulate)  # noqa: E731
        q = project(c.num_attention_heads * c.head_dim, True, "q_proj")(x).reshape(
            b, s, c.num_attention_heads, c.head_dim)  # [B, S, N, D]
        k = project(c.num_key_value_heads * c.head_dim, True, "k_proj")(x).reshape(
            b, s, c.num_key_value_heads, c.head_dim)  # [B, S, K, D]
        v = project(c.num_key_value_heads * c.head_dim, True, "v_proj")(x).reshape(
            b, s, c.num_key_value_heads, c.head_dim)  # [B, S, K, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scaled = accumulate is not None
        if scaled:  # rotated and scaled in float32, rounded once to matmul operands
            q = q / math.sqrt(c.head_dim)
            q, k, v = q.astype(self.dtype), k.astype(self.dtype), v.astype(self.dtype)
        if cache is not None:  # write this step's keys/values, attend over the whole cache
            k = jax.lax.dynamic_update_slice(cache[0], k, (0, cache_index, 0, 0))  # [B, T, K, D]
            v = jax.lax.dynamic_update_slice(cache[1], v, (0, cache_index, 0, 0))
        q = q.reshape(b, s, c.num_key_value_heads, c.kv_groups, c.head_dim)  # [B, S, K, G, D]
        if cache is None and self.attention == "fused":
            out = fused_attention(q, k, v, mask, precision_for(self.dtype), scaled)
        elif cache is None:
            out = causal_attention(q, k, v, mask, precision_for(self.dtype), self.mesh, accumulate, scaled)
        else:
            out = dense_attention(q, k, v, mask, precision_for(self.dtype), accumulate, scaled)  # [B, S, K, G, D]
        out = out.reshape(b, s, c.num_attention_heads, c.head_dim).astype(self.dtype)  # [B, S, N, D]
        self.sow("stats", "heads", out)
        if heads is not None:
            keep, fill, mean = heads
            replaced = jnp.where(fill[:, None], mean.astype(out.dtype), jnp.zeros_like(mean, out.dtype))
            out = jnp.where(keep[:, None], out, replaced)
        out = out.reshape(b, s, c.num_attention_heads * c.head_dim)  # [B, S, N*D]
        return project(c.hidden_size, False, "o_proj")(out), (k, v)


class MLP(nn.Module):
    config: Qwen2Config
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None  # wider than dtype: matmuls accumulate in it, the gating is in it

    @nn.compact
    def __call__(self, x):  # [B, S, H] in dtype
        accumulate = accumulation(self.dtype, self.residual_dtype)
        project = lambda n, name: dense(n, False, name, self.dtype, accumulate)  # noqa: E731
        f = self.config.intermediate_size
        hidden = nn.silu(project(f, "gate_proj")(x)) * project(f, "up_proj")(x)  # [B, S, F]
        return project(self.config.hidden_size, "down_proj")(hidden.astype(self.dtype))


CHUNK_TOKENS = 512  # per device; a chunk's [tokens, F] intermediates then stay in cache


def chunk_tokens_for(mesh: Mesh) -> int | None:
    """Per-token chunking for CPU meshes only: TPU and GPU matmul units want the largest operands,
    and each loop step costs them more than it saves."""
    return CHUNK_TOKENS if mesh.devices.flat[0].platform == "cpu" else None


def token_chunks(seq_len: int, rows: int, target: int = CHUNK_TOKENS) -> int:
    """How many chunks of whole positions to cut [rows, seq_len] tokens into: the fewest that
    divide ``seq_len`` with at most ``target`` tokens each; 1 (no chunking) when it is small
    already, or when such chunks would hold under target/4 tokens (a prime length, say)."""
    n = max(1, -(-seq_len * rows // target))
    while seq_len % n:
        n += 1
    return n if seq_len // n * rows * 4 >= target else 1


def map_over_token_chunks(module: nn.Module, x: jax.Array, mesh: Mesh | None,
                          chunk_tokens: int | None) -> jax.Array:
    """``module(x)`` for a per-token module, computed in chunks of positions one after the other.

    On CPU the MLP of 8192 tokens at once reaches ~70% of a plain matmul's FLOP rate, because its
    [B*S, F] intermediates (160 MB each) go to memory; in chunks of ~512 tokens it reaches ~93%.
    The loop runs over positions, never over the (possibly sharded) batch axis. ``chunk_tokens``
    None: one piece.  x: [B, S, H] -> [B, S, H].
    """
    b, s, h = x.shape
    if chunk_tokens is None:
        return module(x)
    n = token_chunks(s, b // (mesh.shape["data"] if mesh is not None else 1), chunk_tokens)
    if n == 1:
        return module(x)
    chunks = x.reshape(b, n, s // n, h).transpose(1, 0, 2, 3)  # [n, B, S/n, H]
    step = nn.scan(lambda mdl, carry, chunk: (carry, mdl(chunk)), variable_broadcast="params",
                   split_rngs={"params": False})
    _, out = step(module, None, chunks)  # [n, B, S/n, H]
    return out.transpose(1, 0, 2, 3).reshape(b, s, h)


def _replaced(out: jax.Array, ablation: dict, kind: str) -> jax.Array:
    """A sublayer's output [B, S, H], unless ablated: then zero, or with fill its mean [H]."""
    if not ablation:
        return out
    fill = jnp.where(ablation[f"{kind}_fill"], ablation[f"{kind}_mean"].astype(out.dtype), 0)  # [H]
    return jnp.where(ablation[f"{kind}_keep"], out, jnp.broadcast_to(fill, out.shape))


class DecoderLayer(nn.Module):
    config: Qwen2Config
    dtype: jnp.dtype = jnp.float32
    mesh: Mesh | None = None
    chunk_tokens: int | None = None
    attention: str = "tiled"
    residual_dtype: Any = None  # the dtype of x and of the sums (None: dtype)

    @nn.compact
    def __call__(self, x, cos, sin, mask, cache: KVCache | None = None, cache_index=None, ablation=None):
        """``ablation``: this block's slice of ``model.interventions.ablation_arrays`` (None: none)."""
        eps = self.config.rms_norm_eps
        a = ablation or {}
        norm = (a["norm_keep"], a["norm_fill"]) if ablation is not None else None
        heads = (a["head_keep"], a["head_fill"], a["head_mean"]) if ablation is not None else None
        block_in = x
        wide = self.residual_dtype
        attn_out, new_cache = Attention(self.config, self.dtype, self.mesh, self.attention, wide, name="self_attn")(
            RMSNorm(eps, self.dtype, wide, name="input_layernorm")(x, norm), cos, sin, mask, cache, cache_index,
            heads)
        attn_out = _replaced(attn_out, a, "attn")
        self.sow("stats", "attn_output", attn_out)
        x = x + attn_out
        mlp = MLP(self.config, self.dtype, wide, name="mlp")
        mlp_out = map_over_token_chunks(
            mlp, RMSNorm(eps, self.dtype, wide, name="post_attention_layernorm")(x, norm), self.mesh,
            self.chunk_tokens)
        mlp_out = _replaced(mlp_out, a, "mlp")
        self.sow("stats", "mlp_output", mlp_out)
        x = x + mlp_out
        self.sow("stats", "contribution", x - block_in)
        if ablation is not None:  # a skipped block passes its input on, plus its mean contribution
            x = jnp.where(a["block_keep"], x, block_in + jnp.where(a["block_fill"], a["block_mean"].astype(x.dtype),
                                                                   jnp.zeros_like(x)))
        return x, new_cache


class Qwen2(nn.Module):
    """Embedding + decoder blocks (+ final norm and LM head, used by ``logits`` only)."""
    config: Qwen2Config
    dtype: jnp.dtype = jnp.float32
    mesh: Mesh | None = None  # the mesh the batch is sharded over, if any (see causal_attention)
    chunk_tokens: int | None = None  # MLP tokens per device at a time (map_over_token_chunks)
    attention: str = "tiled"         # tiled | fused: see attention_for
    residual_dtype: Any = None       # the residual stream's (None: dtype); see the module docstring

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype,
                                     param_dtype=self.dtype)
        self.layers = [DecoderLayer(c, self.dtype, self.mesh, self.chunk_tokens, self.attention,
                                    self.residual_dtype, name=f"layers_{i}")
                       for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype, self.residual_dtype)
        if not c.tie_word_embeddings:
            self.lm_head = dense(c.vocab_size, False, "lm_head", self.dtype,
                                 accumulation(self.dtype, self.residual_dtype))

    def __call__(self, input_ids, positions, mask, num_layers: int,
                 caches: Sequence[KVCache] | None = None, cache_index=None, ablation=None):
        """Runs blocks ``0..num_layers-1`` only.

        input_ids, positions: [B, S]; mask: [B, S, T] (True = may attend; without caches it must
        be causal, e.g. ``causal_mask``); ``ablation``: ``model.interventions.ablation_arrays``
        (each array's first axis the block), or None.
        Returns (outputs of each block computed: list of [B, S, H] in the residual dtype, new caches).
        """
        x = self.embed_tokens(input_ids)  # [B, S, H]
        if self.residual_dtype is not None:
            x = x.astype(self.residual_dtype)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        outputs, new_caches = [], []
        for i in range(num_layers):
            block = None if ablation is None else {name: array[i] for name, array in ablation.items()}
            x, cache = self.layers[i](x, cos, sin, mask, None if caches is None else caches[i],
                                      cache_index, block)
            outputs.append(x)
            new_caches.append(cache)
        return outputs, new_caches

    def logits(self, x):
        """Next-token logits [..., V] from the last block's output [..., H]."""
        return self.unembed(self.norm(x))

    def final_norm(self, x):
        """The last block's output [..., H] through the final norm."""
        return self.norm(x)

    def unembed(self, h):
        """Logits [..., V] of a final-normed hidden state [..., H] (linear in it: no bias)."""
        accumulate = accumulation(self.dtype, self.residual_dtype)
        if self.config.tie_word_embeddings and accumulate is not None:
            return jnp.einsum("...h,vh->...v", h.astype(self.dtype), self.embed_tokens.embedding,
                              precision=precision_for(self.dtype), preferred_element_type=accumulate)
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(h)
        return self.lm_head(h)


def causal_mask(lengths: jax.Array, seq_len: int) -> jax.Array:
    """[B, S, S]: query q may attend key t iff t <= q and t is a real (non-padding) token."""
    pos = jnp.arange(seq_len)
    causal = pos[None, :] <= pos[:, None]  # [S, T]
    valid = pos[None, :] < lengths[:, None]  # [B, T]
    return causal[None, :, :] & valid[:, None, :]
