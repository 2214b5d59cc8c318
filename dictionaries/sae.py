"""A dictionary's weights, its encoding and its training losses, as SAELens 6.54's training SAEs
compute them (``sae_lens/saes/*_sae.py``: ``training_forward_pass``), in JAX.

Weights (SAELens's names and shapes): ``W_enc [d_in, d_sae]``, ``b_enc [d_sae]``, ``W_dec [d_sae,
d_out]``, ``b_dec [d_out]``; ``threshold [d_sae]`` (jumprelu); ``W_skip [d_out, d_in]`` (a
skip-transcoder). An SAE reads and writes one site (``d_out == d_in``) and subtracts ``b_dec`` from
its input; a transcoder reads one site and writes another's values and does not.

Losses, each a mean over the batch of a sum over the latents or dimensions, ``n`` the norm of each
decoder row (not detached, as in SAELens):
- ``mse_loss``: ``|out - target|^2``;
- standard: ``l1_loss`` = ``coefficient * sum_j f_j n_j``;
- topk, batchtopk, matryoshka: latents chosen on ``pre * n`` (``rescale_acts_by_decoder_norm``),
  decoded as ``f / n``; ``auxiliary_reconstruction_loss`` (AuxK): the ``d_in // 2`` largest
  pre-activations of dead latents reconstructing the detached residual, scaled by
  ``min(dead / (d_in // 2), 1)``; matryoshka adds ``inner_mse_loss_{w}`` for each prefix;
- jumprelu: ``l0_loss`` through a straight-through estimator of bandwidth ``jumprelu_bandwidth``
  (the threshold's gradient only), optionally ``pre_act_loss``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from dictionaries.config import BATCH_TOP_K, TOP_K, DictionaryConfig
from dictionaries.sparse import (Chosen, chosen_pre, decode_chosen, dense, encoder, top_k_batch, top_k_rows,
                                 with_encoder_grad)

Params = dict[str, jax.Array]


def init_params(config: DictionaryConfig, d_in: int, d_out: int, key: jax.Array, dtype: Any) -> Params:
    """SAELens's initialisation: decoder rows drawn kaiming-uniform and scaled to
    ``decoder_init_norm``, the encoder their transpose (an SAE, or a transcoder of equal widths;
    else drawn alike), biases zero, thresholds ``jumprelu_init_threshold``, ``W_skip`` zero."""
    d_sae = config.width(d_in)
    dec_key, enc_key = jax.random.split(key)
    bound = math.sqrt(6 / d_out)  # kaiming_uniform_ with a=0 over fan_in = d_out
    W_dec = jax.random.uniform(dec_key, (d_sae, d_out), dtype, -bound, bound)  # [d_sae, d_out]
    W_dec = W_dec / jnp.linalg.norm(W_dec, axis=-1, keepdims=True) * config.decoder_init_norm
    if d_in == d_out:
        W_enc = W_dec.T  # [d_in, d_sae]
    else:
        W_enc = jax.random.uniform(enc_key, (d_in, d_sae), dtype, -1, 1)
        W_enc = W_enc / jnp.linalg.norm(W_enc, axis=0, keepdims=True) * config.decoder_init_norm
    params = {"W_enc": W_enc, "b_enc": jnp.zeros(d_sae, dtype), "W_dec": W_dec, "b_dec": jnp.zeros(d_out, dtype)}
    if config.architecture == "jumprelu":
        params["threshold"] = jnp.full(d_sae, config.jumprelu_init_threshold, dtype)
    if config.skip:
        params["W_skip"] = jnp.zeros((d_out, d_in), dtype)
    return params


def decoder_norms(params: Params) -> jax.Array:
    return jnp.linalg.norm(params["W_dec"], axis=-1)  # [d_sae]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def jumprelu(pre: jax.Array, threshold: jax.Array, bandwidth: float) -> jax.Array:
    """``pre`` where it exceeds the threshold, else 0; the threshold's gradient by a rectangle
    window of ``bandwidth`` around it (SAELens's ``JumpReLU``)."""
    return pre * (pre > threshold)


def _jumprelu_fwd(pre, threshold, bandwidth):
    return jumprelu(pre, threshold, bandwidth), (pre, threshold)


def _jumprelu_bwd(bandwidth, residuals, grad):
    pre, threshold = residuals
    window = jnp.abs((pre - threshold) / bandwidth) < 0.5
    return (pre > threshold) * grad, jnp.sum(-(threshold / bandwidth) * window * grad, axis=0)


jumprelu.defvjp(_jumprelu_fwd, _jumprelu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def step(pre: jax.Array, threshold: jax.Array, bandwidth: float) -> jax.Array:
    """1 where ``pre`` exceeds the threshold (the L0 count); no gradient to ``pre`` (SAELens's ``Step``)."""
    return (pre > threshold).astype(pre.dtype)


def _step_fwd(pre, threshold, bandwidth):
    return step(pre, threshold, bandwidth), (pre, threshold)


def _step_bwd(bandwidth, residuals, grad):
    pre, threshold = residuals
    window = jnp.abs((pre - threshold) / bandwidth) < 0.5
    return jnp.zeros_like(pre), jnp.sum(-(1 / bandwidth) * window * grad, axis=0)


step.defvjp(_step_fwd, _step_bwd)


def pre_activations(params: Params, x: jax.Array, sae: bool) -> jax.Array:
    """[batch, d_sae]: ``(x - b_dec) @ W_enc + b_enc`` (an SAE's), ``x @ W_enc + b_enc`` (a transcoder's)."""
    return encoder(x, params["W_enc"], params["b_enc"], params["b_dec"], sae)




def auxk_loss(pre: jax.Array, dead: jax.Array, decoder: jax.Array, residual: jax.Array, k_aux: int,
              coefficient: float) -> jax.Array:
    """SAELens's AuxK: the ``min(k_aux, dead)`` largest pre-activations [batch, F] of the dead
    latents (not ReLU'd) decoded by ``decoder`` [F, d] (no bias) against ``residual`` [batch, d]."""
    dead_count = dead.sum()
    chosen = min(k_aux, pre.shape[-1])
    values, indices = jax.lax.top_k(jnp.where(dead, pre, -jnp.inf), chosen)  # [batch, chosen], largest first
    values = jnp.where(jnp.arange(chosen) < jnp.minimum(dead_count, k_aux), values, 0)
    rows = jnp.arange(pre.shape[0])[:, None]
    acts = jnp.zeros_like(pre).at[rows, indices].set(values)
    error = jnp.sum((acts @ decoder - residual) ** 2, axis=-1).mean()
    scale = jnp.minimum(dead_count / k_aux, 1.0)
    return jnp.where(dead_count > 0, coefficient * scale * error, 0.0)


def encode(config: DictionaryConfig, params: Params, x: jax.Array, sae: bool) -> tuple[jax.Array, jax.Array]:
    """(feature activations, the pre-activations they were chosen on), both [batch, d_sae], as training encodes."""
    pre = pre_activations(params, x, sae)
    kind = config.architecture
    if kind == "standard":
        return jax.nn.relu(pre), pre
    if kind == "jumprelu":
        return jumprelu(pre, params["threshold"], config.jumprelu_bandwidth), pre
    pre, chosen = choose(config, params, pre)
    return dense(chosen, pre), pre


def ranked(config: DictionaryConfig, params: Params, pre: jax.Array) -> jax.Array:
    """A top-k kind's pre-activations as it ranks them: times the decoder norms where it rescales."""
    return pre * decoder_norms(params) if config.rescale_acts_by_decoder_norm else pre


def choose(config: DictionaryConfig, params: Params, pre: jax.Array) -> tuple[jax.Array, Chosen]:
    """A top-k kind's (pre-activations as ranked, the latents chosen)."""
    pre = ranked(config, params, pre)
    return pre, (top_k_rows(pre, int(config.k)) if config.architecture == "topk" else top_k_batch(pre, config.k))


def effective_decoder(config: DictionaryConfig, params: Params) -> jax.Array:
    """[d_sae, d_out]: what each latent's activation multiplies (rows of unit norm where the top-k
    kinds rescale by the decoder's norms)."""
    if config.architecture in TOP_K and config.rescale_acts_by_decoder_norm:
        return params["W_dec"] / decoder_norms(params)[:, None]
    return params["W_dec"]


def decode(config: DictionaryConfig, params: Params, acts: jax.Array, x: jax.Array) -> jax.Array:
    """[batch, d_out]: the reconstruction (a skip-transcoder's plus ``x @ W_skip.T``)."""
    return with_skip(params, acts @ effective_decoder(config, params) + params["b_dec"], x)


def with_skip(params: Params, out: jax.Array, x: jax.Array) -> jax.Array:
    """``out`` plus a skip-transcoder's affine skip of its input ``x``."""
    return out + x @ params["W_skip"].T if "W_skip" in params else out


def training_losses(config: DictionaryConfig, params: Params, x: jax.Array, target: jax.Array, sae: bool,
                    coefficient: jax.Array, dead: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    """(the loss, {``losses``: each term by SAELens's key, ``acts``, ``out``, and a top-k kind's
    ``chosen`` latents, ``Chosen``}) of one batch:
    ``x`` [batch, d_in] read, ``target`` [batch, d_out] reconstructed (``x`` for an SAE),
    ``coefficient`` the scheduled L1 / L0 weight, ``dead`` [d_sae] bool (AuxK's, pre_act_loss's)."""
    kind, norms = config.architecture, decoder_norms(params)
    if kind in ("topk", "batchtopk"):  # only the chosen latents decoded (matryoshka decodes prefixes: dense)
        # chosen on the pre-activations as computed; the gradient through the chosen entries alone
        pre = jax.lax.stop_gradient(pre_activations(params, x, sae))
        _, (_, rows, latents) = choose(config, jax.lax.stop_gradient(params), pre)
        values = chosen_pre(x, params["W_enc"], params["b_enc"], params["b_dec"], pre[rows, latents], rows, latents,
                             sae)
        rescale = norms if config.rescale_acts_by_decoder_norm else None
        chosen = (jax.nn.relu(values if rescale is None else values * rescale[latents]), rows, latents)
        acts = dense(jax.lax.stop_gradient(chosen), pre)  # (unused by train_step: gone from its program)
        out = with_skip(params, decode_chosen(chosen, params["W_dec"], rescale, x.shape[0]) + params["b_dec"], x)
    else:
        acts, pre = encode(config, params, x, sae)
        out = decode(config, params, acts, x)
    losses = {"mse_loss": jnp.sum((out - target) ** 2, axis=-1).mean()}
    if kind == "standard":
        losses["l1_loss"] = (coefficient * jnp.sum(acts * norms, axis=-1)).mean()
    elif kind == "jumprelu":
        losses["l0_loss"] = _l0_loss(config, params, pre, acts, norms, coefficient)
        if config.pre_act_loss_coefficient is not None:
            below = jax.nn.relu(params["threshold"] - pre) * dead * norms
            losses["pre_act_loss"] = jnp.where(dead.any(), config.pre_act_loss_coefficient
                                               * jnp.sum(below, axis=-1).mean(), 0.0)
    else:
        decoder, k_aux = effective_decoder(config, params), x.shape[-1] // 2
        if kind == "matryoshka_batchtopk":
            losses.update(_matryoshka_losses(config, params, pre, acts, out, decoder, target, dead, k_aux))
        elif kind in ("topk", "batchtopk"):
            losses["auxiliary_reconstruction_loss"] = _auxk_if_dead(
                config, sae, params, x, pre, jax.lax.stop_gradient(target - out), dead)
        else:
            losses["auxiliary_reconstruction_loss"] = auxk_loss(
                pre, dead, decoder, jax.lax.stop_gradient(target - out), k_aux, config.aux_loss_coefficient)
    found = {"losses": losses, "acts": acts, "out": out}
    if kind in ("topk", "batchtopk"):
        found["chosen"] = jax.lax.stop_gradient(chosen)
    return sum(losses.values()), found


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _auxk_if_dead(config: DictionaryConfig, sae: bool, params: Params, x: jax.Array, pre: jax.Array,
                  residual: jax.Array, dead: jax.Array) -> jax.Array:
    """A top-k kind's AuxK loss on ``pre`` (the pre-activations, not ranked), it and its gradient
    computed only where a latent is dead (else 0, as SAELens skips it)."""
    return jax.lax.cond(dead.any(), functools.partial(_auxk_of, config, sae), lambda *_: jnp.zeros((), residual.dtype),
                        params, x, pre, residual, dead)


def _auxk_of(config, sae, params, x, pre, residual, dead):
    pre = ranked(config, params, with_encoder_grad(x, params["W_enc"], params["b_enc"], params["b_dec"], pre, sae))
    return auxk_loss(pre, dead, effective_decoder(config, params), residual, x.shape[-1] // 2,
                     config.aux_loss_coefficient)


def _auxk_if_dead_fwd(config, sae, params, x, pre, residual, dead):
    def skipped(params, *_):
        return jnp.zeros((), residual.dtype), jax.tree.map(jnp.zeros_like, params)
    return jax.lax.cond(dead.any(), jax.value_and_grad(functools.partial(_auxk_of, config, sae)), skipped,
                        params, x, pre, residual, dead)  # (the loss, its gradient: the residuals)


def _auxk_if_dead_bwd(config, sae, grads, g):
    return jax.tree.map(lambda grad: grad * g, grads), None, None, None, None


_auxk_if_dead.defvjp(_auxk_if_dead_fwd, _auxk_if_dead_bwd)


def _l0_loss(config: DictionaryConfig, params: Params, pre: jax.Array, acts: jax.Array, norms: jax.Array,
             coefficient: jax.Array) -> jax.Array:
    mode = config.jumprelu_sparsity_loss_mode
    if mode == "tanh":
        return (coefficient * jnp.sum(jnp.tanh(config.jumprelu_tanh_scale * acts * norms), axis=-1)).mean()
    l0 = jnp.sum(step(pre, params["threshold"], config.jumprelu_bandwidth), axis=-1)  # [batch]
    if mode == "quadratic":
        return (coefficient * 2 / config.target_l0 * (l0 - config.target_l0) ** 2).mean()
    return (coefficient * l0).mean()


def _matryoshka_losses(config: DictionaryConfig, params: Params, pre: jax.Array, acts: jax.Array, out: jax.Array,
                       decoder: jax.Array, target: jax.Array, dead: jax.Array, k_aux: int) -> dict[str, jax.Array]:
    """The prefix reconstructions' losses (``inner_mse_loss_{w}``, every prefix but the whole) and
    the AuxK loss: over every latent, or (``use_matryoshka_aux_loss``) one per prefix level."""
    losses: dict[str, jax.Array] = {}
    widths = config.widths(acts.shape[-1])
    decoded, start, aux = params["b_dec"], 0, jnp.zeros((), acts.dtype)
    for width in widths:
        decoded = acts[:, start:width] @ decoder[start:width] + decoded  # [batch, d_out], prefixes so far
        if config.use_matryoshka_aux_loss:
            aux = aux + auxk_loss(pre[:, start:width], dead[start:width], decoder[start:width],
                                  jax.lax.stop_gradient(target - decoded), k_aux, config.aux_loss_coefficient)
        if width != widths[-1]:
            losses[f"inner_mse_loss_{width}"] = jnp.sum((decoded - target) ** 2, axis=-1).mean()
        start = width
    if not config.use_matryoshka_aux_loss:
        aux = auxk_loss(pre, dead, decoder, jax.lax.stop_gradient(target - out), k_aux, config.aux_loss_coefficient)
    return {"auxiliary_reconstruction_loss": aux, **losses}


def inference_encode(config: DictionaryConfig, params: Params, topk_threshold: jax.Array, x: jax.Array,
                     sae: bool) -> jax.Array:
    """[batch, d_sae]: the feature activations of the dictionary as saved: a BatchTopK kind by its
    running threshold (SAELens saves it as a JumpReLU), the others as they train."""
    if config.architecture not in BATCH_TOP_K:
        return encode(config, params, x, sae)[0]
    pre = ranked(config, params, pre_activations(params, x, sae))
    return jax.nn.relu(pre) * (pre > topk_threshold)
