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
  condensed into matmuls (the UT transform: the inverse of one unit lower-triangular matrix per
  chunk, ``unit_lower_inverse``), and a loop over the chunks, doing each one's work in turn,
  carries the state from chunk to chunk: C times fewer sequential steps, each a few
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
    ``chunk_size``: zero gates and keys there leave the state as it was). A loop over the chunks
    does all of a chunk's work (``_chunk``) on slices of the inputs as they are laid out, writing
    its outputs in place: on a CPU, every operand stays in cache and no sequence-sized
    intermediate is built (each was a pass over memory costing as much as the matmuls)."""
    batch, length, heads, dv = v.shape
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    pad = -length % chunk_size
    n = (length + pad) // chunk_size

    def chunks(x: jax.Array) -> jax.Array:  # [B, S, ...] -> [B, N, C, ...] (a reshape where no padding)
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return x.reshape(batch, n, chunk_size, *x.shape[2:])

    inputs = tuple(chunks(x) for x in (q, k, v, g, beta))

    def step(i, carry):
        s, out = carry
        o, s = _chunk(*(jax.lax.dynamic_index_in_dim(x, i, 1, keepdims=False) for x in inputs), s, l2_normalize)
        return s, jax.lax.dynamic_update_index_in_dim(out, o, i, 1)

    state = jnp.zeros((batch, heads, k.shape[-1], dv), dtype) if state is None else state.astype(dtype)
    state, out = jax.lax.fori_loop(0, n, step, (state, jnp.zeros((batch, n, chunk_size, heads, dv), dtype)))
    return out.reshape(batch, n * chunk_size, heads, dv)[:, :length], state


def _chunk(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, s: jax.Array,
           l2_normalize: bool) -> tuple[jax.Array, jax.Array]:
    """One chunk of C positions (``recurrent``'s inputs for them, the state before it ``s``
    [B, H, Dk, Dv]) -> (its outputs [B, C, H, Dv], the state after it). Its updates are condensed
    into matmuls: the UT transform, (I + strictly-lower(k_beta k^T decay))^-1, solves every
    in-chunk correction at once."""
    channels = per_channel(g, beta)
    q, k, v, g, beta = _prepared(q, k, v, g, beta, l2_normalize)      # [B, H, C, D], g [B, H, C(, Dk)]
    c = k.shape[-2]
    # The log decay from the chunk's start, a cumulative sum as a matmul by [C, C] s <= l (XLA:CPU's
    # cumsum, fused into its users, is recomputed for every element they compute).
    lower = jnp.tril(jnp.ones((c, c), q.dtype))                       # [L, S]
    decay = lower @ g if channels else g @ lower.T                    # [B, H, C, Dk] or [B, H, C]
    k_beta = k * beta[..., None]
    if channels:
        system, within = channel_products(k_beta, q, k, decay)
        system = jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), system, 0.0)
    else:
        later = jnp.triu(jnp.ones((c, c), bool), 1)                   # [C, C] j > i: not read by i
        pairwise = jnp.exp(jnp.where(later, -jnp.inf, decay[..., :, None] - decay[..., None, :]))  # [B, H, C, C]
        system = jnp.where(later | jnp.eye(c, dtype=bool), 0.0, (k_beta @ jnp.swapaxes(k, -1, -2)) * pairwise)
        within = (q @ jnp.swapaxes(k, -1, -2)) * pairwise             # [B, H, C, C]
    # A position's decay scales a [C, D] operand's row (per head) or its key channels (per channel).
    decayed = (lambda x, d: x * jnp.exp(d)) if channels else (lambda x, d: x * jnp.exp(d)[..., None])
    end = decay[..., -1:, :] if channels else decay[..., -1:]         # the chunk's last position's
    # The state is read by the decayed keys (for the corrections) and queries (for the outputs) in
    # one matmul; the update then depends on it, so XLA updates the state in place.
    read = jnp.concatenate([decayed(k_beta, decay), decayed(q, decay)], axis=-2) @ s  # [B, H, 2C, Dv]
    corrected = unit_lower_inverse(system) @ (v * beta[..., None] - read[..., :c, :])  # [B, H, C, Dv]
    out = read[..., c:, :] + within @ corrected                        # [B, H, C, Dv]
    k_to_end = jnp.swapaxes(decayed(k, end - decay), -1, -2)          # [B, H, Dk, C]
    chunk_decay = jnp.exp(jnp.swapaxes(end, -1, -2)) if channels else jnp.exp(end)[..., None]  # [.., Dk | 1, 1]
    return jnp.swapaxes(out, 1, 2), s * chunk_decay + k_to_end @ corrected


def unit_lower_inverse(a: jax.Array, block: int = 16) -> jax.Array:
    """(I + a)^-1 for a strictly lower triangular ``a`` [..., C, C] (unit lower triangular, as is
    its inverse), in matmuls: blocks of up to ``block`` rows on the diagonal are inverted by
    forward substitution, then merged in halves, [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1,
    D^-1]] (flash-linear-attention's solve_tril merges its blocks so)."""
    c = a.shape[-1]
    if c <= block or c % 2:
        return _forward_substitution(a)
    h = c // 2
    halves = unit_lower_inverse(jnp.stack([a[..., :h, :h], a[..., h:, h:]], axis=-3), block)  # [..., 2, h, h]
    top, bottom = halves[..., 0, :, :], halves[..., 1, :, :]
    below = -(bottom @ a[..., h:, :h]) @ top
    return jnp.concatenate([jnp.concatenate([top, jnp.zeros_like(top)], -1),
                            jnp.concatenate([below, bottom], -1)], -2)


def _forward_substitution(a: jax.Array) -> jax.Array:
    """(I + a)^-1 for a strictly lower ``a`` [..., b, b], a row at a time: row i is e_i minus
    a's row i times the rows before it (a is zero from column i on)."""
    eye = jnp.eye(a.shape[-1], dtype=a.dtype)

    def row(i, inverse):
        a_i = jax.lax.dynamic_index_in_dim(a, i, -2)                  # [..., 1, b]
        solved = jax.lax.dynamic_index_in_dim(eye, i, 0, keepdims=False) - (a_i @ inverse)[..., 0, :]
        return jax.lax.dynamic_update_index_in_dim(inverse, solved, i, -2)

    return jax.lax.fori_loop(1, a.shape[-1], row, jnp.broadcast_to(eye, a.shape))


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
