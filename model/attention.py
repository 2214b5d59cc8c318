"""Causal attention kernels: one-shot (with a KV cache), tiled (flash-style, the CPU's choice),
fused (``jax.nn.dot_product_attention``: XLA's fusion, TPU's choice) and cudnn (the same call with
cuDNN's flash attention, the GPU's choice), each with an optional sliding window (soft-capping
and attention sinks: the one-shot and tiled kernels only), and the masks they take.

Axis names: B batch, S query positions, T key positions, K key/value heads, G query heads per
kv head, D head_dim. Every kernel takes q [B, S, K, G, D] and k, v [B, T, K, D] (the one-shot and
tiled kernels also values of another head size, a latent attention's: [B, T, K, Dv]).

A kernel's ``divisor`` is what q . k is divided by (sqrt(head_dim), or Gemma's
sqrt(query_pre_attn_scalar)); None when q comes scaled already. ``softcap`` c turns a score s
into tanh(s / c) * c before the mask, in float32. ``window`` w lets query q see keys q - w + 1 to
q only (a sliding layer); a ``Chunked`` one the earlier keys of q's own chunk only (Llama 4's
chunked layers: the fused kernels attend within each chunk as a sequence of its own); None: every
earlier key. Softmax statistics are float32 everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from common.cli import UserError
from model.config import ATTENTION_KINDS, Chunked, DecoderConfig

Window = int | Chunked | None  # a layer's locality (model.config.DecoderConfig.window)

MASKED = -1e30  # finite, so a fully masked row (a padding row) gives no NaN
ATTENTION_BLOCK = 128  # queries and keys per tile: a tile's [K, G*128, 128] scores fit in L2


def causal_mask(lengths: jax.Array, seq_len: int) -> jax.Array:
    """[B, S, S]: query q may attend key t iff t <= q and t is a real (non-padding) token."""
    pos = jnp.arange(seq_len)
    causal = pos[None, :] <= pos[:, None]  # [S, T]
    valid = pos[None, :] < lengths[:, None]  # [B, T]
    return causal[None, :, :] & valid[:, None, :]


def visible(query_pos: jax.Array, key_pos: jax.Array, window: Window) -> jax.Array | bool:
    """Whether a query at ``query_pos`` may see a key at ``key_pos`` (broadcast), causality and
    padding aside: within its sliding ``window``, in its chunk, or (None) always."""
    if window is None:
        return True
    if isinstance(window, Chunked):
        return query_pos // window.size == key_pos // window.size
    return query_pos - key_pos < window


def first_visible(query_pos, window: Window):
    """The first key position a query at ``query_pos`` may see."""
    if window is None:
        return 0
    if isinstance(window, Chunked):
        return query_pos // window.size * window.size
    return jnp.maximum(0, query_pos - window + 1)


def windowed(mask: jax.Array, positions: jax.Array, window: Window) -> jax.Array:
    """``mask`` [B, S, T] (keys at cache slots 0..T-1, slot = position) narrowed to the keys
    each query at ``positions`` [B, S] may see (``visible``)."""
    if window is None:
        return mask
    return mask & visible(positions[:, :, None], jnp.arange(mask.shape[-1])[None, None, :], window)  # [B, S, T]


def soft_capped(scores: jax.Array, softcap: float | None) -> jax.Array:
    """Float32 ``scores`` as tanh(scores / c) * c (Gemma 2), or unchanged."""
    return scores if softcap is None else jnp.tanh(scores / softcap) * softcap


def masked_softmax(scores: jax.Array, mask: jax.Array, dtype, softcap: float | None = None,
                   sinks: jax.Array | None = None) -> jax.Array:
    """Softmax over the last axis in float32 where ``mask`` [B, S, T] allows, cast to ``dtype``;
    ``sinks`` [K, G]: each head's logit joins every query's softmax, and its share is dropped.

    scores: [B, K, G, S, T], already scaled."""
    scores = soft_capped(scores.astype(jnp.float32), softcap)
    scores = jnp.where(mask[:, None, None, :, :], scores, MASKED)
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1).astype(dtype)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None, None], scores.shape[:-1] + (1,))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(dtype)


def score_rows(q: jax.Array, k: jax.Array, mask: jax.Array, positions: jax.Array, window: Window,
               divisor: float, softcap: float | None = None, sinks: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """Attention's scores and probabilities as per-query rows, for the sites that store them
    (``attn.hook_attn_scores``, ``attn.hook_pattern``): q [B, S, N, D] rotated and not yet scaled,
    k [B, T, K, D], mask [B, S, T] (its window applied here) -> ([B, S, N*T], [B, S, N*T]) in
    float32, head-major. Scores are scaled, soft-capped and -inf where masked; the probabilities are
    their softmax, with each head's sink logit (``sinks`` [K, G]) joined and its share dropped."""
    b, s, n, d = q.shape
    kv_heads = k.shape[2]
    grouped = q.astype(jnp.float32).reshape(b, s, kv_heads, n // kv_heads, d) / divisor  # [B, S, K, G, D]
    scores = jnp.einsum("bskgd,btkd->bskgt", grouped, k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)  # [B, S, K, G, T]
    scores = soft_capped(scores, softcap)
    allowed = windowed(mask, positions, window)  # [B, S, T]
    probs = masked_softmax(scores.transpose(0, 2, 3, 1, 4), allowed, jnp.float32, sinks=sinks)  # [B, K, G, S, T]
    flat = lambda y: y.reshape(b, s, -1)  # [B, S, N*T]: query head n = kv head * G + its group
    return (flat(jnp.where(allowed[:, :, None, None, :], scores, -jnp.inf)),
            flat(probs.transpose(0, 3, 1, 2, 4)))


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                    precision: jax.lax.Precision, accumulate=None, divisor: float | None = None,
                    softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Attention over every key at once: mask [B, S, T] (its window applied, see ``windowed``)
    -> [B, S, K, G, D]. Materialises all [B, K, G, S, T] scores; used with a cache, where S or T
    is small. ``accumulate``: the dtype the matmuls accumulate in (None: q's); ``sinks``: see
    ``masked_softmax``."""
    q = q if divisor is None else q / divisor  # a Python scale keeps q's dtype
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, precision=precision,
                        preferred_element_type=accumulate)  # [B, K, G, S, T]
    probs = masked_softmax(scores, mask, q.dtype, softcap, sinks)
    return jnp.einsum("bkgst,btke->bskge", probs, v, precision=precision, preferred_element_type=accumulate)


def row_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                         precision: jax.lax.Precision, accumulate=None, divisor: float | None = None,
                         softcap: float | None = None, window: Window = None,
                         sinks: jax.Array | None = None) -> jax.Array:
    """Causal self-attention of one sequence in tiles (flash-style online softmax):
    q [S, K, G, D], k, v [S, K, D], mask [S, S] (which must allow no future key) -> [S, K, G, D].

    Each block of queries walks the key blocks from the first its window reaches (0 without a
    window) up to its own (the upper triangle is never computed) and up to the last key the mask
    allows (none of the padding past the sequence), keeping a running max and sum in float32 so
    the scores never exist whole. A window therefore cuts the cost to about window / S of the
    full triangle. ``accumulate``: the dtype the matmuls accumulate in (None: q's). ``sinks``
    [K, G]: each head's logit joins the softmax's sum after the last key block (gpt-oss).
    """
    s, kv_heads, groups, d = q.shape
    dv = v.shape[-1]  # the values' head size (a latent attention's differs from q's and k's)
    block = min(s, ATTENTION_BLOCK)
    padded = -(-s // block) * block  # tiles are whole: pad, mask the extra keys, drop the queries
    q = jnp.pad(q if divisor is None else q / divisor, ((0, padded - s), (0, 0), (0, 0), (0, 0)))
    q = q.transpose(1, 2, 0, 3)  # [K, G, S', D]
    k, v = (jnp.pad(x, ((0, padded - s), (0, 0), (0, 0))).transpose(1, 0, 2)
            for x in (k, v))  # [K, S', D]
    mask = jnp.pad(mask, ((0, padded - s), (0, padded - s)))  # [S', S']
    # Key blocks holding any key some query may attend to (at least one: every query block visits
    # one, so no sum is zero, not even a padding row's past the window).
    last_key = jnp.max(jnp.where(mask.any(axis=0), jnp.arange(padded) + 1, 0))
    key_blocks = jnp.maximum(1, -(-last_key // block))

    def query_block(i):
        q_block = jax.lax.dynamic_slice_in_dim(q, i * block, block, axis=2)
        q_block = q_block.reshape(kv_heads, groups * block, d)  # [K, G*bq, D]

        def add_key_block(j, state):
            running_max, running_sum, acc = state  # [K, G, bq], [K, G, bq], [K, G, bq, D]
            k_block = jax.lax.dynamic_slice_in_dim(k, j * block, block, axis=1)  # [K, bk, D]
            v_block = jax.lax.dynamic_slice_in_dim(v, j * block, block, axis=1)
            allowed = jax.lax.dynamic_slice(mask, (i * block, j * block), (block, block))  # [bq, bk]
            if window is not None:
                query_pos = i * block + jnp.arange(block)[:, None]
                allowed = allowed & visible(query_pos, j * block + jnp.arange(block)[None, :], window)
            scores = jnp.einsum("kmd,ktd->kmt", q_block, k_block, precision=precision,
                                preferred_element_type=accumulate)
            scores = soft_capped(scores.reshape(kv_heads, groups, block, block).astype(jnp.float32), softcap)
            scores = jnp.where(allowed[None, None], scores, MASKED)  # [K, G, bq, bk]
            new_max = jnp.maximum(running_max, scores.max(axis=-1))
            probs = jnp.exp(scores - new_max[..., None])
            # A row with no allowed key yet (before its window starts) accumulates garbage at
            # MASKED; its first allowed key (its own, at the latest) rescales that by
            # exp(MASKED - score) = 0. A padding row keeps its garbage, finite, and is discarded.
            rescale = jnp.exp(running_max - new_max)
            values = jnp.einsum("kmt,ktd->kmd", probs.reshape(kv_heads, groups * block, block)
                                .astype(v.dtype), v_block, precision=precision,
                                preferred_element_type=accumulate)  # [K, G*bq, D]
            acc = acc * rescale[..., None] + values.reshape(acc.shape).astype(jnp.float32)
            return new_max, running_sum * rescale + probs.sum(axis=-1), acc

        # Built from q_block so that, under shard_map, the loop state varies over the same axes.
        acc = jnp.zeros_like(q_block[..., :1], jnp.float32).reshape(kv_heads, groups, block, 1)
        state = (acc[..., 0] + MASKED, acc[..., 0], acc + jnp.zeros((dv,), jnp.float32))
        last = jnp.minimum(i + 1, key_blocks)
        # The first key block the window reaches (a padding block past the real keys: the last).
        first = 0 if window is None else jnp.minimum(first_visible(i * block, window) // block, last - 1)
        running_max, total, acc = jax.lax.fori_loop(first, last, add_key_block, state)
        if sinks is not None:  # one more logit in the denominator, none in the values
            sink = sinks.astype(jnp.float32)[..., None]  # [K, G, 1]
            new_max = jnp.maximum(running_max, sink)
            rescale = jnp.exp(running_max - new_max)
            total, acc = total * rescale + jnp.exp(sink - new_max), acc * rescale[..., None]
        return (acc / total[..., None]).astype(q.dtype)  # [K, G, bq, D]

    out = jax.lax.map(query_block, jnp.arange(padded // block))  # [S'/bq, K, G, bq, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(padded, kv_heads, groups, dv)[:s]


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     precision: jax.lax.Precision, mesh: Mesh | None = None, accumulate=None,
                     divisor: float | None = None, softcap: float | None = None,
                     window: Window = None, sinks: jax.Array | None = None) -> jax.Array:
    """Causal self-attention: q [B, S, K, G, D], k, v [B, S, K, D], mask [B, S, S] (which must
    allow no future key) -> [B, S, K, G, D].

    Sequences are taken one tile at a time (``row_causal_attention``) so that scores stay in
    cache through the softmax's passes. Materialised whole ([B, K, G, S, S], ~1 GB per layer at
    B = 4, S = 2048) they went to memory on every pass, and attention took 3/4 of a layer's time
    on CPU. The loops are compiled once per layer, not unrolled per tile.
    Over a ``mesh`` this runs per device (``shard_map``) on the rows and kv heads it holds, so
    the loop never crosses a sharded axis (kv heads that the model axis does not divide, a
    single one say, are replicated).
    """
    def local(q, k, v, mask, *sink):
        return jax.lax.map(lambda row: row_causal_attention(*row, precision, accumulate, divisor, softcap, window,
                                                            *sink), (q, k, v, mask))

    extra = () if sinks is None else (sinks,)
    if mesh is None:
        return local(q, k, v, mask, *extra)
    heads = "model" if q.shape[2] % mesh.shape["model"] == 0 else None
    q_spec, kv_spec = P("data", None, heads, None, None), P("data", None, heads, None)
    sink_spec = () if sinks is None else (P(heads, None),)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P("data"), *sink_spec),
                         out_specs=q_spec)(q, k, v, mask, *extra)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                    precision: jax.lax.Precision, scale: float | None = None,
                    window: Window = None, implementation: str | None = None) -> jax.Array:
    """Causal self-attention through ``jax.nn.dot_product_attention``: mask [B, S, S] (causal,
    padding keys masked) -> [B, S, K, G, D]. ``implementation``: None for XLA's fusion (every
    backend), ``cudnn`` for cuDNN's flash attention (GPU, bfloat16 or float16 operands).

    The kernel takes the causal structure, each row's length and the window instead of a mask,
    so it can skip masked tiles; the length is read off the mask (the keys some query may attend
    to). A padding row (length 0) gets length 1. Padding queries see garbage or, past a window,
    no key at all: their outputs are discarded (``model.scoring`` excludes them with ``where``,
    so even a NaN from a kernel that returns one there never reaches a sum). ``scale``: what
    q . k is multiplied by (None: 1/sqrt(D)); it has no soft-capping.
    """
    if isinstance(window, Chunked):  # each chunk a causal sequence of its own
        return chunkwise(lambda *chunk: fused_attention(*chunk, precision, scale, None, implementation),
                         q, k, v, mask, window.size)
    b, s, kv_heads, groups, d = q.shape
    lengths = jnp.maximum(mask.any(axis=1).sum(axis=-1), 1).astype(jnp.int32)  # [B]
    with jax.default_matmul_precision("highest" if precision == jax.lax.Precision.HIGHEST else None):
        out = jax.nn.dot_product_attention(q.reshape(b, s, kv_heads * groups, d), k, v, is_causal=True,
                                           key_value_seq_lengths=lengths, scale=scale,
                                           local_window_size=None if window is None else (window - 1, 0),
                                           implementation=implementation)
    return out.reshape(b, s, kv_heads, groups, d)  # [B, S, N, D] -> [B, S, K, G, D]


def chunkwise(attend, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, size: int) -> jax.Array:
    """Chunked causal attention as ``attend`` (a causal kernel: q [B', C, K, G, D], k, v [B', C, K, D],
    mask [B', C, C]): the whole chunks of ``size`` positions each a batch row of its own (each with
    its diagonal block of ``mask`` [B, S, S]), the partial last chunk a call of its own; nothing is
    padded, so a sequence shorter than a chunk is plain causal attention -> [B, S, K, G, D]."""
    b, s = q.shape[:2]
    n = s // size
    whole = n * size
    parts = []
    if n:
        fold = lambda x: x[:, :whole].reshape(b * n, size, *x.shape[2:])  # [B * n, C, ...]: row-major, a batch shard
        blocks = jnp.diagonal(mask[:, :whole, :whole].reshape(b, n, size, n, size), axis1=1, axis2=3)
        blocks = jnp.moveaxis(blocks, -1, 1).reshape(b * n, size, size)  # chunk i's queries x its keys
        out = attend(fold(q), fold(k), fold(v), blocks)  # [B * n, C, K, G, D]
        parts.append(out.reshape(b, whole, *out.shape[2:]))
    if whole < s:  # the last, partial chunk
        parts.append(attend(q[:, whole:], k[:, whole:], v[:, whole:], mask[:, whole:, whole:]))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


# cuDNN's flash attention: the operand dtypes it takes, and its largest head size, a multiple of 8:
# 256 from Hopper (compute capability 9.0) on, 128 before (jax._src.cudnn.fused_attention_stablehlo).
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM, CUDNN_MAX_HEAD_DIM_BEFORE_HOPPER = 256, 128


def cudnn_max_head_dim(mesh: Mesh | None) -> int:
    """The largest head size cuDNN's flash attention takes on ``mesh``'s GPUs (unknown: Hopper's)."""
    capability = getattr(mesh.devices.flat[0], "compute_capability", None) if mesh is not None else None
    try:
        older = capability is not None and float(capability) < 9.0
    except (TypeError, ValueError):
        older = False
    return CUDNN_MAX_HEAD_DIM_BEFORE_HOPPER if older else CUDNN_MAX_HEAD_DIM


def cudnn_problem(platform: str | None, config: DecoderConfig | None, dtype,
                  max_head_dim: int = CUDNN_MAX_HEAD_DIM) -> str | None:
    """Why cuDNN's flash attention cannot run this model here (None: it can). ``platform``: the
    mesh's (None: not known yet, not checked); ``dtype``: the compute dtype (None: not checked);
    ``max_head_dim``: the GPUs' (``cudnn_max_head_dim``)."""
    if platform is not None and platform != "gpu":
        return f"cuDNN's flash attention runs on GPUs only, and this backend is {platform}"
    if dtype is not None and jnp.dtype(dtype).name not in CUDNN_DTYPES:
        return (f"cuDNN's flash attention takes bfloat16 or float16 operands, and the compute dtype is "
                f"{jnp.dtype(dtype).name}")
    if config is not None and config.attn_logit_softcap is not None:
        return (f"cuDNN's flash attention has no attention-logit soft-capping, which {config.model_type} needs "
                f"(attn_logit_softcapping {config.attn_logit_softcap})")
    if config is not None and config.attention_sinks:
        return f"cuDNN's flash attention has no attention sinks, which {config.model_type} has"
    # Every block's head size (Gemma 4's full-attention blocks have their own).
    sizes = sorted({config.layer_config(i).attention_head_dim for i in config.attention_layers}) if config else []
    bad = [d for d in sizes if d % 8 or d > max_head_dim]
    if bad:
        return (f"cuDNN's flash attention takes head sizes that are multiples of 8 up to {max_head_dim} on these "
                f"GPUs, and {config.model_type}'s {'are' if len(sizes) > 1 else 'is'} "
                f"{' and '.join(map(str, sizes))}")
    return None


def attention_for(mesh: Mesh | None, choice: str = "auto", config: DecoderConfig | None = None,
                  dtype=None) -> str:
    """The kernel ``choice`` resolves to on ``mesh`` (None: not built yet) for a model of
    ``config`` computing in ``dtype`` (None: not known yet); ``UserError`` for one it cannot use.

    ``auto``: the per-tile loop on CPU (``causal_attention``: it keeps scores in cache); on GPU,
    cuDNN's flash attention where it applies (bfloat16, no soft-capping), else XLA's fused kernel;
    on TPU XLA's fused kernel; the tiled loop for a model with soft-capped attention logits,
    attention sinks or an indexer's choice of keys (DeepSeek-V3.2), which neither fused kernel can
    do (docs/benchmarks.md#the-accelerator-path measured them)."""
    if choice not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {choice!r} (choose from {', '.join(ATTENTION_KINDS)})")
    capped = config is not None and config.attn_logit_softcap is not None
    if choice == "fused" and capped:
        raise UserError(f"--attention fused: jax.nn.dot_product_attention has no attention-logit "
                        f"soft-capping, which {config.model_type} needs (attn_logit_softcapping "
                        f"{config.attn_logit_softcap}); use --attention tiled or auto")
    sinks = config is not None and config.attention_sinks
    if choice == "fused" and sinks:
        raise UserError(f"--attention fused: jax.nn.dot_product_attention has no attention sinks, which "
                        f"{config.model_type} has; use --attention tiled or auto")
    indexed = config is not None and config.mla is not None and config.mla.indexer is not None
    if choice in ("fused", "cudnn") and indexed:
        raise UserError(f"--attention {choice}: the fused kernels attend to every earlier key, and "
                        f"{config.model_type}'s indexer chooses each query's keys; use --attention tiled or auto")
    platform = None if mesh is None else mesh.devices.flat[0].platform
    limit = cudnn_max_head_dim(mesh)
    if choice == "cudnn":
        problem = cudnn_problem(platform, config, dtype, limit)
        if problem:
            raise UserError(f"--attention cudnn: {problem}; use --attention auto")
    if choice != "auto":
        return choice
    if platform in (None, "cpu") or capped or sinks or indexed:
        return "tiled"
    if platform == "gpu" and dtype is not None and cudnn_problem(platform, config, dtype, limit) is None:
        return "cudnn"
    return "fused"


def cache_written(cache: jax.Array, new: jax.Array, index) -> jax.Array:
    """``cache`` [B, T, K, D] with ``new`` [B, S, K, D] written from slot ``index``: a scalar (every
    row from the same slot: a prefill) or [B] (each row from its own: a decoding step, each row at
    its own position)."""
    if jnp.ndim(index) == 0:
        return jax.lax.dynamic_update_slice(cache, new, (0, index, 0, 0))
    return jax.vmap(lambda rows, x, i: jax.lax.dynamic_update_slice(rows, x, (i, 0, 0)))(cache, new, index)


def over_query_blocks(fn, *arrays: jax.Array, block: int = ATTENTION_BLOCK):
    """``fn(*arrays)`` for arrays [B, S, ...] whose rows are queries, computed ``block`` queries at a
    time (the last block zero-padded, its extra rows cut) so that what ``fn`` builds per query never
    exists for the whole sequence at once -> ``fn``'s output [B, S, ...]."""
    b, s = arrays[0].shape[:2]
    if s <= block:
        return fn(*arrays)
    n = -(-s // block)
    pad = lambda y: jnp.pad(y, ((0, 0), (0, n * block - s)) + ((0, 0),) * (y.ndim - 2))
    split = lambda y: jnp.moveaxis(pad(y).reshape(b, n, block, *y.shape[2:]), 1, 0)  # [n, B, block, ...]
    out = jax.lax.map(lambda args: fn(*args), tuple(split(y) for y in arrays))      # [n, B, block, ...]
    return jnp.moveaxis(out, 0, 1).reshape(b, n * block, *out.shape[3:])[:, :s]
