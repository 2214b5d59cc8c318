"""One training step of a dictionary, compiled once: SAELens's ``SAETrainer._train_step`` order.

    state = initial_state(config, params)
    state, metrics = train_step(state, x, target, lr, coefficient, config=..., optimizer=..., sae=True)

The state (a pytree, what a checkpoint holds): the weights, Adam's moments, the steps taken, each
latent's steps since it last fired (float32, as SAELens counts them) and BatchTopK's running
threshold. In a step: a JumpReLU's thresholds clamped at 0; the dead latents (not fired in more
than ``dead_feature_window`` steps, counted before this batch); the losses and their gradients;
the firing counts and the threshold updated from this batch; the gradients clipped; Adam.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from dictionaries.config import BATCH_TOP_K, DictionaryConfig, OptimizerConfig
from dictionaries.optimizer import adam, clipped
from dictionaries.sae import Params, training_losses

State = dict[str, Any]


def initial_state(params: Params) -> State:
    d_sae = params["b_enc"].shape[0]
    moments = {which: {name: jnp.zeros_like(p) for name, p in params.items()} for which in ("m", "v")}
    return {"params": params, "moments": moments, "step": jnp.zeros((), jnp.int32),
            "since_fired": jnp.zeros(d_sae, jnp.float32), "topk_threshold": jnp.zeros((), params["b_enc"].dtype)}


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "sae"), donate_argnames=("state",))
def train_step(state: State, x: jax.Array, target: jax.Array, lr: jax.Array, coefficient: jax.Array, *,
               config: DictionaryConfig, optimizer: OptimizerConfig, sae: bool) -> tuple[State, dict[str, jax.Array]]:
    """One step on ``x`` [batch, d_in] reconstructing ``target`` [batch, d_out]: the new state and
    the step's metrics (the loss, each loss term, L0, explained variance, computed before the
    update; the latents dead after it)."""
    params = state["params"]
    if "threshold" in params:  # SAELens clamps before each forward pass, not after the update
        params = {**params, "threshold": jnp.maximum(params["threshold"], 0)}
    dead = state["since_fired"] > optimizer.dead_feature_window
    loss_of = functools.partial(training_losses, config)
    (loss, found), grads = jax.value_and_grad(loss_of, has_aux=True)(params, x, target, sae, coefficient, dead)
    acts, out = found["acts"], found["out"]
    fired = jnp.any(acts != 0, axis=0)
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
    return new_state, {"loss": loss, **found["losses"], **batch_metrics(target, out, acts), "dead": dead}


def batch_metrics(target: jax.Array, out: jax.Array, acts: jax.Array) -> dict[str, jax.Array]:
    """SAELens's per-batch log: explained variance (1 - mean squared error / mean variance about
    the batch's mean, each summed over dimensions) and L0 (latents firing per token)."""
    error = jnp.sum((out - target) ** 2, axis=-1)
    variance = jnp.sum((target - target.mean(0)) ** 2, axis=-1)
    return {"explained_variance": 1 - error.mean() / variance.mean(), "l0": jnp.sum(acts != 0, axis=-1).mean()}
