"""SAELens's optimisation of a dictionary, step by step (``sae_lens/training/sae_trainer.py``,
``optim.py``): the global gradient norm clipped to 1, torch's Adam (eps 1e-8, no weight decay,
every weight in one group), the learning rate and the sparsity coefficient per step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dictionaries.config import OptimizerConfig

ADAM_EPS = 1e-8
MAX_GRAD_NORM = 1.0  # SAELens's trainer clips to this, always


def learning_rate(config: OptimizerConfig, step: int, steps: int) -> float:
    """The rate of 0-based step ``step`` of ``steps``: linear warm-up to ``lr`` (``lr * (t+1) / W``),
    the schedule, then a linear decay over the last ``lr_decay_steps`` (from ``lr``, or from
    ``lr_end`` after a cosine), as SAELens's ``get_lr_scheduler`` chains them."""
    warm, decay, lr = config.lr_warm_up_steps, config.lr_decay_steps, config.lr
    if step < warm:
        return lr * (step + 1) / warm
    if decay and step >= steps - decay:
        start = lr if config.lr_scheduler_name == "constant" else config.final_lr
        return start * (1 - (step - (steps - decay)) / decay)
    if config.lr_scheduler_name == "constant":
        return lr
    middle, t = steps - warm - decay, step - warm
    if config.lr_scheduler_name == "cosineannealingwarmrestarts":
        middle = middle // config.n_restart_cycles
        t = t % middle
    return config.final_lr + (lr - config.final_lr) * (1 + math.cos(math.pi * t / middle)) / 2


def coefficient(final: float, warm_up_steps: int, step: int) -> float:
    """The sparsity coefficient at 0-based ``step``: ``final * step / W`` during the warm-up (0 at
    step 0, SAELens's ``CoefficientScheduler``), then ``final``."""
    return final * min(step, warm_up_steps) / warm_up_steps if warm_up_steps else final


def clipped(grads: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """``torch.nn.utils.clip_grad_norm_(..., 1.0)``: scaled by ``min(1 / (norm + 1e-6), 1)``."""
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in grads.values()))
    factor = jnp.minimum(MAX_GRAD_NORM / (norm + 1e-6), 1.0)
    return {name: (g * factor).astype(g.dtype) for name, g in grads.items()}


def adam(config: OptimizerConfig, params: dict[str, jax.Array], grads: dict[str, jax.Array],
         moments: dict[str, dict[str, jax.Array]], count: jax.Array, lr: jax.Array
         ) -> tuple[dict[str, jax.Array], dict[str, dict[str, jax.Array]]]:
    """One step of torch's Adam (``count``: this step's number, from 1): new weights and moments."""
    b1, b2 = config.adam_beta1, config.adam_beta2
    first = {n: b1 * moments["m"][n] + (1 - b1) * g for n, g in grads.items()}
    second = {n: b2 * moments["v"][n] + (1 - b2) * g * g for n, g in grads.items()}
    step_size = lr / (1 - b1 ** count)
    root = jnp.sqrt(1 - b2 ** count)
    new = {n: (p - step_size * first[n] / (jnp.sqrt(second[n]) / root + ADAM_EPS)).astype(p.dtype)
           for n, p in params.items()}
    return new, {"m": first, "v": second}
