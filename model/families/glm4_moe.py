"""GLM-4.5, 4.6 and 4.7 (``Glm4MoeForCausalLM``, model_type ``glm4_moe``), as transformers'
``Glm4MoeModel`` computes them: grouped-query attention with q/k/v biases (``attention_bias``; o
without), q/k RMSNorms per head where ``use_qk_norm``, RoPE on the first ``partial_rotary_factor``
(default 0.5) of each head; DeepSeek-V3's mixture of experts and router
(``model.families.deepseek_v3``: sigmoid scores, ``e_score_correction_bias`` to choose,
groups, ``routed_scaling_factor``, shared experts) from ``first_k_dense_replace`` on; block-FP8
checkpoints dequantized at load. The next-token-prediction layer past ``num_hidden_layers`` is
not read."""

from __future__ import annotations

from model import fp8
from model.config import DecoderConfig
from model.families.common import Fields, activation, rope, rope_parameters, rotary_dim, shapes
from model.families.deepseek_v3 import QUANTIZATIONS, grouped_moe

ARCHITECTURES = ("Glm4MoeForCausalLM", "Glm4MoeModel")
__all__ = ["ARCHITECTURES", "QUANTIZATIONS", "decoder_config"]
# transformers' Glm4MoeConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                num_attention_heads=96, num_key_value_heads=8, hidden_act="silu", max_position_embeddings=131072,
                rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, moe_intermediate_size=1408,
                num_experts_per_tok=8, n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0,
                n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False,
                rope_theta=10_000.0)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "glm4_moe")
    config = shapes(f)
    layers = config["num_hidden_layers"]
    moe = grouped_moe(f, range(min(f.number("first_k_dense_replace"), layers)), scoring="sigmoid",
                      selection_bias=True, group_score="top2", normalize_top_k=bool(f.optional("norm_topk_prob")),
                      normalize_epsilon=1e-20)
    params, where = rope_parameters(f)
    return DecoderConfig("glm4_moe", **config, rope=rope(f, params, where, f.number("rope_theta", float), partial=True),
                         rotary_dim=rotary_dim(f, params, where, config["head_dim"], default=0.5),
                         qkv_bias=bool(f.get("attention_bias")), qk_norm=bool(f.get("use_qk_norm")),
                         hidden_act=activation(f, "hidden_act"), moe=moe,
                         weight_block_size=fp8.block_size(f.raw.get("quantization_config"), f.refuse))
