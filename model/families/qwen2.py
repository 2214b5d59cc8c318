"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``, model_type ``qwen2``): Llama's block with biases on
the q, k and v projections. Sliding-window attention (``use_sliding_window``) is refused."""

from __future__ import annotations

from typing import Any

from model.config import FULL, SLIDING, DecoderConfig
from model.families.common import Fields, activation, layer_types, refuse_if_set, rope, rope_parameters, shapes

ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen2Model")
# transformers' Qwen2Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768,
                rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10_000.0)


def decoder_config(raw: dict) -> DecoderConfig:
    return qwen_config(Fields(raw, DEFAULTS, "qwen2"), qkv_bias=True)


def qwen_config(f: Fields, **switches: Any) -> DecoderConfig:
    """Qwen2's reading, shared with Qwen3 (``model.families.qwen3``), which adds its ``switches``."""
    refuse_if_set(f, "use_sliding_window", "sliding-window attention is not implemented for Qwen")
    if SLIDING in (f.raw.get("layer_types") or ()):
        raise f.refuse("layer_types", SLIDING, "sliding-window attention is not implemented for Qwen")
    config = shapes(f)
    # transformers 5 writes every layer's type (all full without use_sliding_window): checked
    # for unknown types and its length; the model has none of them sliding.
    layer_types(f, config["num_hidden_layers"], [FULL] * config["num_hidden_layers"], None)
    params, where = rope_parameters(f)
    return DecoderConfig(f.family, **config, rope=rope(f, params, where, f.get("rope_theta")),
                         hidden_act=activation(f, "hidden_act"), **switches)
