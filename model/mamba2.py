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
  masked, decayed attention-like product (C B^T scaled by the pairwise decays), and a loop over
  the chunks, doing each one's work in turn, carries the [P, N] states from chunk to chunk.
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
    ``chunk_size``: a zero dt there leaves the state as it was). A loop over the chunks does all of
    a chunk's work (``_chunk``) on slices of the inputs as they are laid out, writing its outputs
    in place: on a CPU, every operand stays in cache and no sequence-sized intermediate is built
    (each was a pass over memory costing as much as the matmuls)."""
    dtype = dt.dtype
    batch, length, heads, p = x.shape
    groups, n_state = b.shape[2], b.shape[-1]
    pad = -length % chunk_size
    n = (length + pad) // chunk_size

    def chunks(y: jax.Array) -> jax.Array:  # [B, S, ...] -> [B, N, C, ...] (a reshape where no padding)
        y = jnp.pad(y.astype(dtype), ((0, 0), (0, pad)) + ((0, 0),) * (y.ndim - 2))
        return y.reshape(batch, n, chunk_size, *y.shape[2:])

    inputs = (chunks(x), chunks(dt), chunks(b), chunks(c))  # [B, N, C, H, P], [B, N, C, H], [B, N, C, G, Ns] x 2
    a, d = a.astype(dtype), d.astype(dtype)

    def step(i, carry):
        s, out = carry
        y, s = _chunk(*(jax.lax.dynamic_index_in_dim(y, i, 1, keepdims=False) for y in inputs), a, d, s)
        return s, jax.lax.dynamic_update_index_in_dim(out, y, i, 1)

    # The state transposed, [B, G, Ns, K x P] for H = G x K: read and written by matmuls whose
    # rows are a group's positions or state channels and whose columns are its heads x channels.
    s = (jnp.zeros((batch, groups, n_state, heads // groups * p), dtype) if state is None
         else jnp.swapaxes(state.astype(dtype).reshape(batch, groups, -1, n_state), -1, -2))
    s, y = jax.lax.fori_loop(0, n, step, (s, jnp.zeros((batch, n, chunk_size, heads, p), dtype)))
    state = jnp.swapaxes(s, -1, -2).reshape(batch, heads, p, n_state)
    return y.reshape(batch, n * chunk_size, heads, p)[:, :length], state


def _chunk(x: jax.Array, dt: jax.Array, b: jax.Array, c: jax.Array, a: jax.Array, d: jax.Array,
           s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One chunk: x [B, C, H, P], dt [B, C, H], b, c [B, C, G, Ns], the state before it ``s``
    [B, G, Ns, K x P] -> (its outputs [B, C, H, P], the state after it). Heads are laid out group
    by group: C Bᵀ is computed once per group; within the chunk, the outputs are a masked, decayed
    attention-like product (C Bᵀ scaled by each head's pairwise decays), plus what the state
    before it contributes."""
    batch, size, heads, p = x.shape
    groups = b.shape[2]
    k = heads // groups
    xg = x.reshape(batch, size, groups, k, p).transpose(0, 2, 1, 3, 4)     # [B, G, C, K, P]
    dtg = dt.reshape(batch, size, groups, k).transpose(0, 2, 3, 1)         # [B, G, K, C]
    bg, cg = b.transpose(0, 2, 1, 3), c.transpose(0, 2, 1, 3)              # [B, G, C, Ns]
    # Each head's log decay from the chunk's start, a cumulative sum as a matmul by [S, L] s <= l
    # (XLA:CPU's cumsum, fused into its users, is recomputed for every element they compute).
    log_decay = (dtg * a.reshape(groups, k, 1)) @ jnp.triu(jnp.ones((size, size), x.dtype))  # [B, G, K, C]
    later = jnp.triu(jnp.ones((size, size), bool), 1)                      # [C, C] s > l: not read by l
    pairwise = jnp.exp(jnp.where(later, -jnp.inf, log_decay[..., :, None] - log_decay[..., None, :]))  # [B, G, K, L, S]
    scores = (cg @ jnp.swapaxes(bg, -1, -2))[:, :, None] * pairwise        # [B, G, K, L, S]
    written = xg * jnp.swapaxes(dtg, -1, -2)[..., None]                    # [B, G, C, K, P]: dt x
    within = scores @ written.transpose(0, 1, 3, 2, 4)                     # [B, G, K, L, P]
    read = (cg @ s).reshape(written.shape) * jnp.exp(jnp.swapaxes(log_decay, -1, -2))[..., None]  # [B, G, C, K, P]
    to_end = jnp.exp(log_decay[..., -1:] - log_decay)                      # [B, G, K, C]
    added = (written * jnp.swapaxes(to_end, -1, -2)[..., None]).reshape(batch, groups, size, k * p)
    chunk_decay = jnp.repeat(jnp.exp(log_decay[..., -1]), p, axis=-1)[:, :, None, :]  # [B, G, 1, K x P]
    s = s * chunk_decay + jnp.swapaxes(bg, -1, -2) @ added                # [B, G, Ns, K x P]
    y = within.transpose(0, 1, 3, 2, 4) + read + d.reshape(groups, 1, k, 1) * xg  # [B, G, C, K, P]
    return y.transpose(0, 2, 1, 3, 4).reshape(batch, size, heads, p), s
