"""Hugging Face tensor names -> the Flax parameter tree, placed straight onto the mesh.

Every parameter is built with ``jax.make_array_from_callback``: each device receives only its
own slice, read from the checkpoint and cast to the requested dtype, so no device (and no host
buffer) ever holds an extra full copy of a sharded weight.

Names: every family keeps Hugging Face's ``model.layers.N.self_attn.q_proj`` / ``mlp.gate_proj``
layout; the block's norms differ in meaning (``post_attention_layernorm`` is the MLP's input
norm in Llama-like blocks, the attention output's norm in Gemma's sandwich blocks), and the text
model's prefix differs by checkpoint layout (``model.``; ``model.language_model.`` or
``language_model.model.`` inside a Gemma 3 multimodal checkpoint; none for a bare ``*Model``).
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from common.cli import UserError
from model.checkpoint import Checkpoint
from model.config import DecoderConfig
from model.sharding import param_sharding

LINEAR_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEAR_MLP = ("gate_proj", "up_proj", "down_proj")
# Where the text model's tensors live, by checkpoint layout; the LM head beside each.
TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")
HEAD_NAMES = {"model.": "lm_head.weight", "model.language_model.": "lm_head.weight",
              "language_model.model.": "language_model.lm_head.weight", "": "lm_head.weight"}
# The block's norms (model.decoder.BLOCK_NORMS) by their Hugging Face names.
NORM_NAMES = {"pre_attention_norm": "input_layernorm", "pre_mlp_norm": "post_attention_layernorm"}
SANDWICH_NORM_NAMES = {"pre_attention_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                       "pre_mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}

# What each activation site (``model.sites``) equals in transformers' modules of block L
# (``model.layers.L``): (module below the block, "" for the block itself; which side of it).
# ``input`` / ``output`` are a forward hook's (the first positional input; the first output);
# ``normalized input`` is that module's input x as x / sqrt(mean(x^2) + eps), in float32.
def hf_site(site: str, sandwich_norms: bool) -> tuple[str, str]:
    """Where ``site`` is seen in a Hugging Face block of a model with (``sandwich_norms``: Gemma
    2, 3) or without norms on the sublayer outputs."""
    from model import sites
    norms = SANDWICH_NORM_NAMES if sandwich_norms else NORM_NAMES
    return {
        sites.RESID_PRE: ("", "input"),
        sites.ATTN_Z: ("self_attn.o_proj", "input"),
        sites.ATTN_OUT: (norms["post_attention_norm"], "output") if sandwich_norms else ("self_attn", "output"),
        sites.RESID_MID: (norms["pre_mlp_norm"], "input"),
        sites.LN2_NORMALIZED: (norms["pre_mlp_norm"], "normalized input"),
        sites.MLP_IN: ("mlp", "input"),
        sites.MLP_POST: ("mlp.down_proj", "input"),
        sites.MLP_OUT: (norms["post_mlp_norm"], "output") if sandwich_norms else ("mlp", "output"),
        sites.RESID_POST: ("", "output"),
    }[site]


def text_prefix(checkpoint: Checkpoint) -> str:
    """The prefix of the text model's tensors in this checkpoint."""
    for prefix in TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in checkpoint:
            return prefix
    raise UserError(f"checkpoint {checkpoint.model_dir!r} has no embedding (model.embed_tokens.weight "
                    f"or another layout's)")


def param_names(config: DecoderConfig, num_layers: int, with_head: bool,
                prefix: str = "model.") -> Iterator[tuple[tuple[str, ...], str, bool]]:
    """(Flax path, Hugging Face name, transpose?) of every parameter needed."""
    yield ("embed_tokens", "embedding"), f"{prefix}embed_tokens.weight", False
    norms = SANDWICH_NORM_NAMES if config.sandwich_norms else NORM_NAMES
    for i in range(num_layers):
        hf, fx = f"{prefix}layers.{i}", f"layers_{i}"
        for proj in LINEAR_ATTN:
            yield (fx, "self_attn", proj, "kernel"), f"{hf}.self_attn.{proj}.weight", True
            if config.o_bias if proj == "o_proj" else config.qkv_bias:
                yield (fx, "self_attn", proj, "bias"), f"{hf}.self_attn.{proj}.bias", False
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                yield (fx, "self_attn", norm, "weight"), f"{hf}.self_attn.{norm}.weight", False
        for proj in LINEAR_MLP:
            yield (fx, "mlp", proj, "kernel"), f"{hf}.mlp.{proj}.weight", True
            if config.mlp_bias:
                yield (fx, "mlp", proj, "bias"), f"{hf}.mlp.{proj}.bias", False
        for ours, theirs in norms.items():
            yield (fx, ours, "weight"), f"{hf}.{theirs}.weight", False
    if with_head:
        yield ("norm", "weight"), f"{prefix}norm.weight", False
        if not config.tie_word_embeddings:
            yield ("lm_head", "kernel"), HEAD_NAMES[prefix], True


def expected_shape(path: tuple[str, ...], config: DecoderConfig) -> tuple[int, ...]:
    """The shape ``config`` gives the parameter at ``path`` (kernels as Flax has them: [in, out])."""
    c = config
    h, f, d = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    module, leaf = path[-2], path[-1]
    kernels = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, f),
               "up_proj": (h, f), "down_proj": (f, h), "lm_head": (h, c.vocab_size), "embed_tokens": (c.vocab_size, h)}
    if leaf in ("kernel", "embedding"):
        return kernels[module]
    if leaf == "bias":
        return kernels[module][1:]
    return (d,) if module in ("q_norm", "k_norm") else (h,)


def _placed(source: np.ndarray, transpose: bool, path: tuple[str, ...], mesh: Mesh,
            dtype: jnp.dtype, config: DecoderConfig) -> jax.Array:
    shape = source.shape[::-1] if transpose else source.shape
    sharding = param_sharding(path, shape, mesh, config)

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        part = source[index[::-1]].T if transpose else source[index]
        return np.ascontiguousarray(part, dtype=dtype)

    return jax.make_array_from_callback(shape, sharding, shard)


def load_params(checkpoint: Checkpoint, config: DecoderConfig, mesh: Mesh, dtype: Any,
                num_layers: int | None = None, with_head: bool = False) -> dict:
    """The parameter tree for blocks ``0..num_layers-1`` (all by default), sharded over ``mesh``.

    ``with_head`` also loads the final norm and LM head (needed for generation only).
    """
    num_layers = config.num_hidden_layers if num_layers is None else num_layers
    dtype = jnp.dtype(dtype)
    tree: dict = {}
    for path, name, transpose in param_names(config, num_layers, with_head, text_prefix(checkpoint)):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        source = checkpoint.tensor(name)
        shape = source.shape[::-1] if transpose else source.shape
        if tuple(shape) != expected_shape(path, config):
            raise UserError(f"checkpoint tensor {name!r} has shape {list(source.shape)}, which config.json's "
                            f"sizes do not give ({list(expected_shape(path, config)[::-1 if transpose else 1])})")
        node[path[-1]] = _placed(source, transpose, path, mesh, dtype, config)
    return tree
