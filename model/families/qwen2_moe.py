"""Qwen1.5-MoE and Qwen2-MoE (``Qwen2MoeForCausalLM``, model_type ``qwen2_moe``): Qwen2's attention
(q, k, v biases: ``qkv_bias``) with a mixture of experts in place of the MLP, as Qwen3-MoE's
(``model.families.qwen3_moe``), plus a shared expert: a SwiGLU MLP of
``shared_expert_intermediate_size`` every token goes through, scaled by
sigmoid(``shared_expert_gate``(x)) and added to the routed experts' sum."""

from __future__ import annotations

from model.config import DecoderConfig
from model.families.common import Fields, mixture_of_experts, qwen_dense_layers
from model.families.qwen2 import qwen_config

ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen2MoeModel")
# transformers' Qwen2MoeConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                num_attention_heads=16, num_key_value_heads=16, hidden_act="silu", max_position_embeddings=32768,
                rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10_000.0, qkv_bias=True,
                decoder_sparse_step=1, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                num_experts_per_tok=4, num_experts=60, norm_topk_prob=False)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "qwen2_moe")
    layers = f.number("num_hidden_layers")
    moe = mixture_of_experts(f, "moe_intermediate_size", dense_layers=qwen_dense_layers(f, layers),
                             shared_expert_size=f.number("shared_expert_intermediate_size") or None)
    return qwen_config(f, qkv_bias=bool(f.get("qkv_bias")), moe=moe)
