"""The device mesh and where each parameter and activation lives on it.

The mesh always has the axes ``("data", "model")``:
  * ``1d``: ``(devices, 1)``: pure data parallelism, parameters replicated;
  * ``2d``: ``(devices / m, m)``: projections split over ``model`` (q/k/v, gate/up by output
    column; o/down by input row; a Gated DeltaNet mixer's likewise, with its convolution's channels
    and its per-head decay parameters), the embedding (and Qwen4-Exp's n-gram tables) by row, a
    mixture of experts' experts by expert (``model.moe``: each device computes its own; their number
    padded to a multiple of ``m``, ``expert_slots``), batches over ``data``. The
    attention projections split by whole heads only: where ``m`` does not divide the heads (a
    model with a single key/value head, say) those heads are replicated.
Over several processes (a multi-host slice) the mesh spans every process's devices, grouped by
process. By default ``m`` divides each process's device count: the ``model`` axis stays within a
host (its collectives on the chip interconnect) and ``data`` spans the hosts. A model too large for
one host's chips (DeepSeek-V3) takes a ``model`` axis of whole hosts instead (``m`` a multiple of
each process's devices): each process then holds only its share of the split weights and reads
only its own experts from the checkpoint (``model.params``), and a row's activations are stored by
the one process holding its first copy (``model.extract.local_blocks``).
A dimension that does not divide evenly stays replicated; XLA inserts the collectives either way,
so the numbers do not depend on the layout.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from common.cli import UserError
from model.config import MESH_TYPES, DecoderConfig

COLUMN_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head", "q_b_proj", "kv_b_proj",
                "in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a", "f_b_proj", "g_b_proj")
ROW_SPLIT = ("o_proj", "down_proj", "out_proj")
# A Gated DeltaNet mixer's parameters by the heads their split axis is made of: key heads (q, k
# and their convolutions' channels) or value heads (the rest); its norm over head_dim is replicated, and
# so are Kimi's low-rank gates' first projections (f_a_proj, g_a_proj).
DELTANET_KEY_HEADS = ("in_proj_q", "in_proj_k", "conv_q", "conv_k")
DELTANET_VALUE_HEADS = ("in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "conv_v", "dt_bias", "A_log",
                        "f_b_proj", "g_b_proj")


def make_mesh(mesh_type: str, config: DecoderConfig, model_axis_size: int | None = None,
              devices: list | None = None) -> Mesh:
    """A ``("data", "model")`` mesh over ``devices`` (default: every process's)."""
    devices = sorted(devices if devices is not None else jax.devices(),
                     key=lambda d: (d.process_index, d.id))
    per_process = len(devices) // len({d.process_index for d in devices})
    if mesh_type not in MESH_TYPES:
        raise UserError(f"unknown --mesh_type {mesh_type!r} (choose from {', '.join(MESH_TYPES)})")
    if mesh_type == "1d":
        model = 1
    else:  # default: keep whole key/value heads on each device; a mixture of experts: over the host
        model = model_axis_size or default_model_axis(config, per_process)
        if per_process % model and (model % per_process or len(devices) % model):
            raise UserError(f"model axis size {model} neither divides the {per_process} devices of each process "
                            f"nor spans whole processes (a multiple of {per_process} dividing all "
                            f"{len(devices)} devices)")
    return Mesh(np.array(devices).reshape(len(devices) // model, model), ("data", "model"))


def default_model_axis(config: DecoderConfig, devices: int) -> int:
    """A 2d mesh's model axis on hosts of ``devices`` each: gcd(devices, kv heads), so that each
    device holds whole kv heads; for a mixture of experts, every device of the host, since its
    experts are most of its weights (Qwen3-30B-A3B's 58 GB in bfloat16 take 7.3 GB per chip of a
    v5e-8 over 8, 14.5 GB over its 4 kv heads' axis) and kv heads the axis does not divide are
    replicated (0.2 GB there)."""
    if config.moe is not None:
        return devices
    return math.gcd(devices, *(config.layer_config(i).num_key_value_heads for i in config.attention_layers))


# The attention projections whose split axis is made of whole query (or key/value) heads.
# A latent attention's (q_b_proj, kv_b_proj) are per query head: its low-rank projections are replicated.
QUERY_HEADS, KV_HEADS = ("q_proj", "o_proj", "q_b_proj", "kv_b_proj"), ("k_proj", "v_proj")


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, config: DecoderConfig) -> P:
    """The partition spec of the parameter at ``path`` (e.g. ``layers_0/self_attn/q_proj/kernel``)."""
    model = mesh.shape["model"]
    module, leaf = path[-2], path[-1]
    if module == "experts":  # [expert slots, ...]: whole experts per device
        return P("model", *(None,) * (len(shape) - 1)) if model > 1 and shape[0] % model == 0 else P()
    if path[0].startswith("layers_"):  # its block's shapes (Gemma 4's full blocks have their own)
        config = config.layer_config(int(path[0].removeprefix("layers_")))
    heads = (config.num_attention_heads if module in QUERY_HEADS else
             config.num_key_value_heads if module in KV_HEADS else None)
    if module == "linear_attn":  # a DeltaNet mixer's own parameters: [channels, 1, taps] or [heads]
        module = leaf
    if config.deltanet is not None and module in DELTANET_KEY_HEADS + DELTANET_VALUE_HEADS:
        heads = config.deltanet.num_key_heads if module in DELTANET_KEY_HEADS else config.deltanet.num_value_heads
    split = lambda dim: model > 1 and shape[dim] % model == 0 and (heads is None or heads % model == 0)
    if module in ("conv_q", "conv_k", "conv_v", "dt_bias", "A_log") and split(0):
        return P("model", *(None,) * (len(shape) - 1))
    if module in COLUMN_SPLIT and leaf == "kernel" and split(1):
        return P(None, "model")
    if module in COLUMN_SPLIT and leaf == "bias" and split(0):
        return P("model")
    if module in ROW_SPLIT and leaf == "kernel" and split(0):
        return P("model", None)
    if (module in ("embed_tokens", "embed_tokens_per_layer") or leaf == "ngram_embedding") and split(0):
        return P("model", None)  # tables by row (Qwen4-Exp's n-gram tables: tens of billions of values a block)
    return P()


def expert_slots(config: DecoderConfig, mesh: Mesh) -> int:
    """The experts' stacked weights' first dimension on ``mesh``: the experts, padded with
    all-zero ones (no token is routed to) to a multiple of the model axis, so that every device
    holds as many whole experts (5 experts on a model axis of 2 or 8: 6 or 8 slots)."""
    model, experts = mesh.shape["model"], config.moe.num_experts
    return -(-experts // model) * model


def param_sharding(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh,
                   config: DecoderConfig) -> NamedSharding:
    return NamedSharding(mesh, param_spec(path, shape, mesh, config))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Inputs [B, ...]: rows split over ``data``."""
    return NamedSharding(mesh, P("data"))
