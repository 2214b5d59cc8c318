"""Phi-3 (``Phi3ForCausalLM``, model_type ``phi3``: the 4k-context Phi-3-mini and -medium): Llama's
block with the q, k and v projections fused in one ``qkv_proj`` and the gate and up projections
in one ``gate_up_proj`` (split at load time), RoPE on the first ``partial_rotary_factor`` of
each head, and ``sliding_window`` on every layer when it is set. The long-context RoPE
(``longrope``: Phi-3-*-128k, Phi-3.5, Phi-4-mini, the last with a factor of 0.75) is refused."""

from __future__ import annotations

from model.config import SLIDING, DecoderConfig
from model.families.common import Fields, activation, rope, rope_parameters, rotary_dim, shapes, sliding_window

ARCHITECTURES = ("Phi3ForCausalLM", "Phi3Model")
# transformers' Phi3Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                num_attention_heads=32, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
                tie_word_embeddings=False, sliding_window=None, rope_theta=10_000.0)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "phi3")
    config = shapes(f)
    params, where = rope_parameters(f)
    window = sliding_window(f)
    return DecoderConfig("phi3", **config, rope=rope(f, params, where, f.get("rope_theta"), partial=True),
                         rotary_dim=rotary_dim(f, params, where, config["head_dim"]), sliding_window=window,
                         layer_types=(SLIDING,) * config["num_hidden_layers"] if window else (),
                         hidden_act=activation(f, "hidden_act"))
