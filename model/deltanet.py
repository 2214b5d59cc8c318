"""The gated delta rule: the recurrence of Gated DeltaNet layers (Qwen3.5, Qwen3-Next, OLMo
hybrid) and of Kimi Delta Attention (Kimi Linear), in two forms that compute the same numbers.

Per value head, a state S [Dk, Dv] is decayed by exp(g_t), then corrected toward v_t where it
mispredicts it from k_t (the delta rule, at the rate beta_t), and read by q_t:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T,   o_t = q_t^T S_t

Gated DeltaNet's g_t is one number a head; Kimi Delta Attention's is a vector over the key
channels (exp(g_t) then scales each row of S: ``Diag(exp(g_t)) S``), as transformers' Kimi Linear
torch paths (``chunk_kimi_delta_attention``, ``recurrent_kimi_delta_attention``) compute it.

with q and k L2-normalised where asked and q scaled by Dk^-1/2, as transformers' torch paths
(``models/qwen3_5/modeling_qwen3_5.py``: ``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``) and flash-linear-attention's kernels compute it.

* ``chunked``: for a forward over a sequence. Within a chunk of C positions the updates are
  condensed into matmuls (the UT transform: one unit lower-triangular solve per chunk), and a
  ``lax.scan`` carries the state from chunk to chunk: C times fewer sequential steps, each a few
  [C, D] x [D, D] matmuls. With a decay per key channel the chunk's pairwise products
  sum_d a_id b_jd exp(G_id - G_jd) are no plain matmul: ``channel_products`` factors them over
  sub-chunks with every exponent <= 0 (flash-linear-attention's way for KDA), one chunk at a time.
* ``recurrent``: one position at a time (a ``lax.scan`` over positions), for decoding.

Everything is computed in float32 (in float64 where given it: the tests compare the forms so). Right
padding is kept out of the state by ``masked_gates``:
a padded position neither decays the state (g = 0) nor writes to it (beta = 0), so the final
state of a row is its state after its last real token, and its real positions' outputs do not
depend on the padding (which, being later, they never read anyway).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.layers import full_precision

L2_EPS = 1e-6  # transformers' l2norm: x / sqrt(sum(x^2) + eps)


def l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def masked_gates(g: jax.Array, beta: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``g`` [B, S, H] (or [B, S, H, Dk]), ``beta`` [B, S, H] with the positions past each row's
    length ``lengths`` [B] made inert: no decay (g = 0), no write (beta = 0)."""
    real = jnp.arange(g.shape[1])[None, :] < lengths[:, None]  # [B, S]
    inert = lambda x: jnp.where(real.reshape(real.shape + (1,) * (x.ndim - 2)), x, 0.0)
    return inert(g), inert(beta)


def per_channel(g: jax.Array, beta: jax.Array) -> bool:
    """Whether the log decay ``g`` is a vector over key channels (Kimi's) rather than one number
    a head (it has one axis more than ``beta``)."""
    return g.ndim > beta.ndim


def _prepared(q, k, v, g, beta, l2_normalize: bool):
    """float32 (or float64), heads first ([B, H, S, D] and [B, H, S]); q and k repeated to the
    value heads (each serving H_v / H_k consecutive ones), L2-normalised where asked, q scaled."""
    groups = v.shape[2] // k.shape[2]
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    q, k = (jnp.repeat(x, groups, axis=2) if groups > 1 else x for x in (q, k))
    q, k, v = (jnp.swapaxes(x.astype(dtype), 1, 2) for x in (q, k, v))
    g, beta = (jnp.swapaxes(x.astype(dtype), 1, 2) for x in (g, beta))
    if l2_normalize:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


@full_precision
def recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
              state: jax.Array | None = None, l2_normalize: bool = True) -> tuple[jax.Array, jax.Array]:
    """q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g (log decay, <= 0) [B, S, Hv] or per key channel
    [B, S, Hv, Dk], beta [B, S, Hv]; ``state`` [B, Hv, Dk, Dv] (None: zeros) -> (outputs
    [B, S, Hv, Dv] in float32, the final state)."""
    channels = per_channel(g, beta)
    q, k, v, g, beta = _prepared(q, k, v, g, beta, l2_normalize)
    batch, heads, _, dk = k.shape
    state = jnp.zeros((batch, heads, dk, v.shape[-1]), q.dtype) if state is None else state.astype(q.dtype)

    def step(s, inputs):
        q_t, k_t, v_t, g_t, beta_t = inputs                          # [B, H, D] / [B, H] (g: [B, H, Dk])
        s = s * jnp.exp(g_t)[..., None] if channels else s * jnp.exp(g_t)[..., None, None]  # [B, H, Dk, Dv]
        predicted = jnp.einsum("bhk,bhkv->bhv", k_t, s)
        s = s + k_t[..., :, None] * ((v_t - predicted) * beta_t[..., None])[..., None, :]
        return s, jnp.einsum("bhk,bhkv->bhv", q_t, s)

    steps = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))  # positions first
    state, out = jax.lax.scan(step, state, steps)                    # out [S, B, H, Dv]
    return jnp.moveaxis(out, 0, 1), state


@full_precision
def chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
            state: jax.Array | None = None, l2_normalize: bool = True,
            chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """``recurrent``'s result, computed chunk by chunk (the sequence zero-padded to a multiple of
    ``chunk_size``: zero gates and keys there leave the state as it was)."""
    channels = per_channel(g, beta)
    q, k, v, g, beta = _prepared(q, k, v, g, beta, l2_normalize)
    batch, heads, length, dk = k.shape
    dv, c = v.shape[-1], chunk_size
    pad = -length % c
    q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
    g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 3)) for x in (g, beta))
    n = (length + pad) // c
    q, k, v = (x.reshape(batch, heads, n, c, x.shape[-1]) for x in (q, k, v))  # [B, H, N, C, D]
    g = g.reshape(batch, heads, n, c, *g.shape[3:])                  # [B, H, N, C] (or [B, H, N, C, Dk])
    beta = beta.reshape(batch, heads, n, c)                          # [B, H, N, C]

    decay = jnp.cumsum(g, axis=3)                                    # log decay from the chunk's start
    later = jnp.triu(jnp.ones((c, c), bool), 1)                      # [C, C] j > i: not read by i
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    if channels:
        system, within = chunk_products(k_beta, q, k, decay)
    else:
        pairwise = jnp.exp(jnp.where(later, -jnp.inf, decay[..., :, None] - decay[..., None, :]))  # [B, H, N, C, C]
        system = jnp.where(later | jnp.eye(c, dtype=bool), 0.0, (k_beta @ jnp.swapaxes(k, -1, -2)) * pairwise)
        within = (q @ jnp.swapaxes(k, -1, -2)) * pairwise             # [B, H, N, C, C]
    # The UT transform: (I + strictly-lower(k_beta k^T decay)) solves every in-chunk correction at once.
    unit = system + jnp.eye(c, dtype=q.dtype)

    def solve(b):
        return jax.lax.linalg.triangular_solve(unit, b, left_side=True, lower=True, unit_diagonal=True)

    # A position's decay scales a [C, D] operand's row (per head) or its key channels (per channel).
    decayed = (lambda x, d: x * jnp.exp(d)) if channels else (lambda x, d: x * jnp.exp(d)[..., None])
    new_values = solve(v_beta)                                        # [B, H, N, C, Dv]
    k_decayed = solve(decayed(k_beta, decay))                         # [B, H, N, C, Dk]
    q_decayed = decayed(q, decay)
    k_to_end = decayed(k, decay[:, :, :, -1:] - decay)
    last = jnp.exp(decay[:, :, :, -1])                                # [B, H, N] (or [B, H, N, Dk])
    chunk_decay = last[..., None] if channels else last[..., None, None]  # [B, H, N, Dk | 1, 1]

    def step(s, chunk):
        new_v, k_dec, q_dec, inside, k_end, d = chunk
        corrected = new_v - k_dec @ s                                 # [B, H, C, Dv]
        out = q_dec @ s + inside @ corrected
        return s * d + jnp.swapaxes(k_end, -1, -2) @ corrected, out

    state = jnp.zeros((batch, heads, dk, dv), q.dtype) if state is None else state.astype(q.dtype)
    chunks = tuple(jnp.moveaxis(x, 2, 0) for x in (new_values, k_decayed, q_decayed, within, k_to_end, chunk_decay))
    state, out = jax.lax.scan(step, state, chunks)                    # out [N, B, H, C, Dv]
    out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, n * c, dv)[:, :, :length]
    return jnp.swapaxes(out, 1, 2), state


def chunk_products(k_beta: jax.Array, q: jax.Array, k: jax.Array, decay: jax.Array) -> tuple[jax.Array, jax.Array]:
    """With a decay per key channel, every chunk's (``channel_products``, one chunk at a time so
    that its [.., C, Dk]-per-position operands never exist for the whole sequence): ``k_beta``,
    ``q``, ``k``, ``decay`` [B, H, N, C, Dk] -> (the UT system, strictly lower; the in-chunk reads,
    lower with the diagonal), [B, H, N, C, C] each."""
    first = lambda x: jnp.moveaxis(x, 2, 0)                          # chunks first: [N, B, H, C, Dk]
    system, within = jax.lax.map(lambda xs: channel_products(*xs), tuple(first(x) for x in (k_beta, q, k, decay)))
    strict = jnp.tril(jnp.ones(system.shape[-2:], bool), -1)
    return jnp.where(strict, jnp.moveaxis(system, 0, 2), 0.0), jnp.moveaxis(within, 0, 2)


def sub_chunk(c: int) -> int:
    """The sub-chunk of a chunk of ``c`` positions: the power of two nearest sqrt(c) where it
    divides c (which balances ``channel_products``' two parts), else the whole chunk."""
    sub = 2 ** (c.bit_length() // 2)
    return sub if c % sub == 0 else c


def channel_products(k_beta: jax.Array, q: jax.Array, k: jax.Array, decay: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For one chunk ([..., C, Dk] each; ``decay`` each channel's log decay from the chunk's start,
    non-increasing), P_a[i, j] = sum_d a_id k_jd exp(decay_id - decay_jd) for j <= i (zero above),
    for a = ``k_beta`` and a = ``q``.

    The pairs' decays are C x C x Dk numbers: rather than all of them, columns before sub-chunk m
    are decayed to its first position s_m (exp(decay_{s_m} - decay_j) <= 1) and rows of it from
    there (exp(decay_i - decay_{s_m}) <= 1), a matmul a sub-chunk; only the pairs within a
    sub-chunk are decayed one by one. No exponent is positive, so nothing overflows."""
    c, dk = k.shape[-2:]
    sub = sub_chunk(c)
    n, lead = c // sub, k.shape[:-2]
    blocks = lambda x: x.reshape(*lead, n, sub, dk)                  # [.., n, sub, Dk]
    starts = decay[..., ::sub, :]                                    # [.., n, Dk] each sub-chunk's first
    from_start = jnp.exp(blocks(decay) - starts[..., None, :])       # [.., n, sub, Dk]
    before = jnp.arange(c)[None, :] < (jnp.arange(n) * sub)[:, None]  # [n, C] j before sub-chunk m
    to_start = jnp.where(before[..., None], starts[..., :, None, :] - decay[..., None, :, :], -jnp.inf)
    columns = k[..., None, :, :] * jnp.exp(to_start)                  # [.., n, C, Dk]
    upper = jnp.triu(jnp.ones((sub, sub), bool), 1)
    pairs = jnp.exp(jnp.where(upper[..., None], -jnp.inf,
                              blocks(decay)[..., :, None, :] - blocks(decay)[..., None, :, :]))  # [.., n, sub, sub, Dk]
    own_block = jnp.eye(n, dtype=k.dtype)[:, None, :, None]          # [n, 1, n, 1]

    def products(a):
        earlier = jnp.einsum("...msd,...mcd->...msc", blocks(a) * from_start, columns)    # [.., n, sub, C]
        inside = jnp.einsum("...mid,...mjd,...mijd->...mij", blocks(a), blocks(k), pairs)  # [.., n, sub, sub]
        placed = (inside[..., :, :, None, :] * own_block).reshape(*lead, n, sub, c)      # on the block diagonal
        return (earlier + placed).reshape(*lead, c, c)

    return products(k_beta), products(q)
