"""OLMoE (``OlmoeForCausalLM``, model_type ``olmoe``): Llama's pre-norm block with RMSNorm on q and
k over the whole projection (all heads at once) before RoPE, q, k and v then clamped to
[-clip_qkv, clip_qkv] where set, and a mixture of experts in every block: ``num_experts`` SwiGLU
experts of ``intermediate_size``, ``num_experts_per_tok`` per token, renormalised where
``norm_topk_prob``."""

from __future__ import annotations

from model.config import DecoderConfig
from model.families.common import Fields, activation, mixture_of_experts, rope, rope_parameters, shapes

ARCHITECTURES = ("OlmoeForCausalLM", "OlmoeModel")
# transformers' OlmoeConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=50304, hidden_size=2048, intermediate_size=2048, num_hidden_layers=16,
                num_attention_heads=16, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
                tie_word_embeddings=False, attention_bias=False, rope_theta=10_000.0, num_experts_per_tok=8,
                num_experts=64, norm_topk_prob=False)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "olmoe")
    params, where = rope_parameters(f)
    bias = bool(f.get("attention_bias"))
    clip = f.get("clip_qkv")
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
        raise f.refuse("clip_qkv", clip, "it must be a positive number or null")
    return DecoderConfig("olmoe", **shapes(f), rope=rope(f, params, where, f.get("rope_theta")),
                         qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_scope="projection",
                         clip_qkv=None if clip is None else float(clip), hidden_act=activation(f, "hidden_act"),
                         moe=mixture_of_experts(f, "intermediate_size"))
