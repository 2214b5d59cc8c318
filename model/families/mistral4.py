"""Mistral 4 (``Mistral4ForCausalLM``, model_type ``mistral4``), as transformers' ``Mistral4Model``
computes it: DeepSeek-V3's latent attention (``model.families.deepseek_v3.latent_decoder``: the
query through ``q_lora_rank``, a compressed latent, YaRN with ``mscale_all_dim`` on the softmax
scale, ``rope_interleave``) with Llama 4's query temperature (``llama_4_scaling_beta`` in the RoPE
parameters: a query past ``original_max_position_embeddings`` positions scaled by
1 + beta * log(1 + floor(p / P))), and DeepSeek-V2's router in every block from
``first_k_dense_replace`` on: softmax scores of the logits in the compute dtype, the
``num_experts_per_tok`` chosen within the ``topk_group`` best of ``n_group`` groups (a group's
score: the sum of its two best), renormalised (+ 1e-20) and times ``routed_scaling_factor``;
``n_shared_experts`` ungated. The experts' tensors are transformers 5's stacked ones.

Mistral Small 4 as the hub ships it: the text model of ``Mistral3ForConditionalGeneration``
(model_type ``mistral3`` with a ``mistral4`` ``text_config``; its tensors under
``language_model.model.`` and ``language_model.lm_head``, or ``model.language_model.`` and
``lm_head`` as transformers 5 saves them; the vision tower and projector are not read), FP8 with
per-tensor scales (``quantization_config`` ``fp8``, ``weight_block_size`` null, ``activation_scheme``
static): dequantized at load (``model.fp8``; the static activation scales are not read, as
transformers' ``dequantize=True`` model does not apply them)."""

from __future__ import annotations

from model.config import DecoderConfig, QueryTemperature
from model.families.common import Fields, rope_parameters, wrapped_text_config
from model.families.deepseek_v3 import grouped_moe, latent_decoder

ARCHITECTURES = ("Mistral4ForCausalLM", "Mistral4Model")
WRAPPER_ARCHITECTURES = ("Mistral3ForConditionalGeneration",)
QUANTIZATIONS = ("fp8",)  # quantization_config methods read (block or per-tensor FP8: model.fp8)
__all__ = ["ARCHITECTURES", "WRAPPER_ARCHITECTURES", "QUANTIZATIONS", "decoder_config"]
# transformers' Mistral4Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=131072, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=32, n_shared_experts=1,
                n_routed_experts=128, routed_scaling_factor=1.0, kv_lora_rank=256, q_lora_rank=1024,
                qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=64, n_group=1, topk_group=1,
                num_experts_per_tok=4, first_k_dense_replace=0, norm_topk_prob=True, hidden_act="silu",
                max_position_embeddings=1048576, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True,
                attention_bias=False, rope_theta=10_000.0)


def decoder_config(raw: dict) -> DecoderConfig:
    if raw.get("model_type") == "mistral3":  # the multimodal wrapper: its text model only
        raw = text_config(raw)
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
                          partial_rope=True, per_tensor_fp8=True, query_temperature=temperature)


def text_config(raw: dict) -> dict:
    """The text model's config of a ``Mistral3ForConditionalGeneration`` (its ``text_config``, the
    head tied as the wrapper says, by default tied as transformers' ``Mistral3Config``; with the
    wrapper's ``quantization_config``: ``wrapped_text_config``); refused in one line unless it is
    Mistral 4's."""
    text = raw.get("text_config")
    kind = text.get("model_type") if isinstance(text, dict) else None
    if isinstance(text, dict) and kind != "mistral4":
        raise Fields(raw, {}, "mistral3").refuse("text_config.model_type", kind, "the text model read inside "
                                                 "Mistral3ForConditionalGeneration is Mistral 4's (mistral4)")
    return wrapped_text_config(raw, "mistral3")
