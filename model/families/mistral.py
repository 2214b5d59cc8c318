"""Mistral (``MistralForCausalLM``, model_type ``mistral``): Llama's block without biases, with
``sliding_window`` on every layer when it is set (Mistral 7B v0.1: 4096; later versions: null)."""

from __future__ import annotations

from model.config import SLIDING, DecoderConfig
from model.families.common import Fields, activation, rope, rope_parameters, shapes, sliding_window

ARCHITECTURES = ("MistralForCausalLM", "MistralModel")
# transformers' MistralConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, tie_word_embeddings=False,
                sliding_window=4096, rope_theta=10_000.0)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "mistral")
    if raw.get("layer_types") is not None:
        # transformers' Mistral ignores them; alternating windows are Ministral's (not implemented).
        raise f.refuse("layer_types", raw["layer_types"][:2] + ["..."], "Mistral has its window on every "
                       "layer; per-layer types are Ministral's (model_type ministral)")
    config = shapes(f)
    window = sliding_window(f)
    params, where = rope_parameters(f)
    return DecoderConfig("mistral", **config, rope=rope(f, params, where, f.get("rope_theta")),
                         sliding_window=window, layer_types=(SLIDING,) * config["num_hidden_layers"] if window else (),
                         hidden_act=activation(f, "hidden_act"))
