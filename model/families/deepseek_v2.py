"""DeepSeek-V2 and V2-Lite, DeepSeek-Coder-V2 (``DeepseekV2ForCausalLM``, model_type
``deepseek_v2``), as transformers' ``DeepseekV2Model`` computes them: V3's latent attention
(``model.families.deepseek_v3``; its rotation a complex product of adjacent pairs in float32,
reordered to rotate-half's layout at load time) and mixture of experts with shared experts and
dense blocks before ``first_k_dense_replace``, but V2's router: softmax scores (float32), the top
``num_experts_per_tok`` of them (``topk_method`` ``greedy``), or within the ``topk_group`` groups of
best maximum (``group_limited_greedy``), times ``routed_scaling_factor``, not renormalised
(transformers reads no ``norm_topk_prob`` for V2)."""

from __future__ import annotations

from model.config import DecoderConfig
from model.families.common import Fields
from model.families.deepseek_v3 import QUANTIZATIONS, grouped_moe, latent_decoder

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV2Model")
__all__ = ["ARCHITECTURES", "QUANTIZATIONS", "decoder_config"]
# transformers' DeepseekV2Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
                tie_word_embeddings=False, attention_bias=False, mlp_bias=False, first_k_dense_replace=0,
                kv_lora_rank=512, q_lora_rank=1536, n_routed_experts=64, n_shared_experts=2, qk_nope_head_dim=128,
                qk_rope_head_dim=64, routed_scaling_factor=1.0, topk_method="greedy", v_head_dim=128,
                moe_intermediate_size=1407, rope_theta=10_000.0)
TOPK_METHODS = ("greedy", "group_limited_greedy")


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "deepseek_v2")
    method = f.get("topk_method")
    if method not in TOPK_METHODS:
        raise f.refuse("topk_method", method, f"transformers' DeepSeek-V2 router has {', '.join(TOPK_METHODS)}")
    if f.get("mlp_bias"):
        raise f.refuse("mlp_bias", True, "DeepSeek-V2's MLPs are read without biases")
    layers = f.number("num_hidden_layers")
    grouped = method == "group_limited_greedy"
    fields = f if grouped else Fields({**raw, "n_group": 1, "topk_group": 1}, DEFAULTS, "deepseek_v2")
    moe = grouped_moe(fields, range(min(f.number("first_k_dense_replace"), layers)), scoring="softmax",
                      group_score="max", normalize_top_k=False)
    return latent_decoder(f, moe, interleave=True, rope_in_float32=True)
