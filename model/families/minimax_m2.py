"""MiniMax-M2 (``MiniMaxM2ForCausalLM``, model_type ``minimax_m2``: MiniMax-M2, M2.1, M2.5, M2.7), as
transformers' ``MiniMaxM2Model`` computes it: grouped-query attention with q/k RMSNorms over the
whole projection (as OLMo 2's), RoPE on each head's first ``rotary_dim`` dims (the hub's key;
transformers 5's ``partial_rotary_factor``), and a mixture of experts in every block under
Mixtral's tensor names (``block_sparse_moe``, experts' w1/w3/w2): a sigmoid router whose
``e_score_correction_bias`` chooses the ``num_experts_per_tok`` experts and whose chosen scores,
renormalised, weight them in float32 (DeepSeek-V3's router with one group and no scaling:
``model.moe.route_grouped``). transformers norms q and k whatever ``use_qk_norm`` says; so do we.

The hub's checkpoints are block-FP8 (``quantization_config`` ``fp8``, fmt ``float8_e4m3fn``,
``weight_block_size`` [128, 128]): the attention's projections and every expert's w1/w2/w3 as
float8 e4m3 with float32 ``weight_scale_inv``, dequantized at load (``model.fp8``); the norms, the
router's gate and choice bias, the embedding and the LM head are unquantized (its
``modules_to_not_convert``: they have no scales, so they are read as they are)."""

from __future__ import annotations

from model import fp8
from model.config import DecoderConfig
from model.families.common import Fields, activation, mixture_of_experts, rope, rope_parameters, rotary_dim, shapes

ARCHITECTURES = ("MiniMaxM2ForCausalLM", "MiniMaxM2Model")
QUANTIZATIONS = ("fp8",)  # quantization_config methods read (block-FP8: model.fp8)
__all__ = ["ARCHITECTURES", "QUANTIZATIONS", "decoder_config"]
# transformers' MiniMaxM2Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62,
                num_attention_heads=48, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                max_position_embeddings=196608, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts_per_tok=8,
                num_local_experts=256, rope_theta=5_000_000.0)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "minimax_m2")
    config = shapes(f)
    params, where = rope_parameters(f)
    if raw.get("rotary_dim") is not None and "partial_rotary_factor" not in params:  # the hub's key
        params, where = {**params, "partial_rotary_factor": f.number("rotary_dim") / config["head_dim"]}, "rotary_dim"
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise f.refuse("scoring_func", raw["scoring_func"], "transformers' router scores by a sigmoid")
    moe = mixture_of_experts(f, "intermediate_size", normalize_top_k=True, weights_in_float32=True, groups=1,
                             scoring="sigmoid", selection_bias=True)
    return DecoderConfig("minimax_m2", **config, rope=rope(f, params, where, f.number("rope_theta", float),
                                                            partial=True),
                         rotary_dim=rotary_dim(f, params, where, config["head_dim"]), qk_norm=True,
                         qk_norm_scope="projection", hidden_act=activation(f, "hidden_act"), moe=moe,
                         weight_block_size=fp8.block_size(raw.get("quantization_config"), f.refuse))
