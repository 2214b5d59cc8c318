"""Hugging Face tensor names -> the Flax parameter tree, placed straight onto the mesh.

Every parameter is built with ``jax.make_array_from_callback``: each device receives only its
own slice, read from the memory-mapped checkpoint and cast to the requested dtype, so no device
(and no host buffer) ever holds an extra full copy of a sharded weight.
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from model.checkpoint import Checkpoint
from model.config import Qwen2Config
from model.sharding import param_sharding

LINEAR_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEAR_MLP = ("gate_proj", "up_proj", "down_proj")


def param_names(config: Qwen2Config, num_layers: int, with_head: bool) -> Iterator[tuple[tuple[str, ...], str, bool]]:
    """(Flax path, Hugging Face name, transpose?) of every parameter needed."""
    yield ("embed_tokens", "embedding"), "model.embed_tokens.weight", False
    for i in range(num_layers):
        hf, fx = f"model.layers.{i}", f"layers_{i}"
        for proj in LINEAR_ATTN:
            yield (fx, "self_attn", proj, "kernel"), f"{hf}.self_attn.{proj}.weight", True
            if proj != "o_proj":
                yield (fx, "self_attn", proj, "bias"), f"{hf}.self_attn.{proj}.bias", False
        for proj in LINEAR_MLP:
            yield (fx, "mlp", proj, "kernel"), f"{hf}.mlp.{proj}.weight", True
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield (fx, norm, "weight"), f"{hf}.{norm}.weight", False
    if with_head:
        yield ("norm", "weight"), "model.norm.weight", False
        if not config.tie_word_embeddings:
            yield ("lm_head", "kernel"), "lm_head.weight", True


def _placed(source: np.ndarray, transpose: bool, path: tuple[str, ...], mesh: Mesh,
            dtype: jnp.dtype) -> jax.Array:
    shape = source.shape[::-1] if transpose else source.shape
    sharding = param_sharding(path, shape, mesh)

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        part = source[index[::-1]].T if transpose else source[index]
        return np.ascontiguousarray(part, dtype=dtype)

    return jax.make_array_from_callback(shape, sharding, shard)


def load_params(checkpoint: Checkpoint, config: Qwen2Config, mesh: Mesh, dtype: Any,
                num_layers: int | None = None, with_head: bool = False) -> dict:
    """The parameter tree for blocks ``0..num_layers-1`` (all by default), sharded over ``mesh``.

    ``with_head`` also loads the final norm and LM head (needed for generation only).
    """
    num_layers = config.num_hidden_layers if num_layers is None else num_layers
    dtype = jnp.dtype(dtype)
    tree: dict = {}
    for path, name, transpose in param_names(config, num_layers, with_head):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _placed(checkpoint.tensor(name), transpose, path, mesh, dtype)
    return tree
