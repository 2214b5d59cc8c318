"""Gemma 2 (``Gemma2ForCausalLM``, model_type ``gemma2``): RMSNorm as x * (1 + w), norms before
and after both sublayers, embeddings x sqrt(hidden_size), tanh-GELU MLP, the query scaled by
``query_pre_attn_scalar``, soft-capped attention and final logits, and a sliding window on every
other layer (0, 2, 4, ... in the hub's layout)."""

from __future__ import annotations

from model.config import FULL, SLIDING, DecoderConfig
from model.families.common import (Fields, activation, layer_types, refuse_if_set, rope, rope_parameters,
                                   shapes, sliding_window)

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma2Model")
# transformers' Gemma2Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                attn_logit_softcapping=50.0, rope_theta=10_000.0)

# What the Gemma families share; Gemma 3 adds q/k norms.
GEMMA_SWITCHES = dict(norm_unit_offset=True, sandwich_norms=True, scale_embeddings=True)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "gemma2")
    config = shapes(f)
    n = config["num_hidden_layers"]
    window = sliding_window(f)
    params, where = rope_parameters(f)
    return DecoderConfig("gemma2", **config, rope=rope(f, params, where, f.get("rope_theta")),
                         **gemma_switches(f), sliding_window=window,
                         layer_types=layer_types(f, n, [SLIDING if i % 2 == 0 else FULL for i in range(n)], window))


def gemma_switches(f: Fields) -> dict:
    """The switches Gemma 2 and 3 read the same way."""
    refuse_if_set(f, "use_bidirectional_attention", "only causal attention is implemented")
    bias = bool(f.get("attention_bias"))
    caps = {key: float(f.optional(key)) if f.optional(key) else None
            for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    return dict(GEMMA_SWITCHES, qkv_bias=bias, o_bias=bias, hidden_act=activation(f, "hidden_activation"),
                query_pre_attn_scalar=f.number("query_pre_attn_scalar", float),
                attn_logit_softcap=caps["attn_logit_softcapping"], final_logit_softcap=caps["final_logit_softcapping"])
