"""Llama 1-3.x (``LlamaForCausalLM``, model_type ``llama``): the switches' defaults, plus
``attention_bias`` (q, k, v and o), ``mlp_bias`` and any of the implemented RoPE types (Llama 3.1
and 3.2 use ``llama3``)."""

from __future__ import annotations

from model.config import DecoderConfig
from model.families.common import Fields, activation, rope, rope_parameters, shapes

ARCHITECTURES = ("LlamaForCausalLM", "LlamaModel")
# transformers' LlamaConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
                tie_word_embeddings=False, attention_bias=False, mlp_bias=False, rope_theta=10_000.0)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "llama")
    params, where = rope_parameters(f)
    bias = bool(f.get("attention_bias"))
    return DecoderConfig("llama", **shapes(f), rope=rope(f, params, where, f.get("rope_theta")),
                         qkv_bias=bias, o_bias=bias, mlp_bias=bool(f.get("mlp_bias")),
                         hidden_act=activation(f, "hidden_act"))
