"""Mixtral (``MixtralForCausalLM``, model_type ``mixtral``: Mixtral 8x7B, 8x22B): Mistral's block
with a mixture of experts in every block (``block_sparse_moe``): ``num_local_experts`` SwiGLU
experts of ``intermediate_size``, ``num_experts_per_tok`` per token, their weights always
renormalised over the k and kept in float32 as they scale the experts' outputs;
``sliding_window`` on every layer where set (null in the released configs)."""

from __future__ import annotations

from model.config import SLIDING, DecoderConfig
from model.families.common import Fields, activation, mixture_of_experts, rope, rope_parameters, shapes, sliding_window

ARCHITECTURES = ("MixtralForCausalLM", "MixtralModel")
# transformers' MixtralConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", max_position_embeddings=4096 * 32,
                rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=1_000_000.0, num_experts_per_tok=2,
                num_local_experts=8)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "mixtral")
    config = shapes(f)
    window = sliding_window(f)
    params, where = rope_parameters(f)
    return DecoderConfig("mixtral", **config, rope=rope(f, params, where, f.get("rope_theta")),
                         sliding_window=window, layer_types=(SLIDING,) * config["num_hidden_layers"] if window else (),
                         hidden_act=activation(f, "hidden_act"),
                         moe=mixture_of_experts(f, "intermediate_size", normalize_top_k=True, weights_in_float32=True))
