"""The model's unembedding as TransformerLens has it after ``from_pretrained``'s defaults: ``W_U``
[hidden, vocab] with the final norm's weight folded in (``fold_ln``) and centred over the
vocabulary (``center_unembed``), so that a direction ``d`` in the residual stream (a feature's
decoder row, a probe's direction) changes the logits by ``d @ W_U``, up to the final norm's scale
and a shift common to every token. Dashboards show these logit effects (SAEDashboard's, from
TransformerLens's ``W_U``).

Loaded from the checkpoint's embedding, final norm and LM head only, and computed by the decoder's
own ``unembed`` (tied or not), without its soft cap (Gemma 2's is not in ``W_U``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from model.checkpoint import Checkpoint
from model.decoder import Decoder
from model.families import load_config
from model.hub import resolve_model_dir
from model.params import load_params
from model.sharding import make_mesh


def folded_unembedding(model_path: str) -> np.ndarray:
    """[hidden, vocab] float32: the LM head with the final norm's gain folded in, centred over the vocabulary."""
    model_dir = resolve_model_dir(model_path)
    config = dataclasses.replace(load_config(model_dir), final_logit_softcap=None)
    mesh = make_mesh("1d", config, devices=jax.devices()[:1])
    params = load_params(Checkpoint(model_dir), config, mesh, jnp.float32, num_layers=0, with_head=True)
    gain = np.asarray(params["norm"]["weight"], np.float32)  # [hidden]
    if config.norm_unit_offset:  # Gemma's RMSNorm scales by (1 + w)
        gain = gain + 1.0
    head = Decoder(config, jnp.float32)
    with jax.default_matmul_precision("highest"):
        # Row i: the logits of a final-normed state holding gain_i at dimension i (unembed is linear).
        folded = head.apply({"params": params}, jnp.diag(jnp.asarray(gain)), method=Decoder.unembed)  # [H, V]
    folded = np.asarray(folded, np.float32)
    return folded - folded.mean(axis=1, keepdims=True)
