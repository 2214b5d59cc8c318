"""Where a dictionary's training lives on the devices: a ``("data", "model")`` mesh over every
process's devices, the latents split over ``model`` and each batch's tokens over ``data``.

Latent-parallel: the encoder's columns (``W_enc [d_in, d_sae]``), the decoder's rows (``W_dec
[d_sae, d_out]``; a CLT's ``[d_sae, layers, d_out]``), the latent biases and thresholds, their Adam
moments and the firing counts are split over ``model``, so a dictionary of a million latents on a
7B's width fits across chips; the input and output biases and ``W_skip`` are replicated. XLA
inserts the collectives (the decoder's sum over latents, a top-k's over the split axis) in the one
compiled step, so the numbers do not depend on the layout.

Data-parallel: the devices are ordered by process and ``model`` stays within a process where it
divides its devices, so ``data`` spans the processes; each process reads its own part of the
epoch (``dictionaries.job``) and contributes its rows of the global batch.

``check_fit`` refuses, before anything is allocated, a dictionary whose weights, Adam's moments
and one step's latent activations exceed a device's memory.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from common.cli import UserError
from dictionaries.training import State

# Per step, beside the weights: a [batch, d_sae] array's copies taken to be alive at once
# (pre-activations, activations, their gradients, a top-k's ranking): an estimate, not measured.
STEP_COPIES = 6


def training_mesh(model_axis: int, devices: int | None = None) -> Mesh:
    """Every process's devices (or the first ``devices``), grouped by process, as
    ``(devices / model_axis, model_axis)``."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))[:devices]
    if model_axis < 1 or len(devices) % model_axis:
        raise UserError(f"--model_axis {model_axis} does not divide the {len(devices)} devices")
    return Mesh(np.array(devices).reshape(len(devices) // model_axis, model_axis), ("data", "model"))


def check_split(mesh: Mesh, d_sae: int, batch_tokens: int) -> None:
    """The latents split evenly over ``model`` and a batch's tokens over ``data``, or one line."""
    model, data = mesh.shape["model"], mesh.shape["data"]
    if d_sae % model:
        raise UserError(f"--d_sae {d_sae} does not split over --model_axis {model} devices: choose a multiple of "
                        f"{model}")
    if batch_tokens % data:
        raise UserError(f"--batch_tokens {batch_tokens} does not split over the mesh's {data} data devices: choose "
                        f"a multiple of {data}")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def param_spec(name: str, ndim: int) -> P:
    """A weight's split (by its name: ``W_enc``, ``W_dec_3``, ...): the latent axis over ``model``."""
    base = re.sub(r"_\d+$", "", name)  # a CLT's layer l
    if base == "W_enc":
        return P(None, "model")
    if base == "W_dec":
        return P("model", *(None,) * (ndim - 1))
    if base in ("b_enc", "threshold"):
        return P("model")
    return P()  # b_dec, W_skip


def state_shardings(mesh: Mesh, state: State) -> State:
    """The state's shardings: the weights and Adam's moments by ``param_spec``, the firing counts
    over ``model`` by latent, the step and BatchTopK's threshold replicated."""
    params = {name: NamedSharding(mesh, param_spec(name, p.ndim)) for name, p in state["params"].items()}
    since = state["since_fired"]
    return {"params": params, "moments": {which: dict(params) for which in state["moments"]},
            "step": NamedSharding(mesh, P()), "topk_threshold": NamedSharding(mesh, P()),
            "since_fired": NamedSharding(mesh, P(*(None,) * (since.ndim - 1), "model"))}


def placed(state: State, shardings: State) -> State:
    """The state (host or device arrays, the same on every process) on the mesh."""
    return jax.tree.map(lambda value, sharding: jax.make_array_from_callback(
        np.shape(value), sharding, lambda index: np.asarray(value)[index]), state, shardings)


def global_batch(mesh: Mesh, local: np.ndarray, dtype) -> jax.Array:
    """[batch, width]: the processes' rows ``local`` [batch / processes, width], in process order,
    split over ``data``."""
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P("data", None)),
                                                  np.asarray(local, dtype))


def host_state(state: State) -> State:
    """The state as numpy arrays on every process (gathered where split across processes)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, state)
    from jax.experimental import multihost_utils
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(state, tiled=True))


def device_bytes(mesh: Mesh, shape: State, d_sae: int, layers: int, batch_tokens: int) -> int:
    """A device's share of the state (``shape``: its shapes) and of one step's ``[batch, d_sae]``
    arrays (``STEP_COPIES`` of them a layer)."""
    model, data = mesh.shape["model"], mesh.shape["data"]
    itemsize = jnp.dtype(shape["params"][next(iter(shape["params"]))].dtype).itemsize
    step = STEP_COPIES * layers * (batch_tokens // data) * (d_sae // model) * itemsize
    return state_bytes(shape) // model + step


def device_memory() -> int:
    """A device's memory in bytes: the runtime's limit, or on the CPU the machine's memory shared by its devices."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // jax.local_device_count()


def check_fit(needed: int, available: int, what: str, model_axis: int) -> None:
    """One line where a device's share ``needed`` exceeds ``available`` bytes."""
    if needed > available:
        raise UserError(f"{what} needs {needed / 1e9:.2f} GB a device with --model_axis {model_axis} (weights, "
                        f"Adam's moments and a step's latents), more than a device's {available / 1e9:.2f} GB: split "
                        "the latents over more devices (--model_axis), or lower --d_sae or --batch_tokens")


def state_bytes(shape: State) -> int:
    """The state's bytes (weights, Adam's moments, counts), from its shapes (``jax.eval_shape``)."""
    return sum(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(shape))
