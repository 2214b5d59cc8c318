"""The gated delta rule: the recurrence of Gated DeltaNet layers (Qwen3.5, Qwen3-Next), in two
forms that compute the same numbers.

Per value head, a state S [Dk, Dv] is decayed by exp(g_t), then corrected toward v_t where it
mispredicts it from k_t (the delta rule, at the rate beta_t), and read by q_t:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T,   o_t = q_t^T S_t

with q and k L2-normalised where asked and q scaled by Dk^-1/2, as transformers' torch paths
(``models/qwen3_5/modeling_qwen3_5.py``: ``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``) and flash-linear-attention's kernels compute it.

* ``chunked``: for a forward over a sequence. Within a chunk of C positions the updates are
  condensed into matmuls (the UT transform: one unit lower-triangular solve per chunk), and a
  ``lax.scan`` carries the state from chunk to chunk: C times fewer sequential steps, each a few
  [C, D] x [D, D] matmuls.
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

L2_EPS = 1e-6  # transformers' l2norm: x / sqrt(sum(x^2) + eps)


def l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def masked_gates(g: jax.Array, beta: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``g``, ``beta`` [B, S, H] with the positions past each row's length ``lengths`` [B] made
    inert: no decay (g = 0), no write (beta = 0)."""
    real = (jnp.arange(g.shape[1])[None, :] < lengths[:, None])[..., None]  # [B, S, 1]
    return jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)


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


def recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
              state: jax.Array | None = None, l2_normalize: bool = True) -> tuple[jax.Array, jax.Array]:
    """q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g (log decay, <= 0), beta [B, S, Hv]; ``state``
    [B, Hv, Dk, Dv] (None: zeros) -> (outputs [B, S, Hv, Dv] in float32, the final state)."""
    q, k, v, g, beta = _prepared(q, k, v, g, beta, l2_normalize)
    batch, heads, _, dk = k.shape
    state = jnp.zeros((batch, heads, dk, v.shape[-1]), q.dtype) if state is None else state.astype(q.dtype)

    def step(s, inputs):
        q_t, k_t, v_t, g_t, beta_t = inputs                          # [B, H, D] / [B, H]
        s = s * jnp.exp(g_t)[..., None, None]                        # [B, H, Dk, Dv]
        predicted = jnp.einsum("bhk,bhkv->bhv", k_t, s)
        s = s + k_t[..., :, None] * ((v_t - predicted) * beta_t[..., None])[..., None, :]
        return s, jnp.einsum("bhk,bhkv->bhv", q_t, s)

    steps = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))  # positions first
    state, out = jax.lax.scan(step, state, steps)                    # out [S, B, H, Dv]
    return jnp.moveaxis(out, 0, 1), state


def chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
            state: jax.Array | None = None, l2_normalize: bool = True,
            chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """``recurrent``'s result, computed chunk by chunk (the sequence zero-padded to a multiple of
    ``chunk_size``: zero gates and keys there leave the state as it was)."""
    q, k, v, g, beta = _prepared(q, k, v, g, beta, l2_normalize)
    batch, heads, length, dk = k.shape
    dv, c = v.shape[-1], chunk_size
    pad = -length % c
    q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
    g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    n = (length + pad) // c
    q, k, v = (x.reshape(batch, heads, n, c, x.shape[-1]) for x in (q, k, v))  # [B, H, N, C, D]
    g, beta = (x.reshape(batch, heads, n, c) for x in (g, beta))                # [B, H, N, C]

    decay = jnp.cumsum(g, axis=-1)                                   # log decay from the chunk's start
    later = jnp.triu(jnp.ones((c, c), bool), 1)                      # [C, C] j > i: not read by i
    pairwise = jnp.exp(jnp.where(later, -jnp.inf, decay[..., :, None] - decay[..., None, :]))  # [B, H, N, C, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # The UT transform: (I + strictly-lower(k_beta k^T decay)) solves every in-chunk correction at once.
    system = jnp.where(later | jnp.eye(c, dtype=bool), 0.0, (k_beta @ jnp.swapaxes(k, -1, -2)) * pairwise)
    unit = system + jnp.eye(c, dtype=q.dtype)

    def solve(b):
        return jax.lax.linalg.triangular_solve(unit, b, left_side=True, lower=True, unit_diagonal=True)

    new_values = solve(v_beta)                                        # [B, H, N, C, Dv]
    k_decayed = solve(k_beta * jnp.exp(decay)[..., None])             # [B, H, N, C, Dk]
    within = (q @ jnp.swapaxes(k, -1, -2)) * pairwise                 # [B, H, N, C, C]
    q_decayed = q * jnp.exp(decay)[..., None]
    k_to_end = k * jnp.exp(decay[..., -1:] - decay)[..., None]
    chunk_decay = jnp.exp(decay[..., -1])[..., None, None]            # [B, H, N, 1, 1]

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
