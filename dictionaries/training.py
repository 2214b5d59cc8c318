"""One training step of a dictionary, compiled once: SAELens's ``SAETrainer._train_step`` order.

    state = initial_state(params)
    state, metrics = train_step(state, x, target, lr, coefficient, config=..., optimizer=..., sae=True)

The state (a pytree, what a checkpoint holds): the weights, Adam's moments, the steps taken, each
latent's steps since it last fired (float32, as SAELens counts them; ``[layers, d_sae]`` for a
CLT) and BatchTopK's running threshold. In a step: a JumpReLU's thresholds clamped at 0; the dead
latents (not fired in more than ``dead_feature_window`` steps, counted before this batch); the
losses and their gradients; the firing counts and the threshold updated from this batch; the
gradients clipped; Adam.

``step_function`` is the step unjitted, for ``dictionaries.mesh`` to compile with the mesh's shardings.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dictionaries.clt import clt_losses, layer_count
from dictionaries.config import BATCH_TOP_K, DictionaryConfig, OptimizerConfig
from dictionaries.optimizer import adam, clipped
from dictionaries.sae import Params, training_losses

State = dict[str, Any]
KINDS = ("sae", "transcoder", "clt")


def initial_state(params: Params) -> State:
    moments = {which: {name: jnp.zeros_like(p) for name, p in params.items()} for which in ("m", "v")}
    if "b_enc" in params:
        since_fired = jnp.zeros(params["b_enc"].shape, jnp.float32)  # [d_sae]
    else:  # a CLT's, [layers, d_sae]
        since_fired = jnp.zeros((layer_count(params), params["b_enc_0"].shape[0]), jnp.float32)
    return {"params": params, "moments": moments, "step": jnp.zeros((), jnp.int32),
            "since_fired": since_fired, "topk_threshold": jnp.zeros((), next(iter(params.values())).dtype)}


def step_function(kind: str, config: DictionaryConfig, optimizer: OptimizerConfig) -> Callable:
    """``(state, xs, ys, lr, coefficient) -> (state, metrics)`` of a dictionary kind (``KINDS``):
    ``xs`` the input site's rows [batch, d_in] (a CLT's: at each layer), ``ys`` the output's."""
    return functools.partial(_step, kind=kind, config=config, optimizer=optimizer)


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "sae"), donate_argnames=("state",))
def train_step(state: State, x: jax.Array, target: jax.Array, lr: jax.Array, coefficient: jax.Array, *,
               config: DictionaryConfig, optimizer: OptimizerConfig, sae: bool) -> tuple[State, dict[str, jax.Array]]:
    """One step on ``x`` [batch, d_in] reconstructing ``target`` [batch, d_out]: the new state and
    the step's metrics (the loss, each loss term, L0, explained variance, computed before the
    update; the latents dead after it)."""
    return _step(state, (x,), (target,), lr, coefficient, kind="sae" if sae else "transcoder", config=config,
                 optimizer=optimizer)


def _step(state: State, xs: tuple[jax.Array, ...], ys: tuple[jax.Array, ...], lr: jax.Array, coefficient: jax.Array,
          *, kind: str, config: DictionaryConfig, optimizer: OptimizerConfig) -> tuple[State, dict[str, jax.Array]]:
    # SAELens clamps a JumpReLU's thresholds before each forward pass, not after the update
    params = {name: jnp.maximum(p, 0) if name.startswith("threshold") else p for name, p in state["params"].items()}
    dead = state["since_fired"] > optimizer.dead_feature_window
    if kind == "clt":
        loss_of = functools.partial(clt_losses, config)
        (loss, found), grads = jax.value_and_grad(loss_of, has_aux=True)(params, list(xs), list(ys), coefficient)
        acts, outs = jnp.stack(found["acts"]), found["outs"]  # [layers, batch, d_sae]
        fired = jnp.any(acts != 0, axis=1)                    # [layers, d_sae]
        l0 = jnp.sum(acts != 0, axis=-1).mean()
    else:
        loss_of = functools.partial(training_losses, config)
        (loss, found), grads = jax.value_and_grad(loss_of, has_aux=True)(
            params, xs[0], ys[0], kind == "sae", coefficient, dead)
        outs = [found["out"]]
        if "chosen" in found:  # TopK's, BatchTopK's: from the chosen latents, no [batch, d_sae] pass
            acts, _, latents = found["chosen"]  # the values [batch, k] or [n], their latents
            fires = (acts != 0).reshape(-1)
            fired = jnp.zeros(state["since_fired"].shape, jnp.int32).at[latents.reshape(-1)].add(
                fires.astype(jnp.int32)) > 0                  # [d_sae]
            l0 = jnp.sum(fires) / xs[0].shape[0]
        else:
            acts = found["acts"][None]
            fired = jnp.any(found["acts"] != 0, axis=0)      # [d_sae]
            l0 = jnp.sum(acts != 0, axis=-1).mean()
    threshold = state["topk_threshold"]
    if config.architecture in BATCH_TOP_K:
        positive = acts > 0
        least = jnp.min(jnp.where(positive, acts, jnp.inf)).astype(threshold.dtype)
        rate = config.topk_threshold_lr
        threshold = jnp.where(positive.any(), (1 - rate) * threshold + rate * least, threshold)
    count = state["step"] + 1
    new_params, moments = adam(optimizer, params, clipped(grads), state["moments"], count.astype(lr.dtype), lr)
    since_fired = jnp.where(fired, 0.0, state["since_fired"] + 1)
    new_state = {"params": new_params, "moments": moments, "step": count, "since_fired": since_fired,
                 "topk_threshold": threshold}
    dead = jnp.sum(since_fired > optimizer.dead_feature_window)  # after this batch: the next step's
    return new_state, {"loss": loss, **found["losses"], **batch_metrics(ys, outs, l0), "dead": dead}


def batch_metrics(targets: tuple[jax.Array, ...], outs: list[jax.Array], l0: jax.Array) -> dict[str, jax.Array]:
    """SAELens's per-batch log: explained variance (1 - mean squared error / mean variance about
    the batch's mean, each summed over dimensions, and over a CLT's layers) and L0 (latents firing
    per token; a CLT's per token and layer), ``l0``."""
    error = sum(jnp.sum((out - y) ** 2, axis=-1) for out, y in zip(outs, targets))
    variance = sum(jnp.sum((y - y.mean(0)) ** 2, axis=-1) for y in targets)
    return {"explained_variance": 1 - error.mean() / variance.mean(),
            "l0": l0}
