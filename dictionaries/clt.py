"""Cross-layer transcoders (CLTs): one input site read at every layer, layer l's latents writing
layer l's output and every later layer's; the reconstruction loss summed over the output layers.

Weights, one set a layer l of L (circuit-tracer's names and its ``W_dec_l`` layout):
``W_enc_l [d_in, d_sae]``, ``b_enc_l [d_sae]``, ``W_dec_l [d_sae, L - l, d_out]`` (slice j writes
layer l + j), ``b_dec_l [d_out]`` (layer l's output bias); ``threshold_l [d_sae]`` (jumprelu).

    out_j = sum_{l <= j} f_l @ W_dec_l[:, j - l] + b_dec_j      f_l = activation(x_l @ W_enc_l + b_enc_l)

Losses, each a mean over tokens: ``mse_loss`` = sum_j |out_j - y_j|^2 (summed over dimensions
and layers); standard: ``l1_loss`` = coefficient * sum_l sum_i f_l,i * |W_dec_l,i| (the norm of
latent i's whole decoder, every layer it writes); jumprelu: ``l0_loss`` through the same
straight-through estimator as an SAE's (``dictionaries.sae.step``); topk: each layer's k largest of
pre-activations times those norms, no sparsity term.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from common.cli import UserError
from dictionaries.config import DictionaryConfig
from dictionaries.sae import Params, jumprelu, step
from dictionaries.sparse import dense, top_k_rows

CLT_ARCHITECTURES = ("standard", "jumprelu", "topk")


def init_clt(config: DictionaryConfig, layers: int, d_in: int, d_out: int, key: jax.Array, dtype: Any) -> Params:
    """Each layer's encoder and decoder drawn uniformly, decoder rows of ``decoder_init_norm`` over
    every layer they write, biases zero."""
    if config.architecture not in CLT_ARCHITECTURES:
        raise UserError(f"a cross-layer transcoder is one of {', '.join(CLT_ARCHITECTURES)}, "
                        f"not {config.architecture!r}")
    d_sae, params = config.width(d_in), {}
    for layer, (enc_key, dec_key) in enumerate(jax.random.split(key, (layers, 2))):
        bound = math.sqrt(6 / d_out)
        W_dec = jax.random.uniform(dec_key, (d_sae, layers - layer, d_out), dtype, -bound, bound)
        W_dec = W_dec / jnp.linalg.norm(W_dec.reshape(d_sae, -1), axis=-1)[:, None, None] * config.decoder_init_norm
        W_enc = jax.random.uniform(enc_key, (d_in, d_sae), dtype, -1, 1)
        W_enc = W_enc / jnp.linalg.norm(W_enc, axis=0, keepdims=True) * config.decoder_init_norm
        params.update({f"W_enc_{layer}": W_enc, f"b_enc_{layer}": jnp.zeros(d_sae, dtype),
                       f"W_dec_{layer}": W_dec, f"b_dec_{layer}": jnp.zeros(d_out, dtype)})
        if config.architecture == "jumprelu":
            params[f"threshold_{layer}"] = jnp.full(d_sae, config.jumprelu_init_threshold, dtype)
    return params


def layer_count(params: Params) -> int:
    return sum(name.startswith("W_enc_") for name in params)


def decoder_norms(params: Params, layer: int) -> jax.Array:
    """[d_sae]: each latent of ``layer``'s decoder norm over every layer it writes."""
    W_dec = params[f"W_dec_{layer}"]
    return jnp.linalg.norm(W_dec.reshape(W_dec.shape[0], -1), axis=-1)


def encode_clt(config: DictionaryConfig, params: Params,
               xs: list[jax.Array]) -> tuple[list[jax.Array], list[jax.Array]]:
    """(each layer's feature activations, its pre-activations), [batch, d_sae] each, from the
    input site's rows ``xs`` [batch, d_in] at every layer."""
    acts, pres = [], []
    for layer, x in enumerate(xs):
        pre = x @ params[f"W_enc_{layer}"] + params[f"b_enc_{layer}"]
        if config.architecture == "standard":
            f = jax.nn.relu(pre)
        elif config.architecture == "jumprelu":
            f = jumprelu(pre, params[f"threshold_{layer}"], config.jumprelu_bandwidth)
        else:
            pre = pre * decoder_norms(params, layer) if config.rescale_acts_by_decoder_norm else pre
            f = dense(top_k_rows(pre, int(config.k)), pre)
        acts.append(f)
        pres.append(pre)
    return acts, pres


def decode_clt(config: DictionaryConfig, params: Params, acts: list[jax.Array]) -> list[jax.Array]:
    """Each output layer's reconstruction [batch, d_out]: every earlier-or-same layer's latents decoded into it."""
    layers, outs = len(acts), []
    rescale = config.architecture == "topk" and config.rescale_acts_by_decoder_norm
    scaled = [f / decoder_norms(params, l) if rescale else f for l, f in enumerate(acts)]
    for target in range(layers):
        out = params[f"b_dec_{target}"]
        for source in range(target + 1):
            out = out + scaled[source] @ params[f"W_dec_{source}"][:, target - source]
        outs.append(out)
    return outs


def clt_losses(config: DictionaryConfig, params: Params, xs: list[jax.Array], ys: list[jax.Array],
               coefficient: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    """(the loss, {``losses``, ``acts``, ``outs``}) of one batch: ``xs`` the input site's rows at
    every layer, ``ys`` the output site's, [batch, width] each."""
    acts, pres = encode_clt(config, params, xs)
    outs = decode_clt(config, params, acts)
    losses = {"mse_loss": sum(jnp.sum((out - y) ** 2, axis=-1).mean() for out, y in zip(outs, ys))}
    if config.architecture == "standard":
        losses["l1_loss"] = sum((coefficient * jnp.sum(f * decoder_norms(params, l), axis=-1)).mean()
                                for l, f in enumerate(acts))
    elif config.architecture == "jumprelu":
        losses["l0_loss"] = sum((coefficient * jnp.sum(step(pre, params[f"threshold_{l}"], config.jumprelu_bandwidth),
                                                       axis=-1)).mean() for l, pre in enumerate(pres))
    return sum(losses.values()), {"losses": losses, "acts": acts, "outs": outs}
