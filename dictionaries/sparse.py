"""The top-k kinds' sparse paths: choosing the k latents (a row's, or BatchTopK's batch's, ranked
among each row's candidates), decoding only the chosen ones (sparsify's decoder: their rows
gathered, not a [batch, d_sae] matmul) and gradients through the chosen entries alone (the
encoder's scattered from them, ``b_dec``'s as ``-W_enc @ sum(g)``), each an exact rewrite of the
dense computation (``dictionaries.sae``; the SAELens parity tests hold them to it).

On the CPU the gathers and scatters run a slice at a time (``ROWS_A_STEP`` rows, or
``ENTRIES_A_STEP`` of BatchTopK's entries, a ``lax.scan``) so that each slice's gathered rows stay
in cache; elsewhere in one slice. ``benchmarks/dictionary_training.py`` measures the step.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

def _centred(x: jax.Array, b_dec: jax.Array, sae: bool) -> jax.Array:
    return x - b_dec if sae else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def encoder(x: jax.Array, W_enc: jax.Array, b_enc: jax.Array, b_dec: jax.Array, sae: bool) -> jax.Array:
    """The pre-activations, their gradient to ``b_dec`` as ``-W_enc @ sum(g)`` (autodiff's: the
    [batch, d_sae] x [d_sae, d_in] product, then summed over the batch)."""
    return _centred(x, b_dec, sae) @ W_enc + b_enc


def _encoder_fwd(x, W_enc, b_enc, b_dec, sae):
    return encoder(x, W_enc, b_enc, b_dec, sae), (x, W_enc, b_dec)


def _encoder_bwd(sae, residuals, g):
    x, W_enc, b_dec = residuals
    g_enc = g.sum(0)
    return None, _centred(x, b_dec, sae).T @ g, g_enc, -(W_enc @ g_enc) if sae else jnp.zeros_like(b_dec)


encoder.defvjp(_encoder_fwd, _encoder_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def with_encoder_grad(x: jax.Array, W_enc: jax.Array, b_enc: jax.Array, b_dec: jax.Array, pre: jax.Array,
                       sae: bool) -> jax.Array:
    """``pre``, the pre-activations already computed, given the encoder's gradient."""
    return pre


def _with_encoder_grad_fwd(x, W_enc, b_enc, b_dec, pre, sae):
    return pre, (x, W_enc, b_dec)


def _with_encoder_grad_bwd(sae, residuals, g):
    return (*_encoder_bwd(sae, residuals, g), None)


with_encoder_grad.defvjp(_with_encoder_grad_fwd, _with_encoder_grad_bwd)

# The sparse products go through the chosen latents a slice at a time (a scan), so that each slice's
# gathered rows stay in cache: a block of rows (k a row), or of entries (BatchTopK's).
ROWS_A_STEP, ENTRIES_A_STEP = 64, 2048


def _slices(step: int, *arrays: jax.Array) -> list[jax.Array]:
    """Each array [n, ...] zero-padded to a multiple of ``step`` and split [n / step, step, ...]
    (on the CPU; elsewhere one slice [1, n, ...])."""
    step = step if jax.default_backend() == "cpu" else arrays[0].shape[0]
    pad = -arrays[0].shape[0] % step
    return [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, step, *a.shape[1:]) for a in arrays]


def _scatter_rows(shape: tuple[int, int], latents: jax.Array, weights: jax.Array, rows: jax.Array,
                  x: jax.Array, dtype) -> jax.Array:
    """[shape]: ``sum_i weights_i x[rows_i]`` added into row ``latents_i``, slice by slice (a
    gradient's scatter: the encoder's, the decoder's). ``rows`` [n] (BatchTopK's); for k a row,
    ``latents`` and ``weights`` [batch, k] and ``rows`` None."""
    if latents.ndim == 2:
        sliced = _slices(ROWS_A_STEP, latents, weights, x)
    else:
        sliced = _slices(ENTRIES_A_STEP, latents, weights, rows)

    def add(total, part):
        if latents.ndim == 2:
            step_latents, step_weights, step_x = part
            update = step_weights[..., None] * step_x[:, None, :]  # [step, k, d]
        else:
            step_latents, step_weights, step_rows = part
            update = step_weights[:, None] * x[step_rows]
        return total.at[step_latents.reshape(-1)].add(update.reshape(-1, shape[1])), None
    return jax.lax.scan(add, jnp.zeros(shape, dtype), sliced)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def chosen_pre(x, W_enc, b_enc, b_dec, values, rows, latents, sae):
    """``values``, the pre-activations at (``rows``, ``latents``) already computed, given their
    gradient to the encoder's weights through those entries alone (scattered, not a [d_in, batch] x
    [batch, d_sae] product of a mostly-zero gradient)."""
    return values


def _chosen_pre_fwd(x, W_enc, b_enc, b_dec, values, rows, latents, sae):
    return values, (x, W_enc, b_dec, rows, latents)


def _chosen_pre_bwd(sae, residuals, g):
    x, W_enc, b_dec, rows, latents = residuals
    d_in, d_sae = W_enc.shape
    g_enc = jnp.zeros(d_sae, g.dtype).at[latents.reshape(-1)].add(g.reshape(-1))
    g_W = _scatter_rows((d_sae, d_in), latents, g, None if g.ndim == 2 else rows, _centred(x, b_dec, sae), g.dtype).T
    return None, g_W, g_enc, -(W_enc @ g_enc) if sae else jnp.zeros_like(b_dec), None, None, None


chosen_pre.defvjp(_chosen_pre_fwd, _chosen_pre_bwd)


# (values, rows, latents): the latents that fire; [batch, k] each for TopK (rows broadcast), [n] for BatchTopK.
Chosen = tuple[jax.Array, jax.Array, jax.Array]


def top_k_rows(pre: jax.Array, k: int) -> Chosen:
    """Each row's k largest pre-activations [batch, d_sae], ReLU'd (SAELens's ``TopK``)."""
    values, latents = jax.lax.top_k(pre, k)  # [batch, k]
    return jax.nn.relu(values), jnp.arange(pre.shape[0])[:, None], latents


# BatchTopK's candidates (top_k_batch): a row's, 2k or at least 16; rows taken whole, 1/32 of the batch at most
CANDIDATES_A_ROW, LEAST_CANDIDATES, HOT_ROWS = 2, 16, 1 / 32


def top_k_batch(pre: jax.Array, k: float) -> Chosen:
    """The ``int(k * batch)`` largest ReLU'd pre-activations of the whole batch (``BatchTopK``),
    ranked among the candidates: each row's ``CANDIDATES_A_ROW * k`` largest, and the whole row where
    its smallest candidate reaches the least chosen ("hot": up to ``HOT_ROWS`` of the batch; more,
    and the whole batch is ranked). No latent left out could have been chosen: the same choice as
    ranking the whole batch (ties at the least chosen aside)."""
    batch, width = pre.shape
    n, acts = int(k * batch), jax.nn.relu(pre)
    per_row = min(width, max(math.ceil(CANDIDATES_A_ROW * k), LEAST_CANDIDATES, -(-n // batch)))
    hot_rows = max(1, int(HOT_ROWS * batch))
    if per_row == width:
        return _top_k_flat(acts, n)
    candidates, latents = _top_k(acts, per_row)  # [batch, per_row], each row's largest first
    values, at = _top_k(candidates.reshape(-1), n)  # equal values by row, then latent, as in the batch
    least = candidates[:, -1]  # rows whose other latents might be chosen (not if 0: those chosen would be 0 too)
    hot = (least >= values[-1]) & (least > 0)
    hot_count = hot.sum()

    def candidates_alone() -> Chosen:
        return values, at // per_row, latents[at // per_row, at % per_row]

    def with_hot_rows() -> Chosen:
        hot_index = jnp.nonzero(hot, size=hot_rows, fill_value=0)[0]  # [hot_rows]
        whole = jnp.where((jnp.arange(hot_rows) < hot_count)[:, None], acts[hot_index], -jnp.inf)
        pool = jnp.concatenate([jnp.where(hot[:, None], -jnp.inf, candidates).reshape(-1), whole.reshape(-1)])
        values, at = _top_k(pool, n)
        in_whole = jnp.maximum(at - batch * per_row, 0)
        candidate = at < batch * per_row
        rows = jnp.where(candidate, at // per_row, hot_index[in_whole // width])
        return values, rows, jnp.where(candidate, latents[at // per_row % batch, at % per_row], in_whole % width)

    branch = jnp.where(hot_count == 0, 0, jnp.where(hot_count <= hot_rows, 1, 2))
    return jax.lax.switch(branch, [candidates_alone, with_hot_rows, lambda: _top_k_flat(acts, n)])


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k``, each output behind a barrier: sliced, XLA would sort the whole array instead
    (and the pair behind one barrier fails XLA:CPU's TopkDecomposer)."""
    values, indices = jax.lax.top_k(x, k)
    return jax.lax.optimization_barrier(values), jax.lax.optimization_barrier(indices)


def _top_k_flat(acts: jax.Array, n: int) -> Chosen:
    values, flat = _top_k(acts.reshape(-1), n)
    return values, flat // acts.shape[1], flat % acts.shape[1]


def dense(chosen: Chosen, like: jax.Array) -> jax.Array:
    """[batch, d_sae]: the chosen latents' values in place, 0 elsewhere."""
    values, rows, latents = chosen
    return jnp.zeros_like(like).at[rows, latents].set(values)


def decode_chosen(chosen: Chosen, decoder: jax.Array, scale: jax.Array | None, batch: int) -> jax.Array:
    """[batch, d_out]: the chosen latents decoded alone (sparsify's decoder: k rows a token gathered,
    not a [batch, d_sae] matmul), each divided by ``scale`` [d_sae] where given; no bias."""
    values, rows, latents = chosen
    if scale is not None:
        values = values / scale[latents]
    return _decode_sparse(values, None if values.ndim == 2 else rows, latents, decoder, batch)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _decode_sparse(values, rows, latents, decoder, batch):
    """``decode_chosen``'s product, slice by slice (k a row: ``rows`` None)."""
    d_out = decoder.shape[1]
    if values.ndim == 2:  # k a row: a batched product over each block's gathered rows, no scatter
        def block(part):
            step_values, step_latents = part
            return jnp.einsum("bk,bkd->bd", step_values, decoder[step_latents])
        return jax.lax.map(block, _slices(ROWS_A_STEP, values, latents)).reshape(-1, d_out)[:batch]

    def add(out, part):
        step_values, step_rows, step_latents = part
        return out.at[step_rows].add(step_values[:, None] * decoder[step_latents]), None
    return jax.lax.scan(add, jnp.zeros((batch, d_out), decoder.dtype),
                        _slices(ENTRIES_A_STEP, values, rows, latents))[0]


def _decode_sparse_fwd(values, rows, latents, decoder, batch):
    return _decode_sparse(values, rows, latents, decoder, batch), (values, rows, latents, decoder)


def _decode_sparse_bwd(batch, residuals, g):
    values, rows, latents, decoder = residuals
    if values.ndim == 2:
        def block(part):
            step_g, step_latents = part
            return jnp.einsum("bd,bkd->bk", step_g, decoder[step_latents])
        g_values = jax.lax.map(block, _slices(ROWS_A_STEP, g, latents)).reshape(-1, values.shape[1])[:batch]
    else:
        def entries(part):
            step_rows, step_latents = part
            return jnp.sum(g[step_rows] * decoder[step_latents], axis=-1)
        g_values = jax.lax.map(entries, _slices(ENTRIES_A_STEP, rows, latents)).reshape(-1)[:values.shape[0]]
    g_decoder = _scatter_rows(decoder.shape, latents, values, rows, g, decoder.dtype)
    return g_values, None, None, g_decoder


_decode_sparse.defvjp(_decode_sparse_fwd, _decode_sparse_bwd)
