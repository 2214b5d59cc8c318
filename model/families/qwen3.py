"""Qwen3 dense models (``Qwen3ForCausalLM``, model_type ``qwen3``): Qwen2's reading, without the
q/k/v biases (``attention_bias``, default off, on all four projections) and with RMSNorm over
head_dim on q and k before RoPE."""

from __future__ import annotations

from model.config import DecoderConfig
from model.families.common import Fields
from model.families.qwen2 import qwen_config

ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3Model")
# transformers' Qwen3Config defaults, for keys a config.json may leave out (head_dim is 128, not
# hidden_size / num_attention_heads).
DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                attention_bias=False, rope_theta=10_000.0)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "qwen3")
    bias = bool(f.get("attention_bias"))
    return qwen_config(f, qkv_bias=bias, o_bias=bias, qk_norm=True)
