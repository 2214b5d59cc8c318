"""OLMo 2 (``Olmo2ForCausalLM``, model_type ``olmo2``): Llama's block with its norms moved: none on
the sublayers' inputs, RMSNorm on what each adds to the stream (``post_attention_layernorm``,
``post_feedforward_layernorm``), and RMSNorm on q and k over the whole projection (all heads at
once) before RoPE. Its RMSNorm multiplies the weight into the float32 normalised values and
rounds once (Llama's rounds them first), which a bfloat16 forward shows."""

from __future__ import annotations

from typing import Any

from model.config import DecoderConfig
from model.families.common import Fields, activation, rope, rope_parameters, shapes

ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo2Model")
# transformers' Olmo2Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-5,
                tie_word_embeddings=False, attention_bias=False, rope_theta=10_000.0)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "olmo2")
    params, where = rope_parameters(f)
    return DecoderConfig("olmo2", **shapes(f), rope=rope(f, params, where, f.get("rope_theta")), **olmo2_switches(f))


def olmo2_switches(f: Fields) -> dict[str, Any]:
    """OLMo 2's block (OLMo 3's too): norms on what the sublayers add, q/k normed over the whole
    projection, the norm weight applied in float32, biases where ``attention_bias``."""
    bias = bool(f.get("attention_bias"))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_scope="projection", pre_norms=False,
                sandwich_norms=True, norm_weight_in_float32=True, hidden_act=activation(f, "hidden_act"))
