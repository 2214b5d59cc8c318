"""Qwen3-MoE (``Qwen3MoeForCausalLM``, model_type ``qwen3_moe``: Qwen3-30B-A3B, Qwen3-235B-A22B):
Qwen3's attention (q/k RMSNorm per head, no biases) with a mixture of experts in place of the
MLP: ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per
token, renormalised where ``norm_topk_prob``; blocks in ``mlp_only_layers``, or off the
``decoder_sparse_step``, keep a dense MLP of ``intermediate_size``."""

from __future__ import annotations

from model.config import DecoderConfig
from model.families.common import Fields, mixture_of_experts, qwen_dense_layers
from model.families.qwen2 import qwen_config

ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen3MoeModel")
# transformers' Qwen3MoeConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                num_attention_heads=32, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768,
                rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, rope_theta=10_000.0,
                decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128,
                norm_topk_prob=False)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "qwen3_moe")
    bias = bool(f.get("attention_bias"))
    layers = f.number("num_hidden_layers")
    moe = mixture_of_experts(f, "moe_intermediate_size", dense_layers=qwen_dense_layers(f, layers))
    return qwen_config(f, qkv_bias=bias, o_bias=bias, qk_norm=True, moe=moe)
