"""The Mamba-2 recurrence (state space duality: Granite 4's, Nemotron-H's, Falcon-H1's mixers), in
two forms that compute the same numbers.

Per head h (of H, each P channels wide), a state S [P, N] is decayed by exp(dt_t A_h) and written
with dt_t x_t B_t^T, and read by C_t:

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t + D x_t

with B_t, C_t [N] shared by the heads of a group (G groups), dt_t = softplus(dt_raw + dt_bias)
clamped to the time-step limit, A = -exp(A_log) < 0; as transformers' torch paths compute it
(``models/granitemoehybrid/modeling_granitemoehybrid.py``: ``mamba2_chunk_scan``,
``mamba2_selective_state_update``).

* ``chunked``: for a forward over a sequence. Within a chunk of C positions the outputs are a
  masked, decayed attention-like product (C B^T scaled by the pairwise decays), and a
  ``lax.scan`` carries the [P, N] states from chunk to chunk.
* ``recurrent``: one position at a time (a ``lax.scan`` over positions), for decoding.

Everything is computed in float32 (in float64 where given it). Right padding is kept out of the
state by ``masked_steps``: a padded position's dt is 0, so it neither decays the state nor writes
to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.layers import full_precision


def time_steps(dt: jax.Array, dt_bias: jax.Array, limit: tuple[float, float]) -> jax.Array:
    """softplus(dt + dt_bias) [B, S, H] clamped to ``limit``, in float32 (or float64)."""
    dtype = jnp.promote_types(dt.dtype, jnp.float32)
    return jnp.clip(jax.nn.softplus(dt.astype(dtype) + dt_bias.astype(dtype)), *limit)


def masked_steps(dt: jax.Array, lengths: jax.Array) -> jax.Array:
    """``dt`` [B, S, H] zero past each row's length ``lengths`` [B]: no decay, no write."""
    real = (jnp.arange(dt.shape[1])[None, :] < lengths[:, None])[..., None]  # [B, S, 1]
    return jnp.where(real, dt, 0.0)


def _grouped(b: jax.Array, heads: int) -> jax.Array:
    """B or C [B, S, G, N] repeated to the heads [B, S, H, N] (each group serving H / G consecutive)."""
    return jnp.repeat(b, heads // b.shape[2], axis=2)


@full_precision
def recurrent(x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array,
              state: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [B, S, H, P], dt [B, S, H] (after ``time_steps``), a [H] (negative), b, c [B, S, G, N],
    d [H]; ``state`` [B, H, P, N] (None: zeros) -> (y [B, S, H, P] float32, the final state)."""
    dtype = dt.dtype
    x, b, c = x.astype(dtype), _grouped(b, x.shape[2]).astype(dtype), _grouped(c, x.shape[2]).astype(dtype)
    batch, _, heads, p = x.shape
    state = jnp.zeros((batch, heads, p, b.shape[-1]), dtype) if state is None else state.astype(dtype)

    def step(s, inputs):
        x_t, dt_t, b_t, c_t = inputs                                      # [B, H, P], [B, H], [B, H, N] x 2
        s = s * jnp.exp(dt_t * a)[..., None, None] + (dt_t[..., None] * x_t)[..., None] * b_t[:, :, None, :]
        return s, jnp.einsum("bhpn,bhn->bhp", s, c_t)

    steps = tuple(jnp.moveaxis(y, 1, 0) for y in (x, dt, b, c))          # positions first
    state, y = jax.lax.scan(step, state, steps)                            # y [S, B, H, P]
    return jnp.moveaxis(y, 0, 1) + d.astype(dtype)[:, None] * x, state


@full_precision
def chunked(x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array,
            state: jax.Array | None = None, chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """``recurrent``'s result, computed chunk by chunk (the sequence zero-padded to a multiple of
    ``chunk_size``: a zero dt there leaves the state as it was). Heads are laid out group by group
    ([G, K] for H = G x K), each chunk's positions after them: C Bᵀ is computed once per group, and
    the states' products are matmuls whose rows are a group's heads x channels."""
    dtype = dt.dtype
    batch, length, heads, p = x.shape
    groups, n_state = b.shape[2], b.shape[-1]
    k = heads // groups
    x, b, c = x.astype(dtype), b.astype(dtype), c.astype(dtype)
    pad = -length % chunk_size
    n = (length + pad) // chunk_size

    def chunks(y: jax.Array) -> jax.Array:  # [B, S, ...] -> [B, N, C, ...]
        y = jnp.pad(y, ((0, 0), (0, pad)) + ((0, 0),) * (y.ndim - 2))
        return y.reshape(batch, n, chunk_size, *y.shape[2:])

    xs = chunks(x).reshape(batch, n, chunk_size, groups, k, p).transpose(0, 1, 3, 4, 2, 5)  # [B, N, G, K, C, P]
    dts = chunks(dt).reshape(batch, n, chunk_size, groups, k).transpose(0, 1, 3, 4, 2)      # [B, N, G, K, C]
    bs, cs = (chunks(y).transpose(0, 1, 3, 2, 4) for y in (b, c))                           # [B, N, G, C, Ns]
    log_decay = jnp.cumsum(dts * a.reshape(groups, k)[:, :, None], axis=-1)  # [B, N, G, K, C] from the chunk's start
    later = jnp.triu(jnp.ones((chunk_size, chunk_size), bool), 1)            # [C, C] s > l: not read by l
    pairwise = jnp.exp(jnp.where(later, -jnp.inf, log_decay[..., :, None] - log_decay[..., None, :]))  # [.., L, S]
    scores = jnp.einsum("bnglm,bngsm->bngls", cs, bs)[:, :, :, None] * pairwise  # [B, N, G, K, L, S]
    written = xs * dts[..., None]                                            # [B, N, G, K, C, P]: dt x
    within = jnp.einsum("bngkls,bngksp->bngklp", scores, written)
    to_end = jnp.exp(log_decay[..., -1:] - log_decay)                        # [B, N, G, K, C]
    chunk_states = jnp.einsum("bngksp,bngsm->bngkpm", written * to_end[..., None], bs)  # what each chunk adds
    chunk_decay = jnp.exp(log_decay[..., -1])                                # [B, N, G, K]

    def carry(s, inputs):
        added, decay = inputs                                                # [B, G, K, P, Ns], [B, G, K]
        return s * decay[..., None, None] + added, s                         # the state before each chunk

    state = (jnp.zeros((batch, groups, k, p, n_state), dtype) if state is None
             else state.astype(dtype).reshape(batch, groups, k, p, n_state))
    state, before = jax.lax.scan(carry, state, (jnp.moveaxis(chunk_states, 1, 0), jnp.moveaxis(chunk_decay, 1, 0)))
    before = jnp.moveaxis(before, 0, 1)                                      # [B, N, G, K, P, Ns]
    from_before = jnp.einsum("bnglm,bngkpm->bngklp", cs, before) * jnp.exp(log_decay)[..., None]
    y = (within + from_before).transpose(0, 1, 4, 2, 3, 5).reshape(batch, n * chunk_size, heads, p)[:, :length]
    return y + d.astype(dtype)[:, None] * x, state.reshape(batch, heads, p, n_state)
