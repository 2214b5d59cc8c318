"""Mistral 4 (``Mistral4ForCausalLM``, model_type ``mistral4``), as transformers' ``Mistral4Model``
computes it: DeepSeek-V3's latent attention (``model.families.deepseek_v3.latent_decoder``: the
query through ``q_lora_rank``, a compressed latent, YaRN with ``mscale_all_dim`` on the softmax
scale, ``rope_interleave``) with Llama 4's query temperature (``llama_4_scaling_beta`` in the RoPE
parameters: a query past ``original_max_position_embeddings`` positions scaled by
1 + beta * log(1 + floor(p / P))), and DeepSeek-V2's router in every block from
``first_k_dense_replace`` on: softmax scores of the logits in the compute dtype, the
``num_experts_per_tok`` chosen within the ``topk_group`` best of ``n_group`` groups (a group's
score: the sum of its two best), renormalised (+ 1e-20) and times ``routed_scaling_factor``;
``n_shared_experts`` ungated. The experts' tensors are transformers 5's stacked ones."""

from __future__ import annotations

from model.config import DecoderConfig, QueryTemperature
from model.families.common import Fields, rope_parameters
from model.families.deepseek_v3 import grouped_moe, latent_decoder

ARCHITECTURES = ("Mistral4ForCausalLM", "Mistral4Model")
__all__ = ["ARCHITECTURES", "decoder_config"]
# transformers' Mistral4Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=131072, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=32, n_shared_experts=1,
                n_routed_experts=128, routed_scaling_factor=1.0, kv_lora_rank=256, q_lora_rank=1024,
                qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=64, n_group=1, topk_group=1,
                num_experts_per_tok=4, first_k_dense_replace=0, norm_topk_prob=True, hidden_act="silu",
                max_position_embeddings=1048576, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True,
                attention_bias=False, rope_theta=10_000.0)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "mistral4")
    layers = f.number("num_hidden_layers")
    moe = grouped_moe(f, range(min(f.number("first_k_dense_replace"), layers)), scoring="softmax",
                      group_score="top2", normalize_top_k=bool(f.optional("norm_topk_prob")), normalize_epsilon=1e-20,
                      router_in_float32=False)
    params, where = rope_parameters(f)
    beta = params.get("llama_4_scaling_beta")
    temperature = None
    if beta:
        span = params.get("original_max_position_embeddings")
        if not isinstance(span, int) or span < 1:
            raise f.refuse(f"{where}.original_max_position_embeddings", span, "the query temperature's span of "
                           "positions must be a positive integer")
        temperature = QueryTemperature(float(beta), span)
    return latent_decoder(f, moe, interleave=bool(f.optional("rope_interleave")), rope_in_float32=False,
                          partial_rope=True, query_temperature=temperature)
