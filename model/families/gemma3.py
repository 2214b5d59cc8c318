"""Gemma 3 (``Gemma3ForCausalLM``, model_type ``gemma3_text``: 270M and 1B), and the text model
inside ``Gemma3ForConditionalGeneration`` (model_type ``gemma3`` with a ``text_config``: 4B, 12B
and 27B ship only that way; the vision tower is not loaded).

Gemma 2's switches (``model.families.gemma2``) plus RMSNorm over head_dim on q and k, five local
(sliding) layers to one global in the hub's layout (``sliding_window_pattern``), and RoPE per
layer type: local layers use ``rope_local_base_freq`` and no scaling, global ones ``rope_theta``
with ``rope_scaling`` (linear, factor 8, on 4B and up)."""

from __future__ import annotations

from model.config import FULL, SLIDING, DecoderConfig
from model.families.common import (Fields, layer_types, rope, rope_parameters, shapes, sliding_window,
                                   wrapped_text_config)
from model.families.gemma2 import gemma_switches

ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3TextModel")
WRAPPER_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
# transformers' Gemma3TextConfig defaults, for keys a config.json may leave out (the text_config
# of a Gemma3ForConditionalGeneration on the hub leaves out most of them).
DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                max_position_embeddings=131_072, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None,
                attn_logit_softcapping=None, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                sliding_window_pattern=6)


def decoder_config(raw: dict) -> DecoderConfig:
    if raw.get("model_type") == "gemma3":  # the multimodal wrapper: its text model only
        raw = wrapped_text_config(raw, "gemma3")
    f = Fields(raw, DEFAULTS, "gemma3")
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and not (FULL in params or SLIDING in params):
        raise f.refuse("rope_parameters", params, f"Gemma 3 gives one per layer type ({FULL}, {SLIDING})")
    config = shapes(f)
    n, pattern = config["num_hidden_layers"], int(f.get("sliding_window_pattern"))
    window = sliding_window(f)
    types = layer_types(f, n, [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)], window)
    full, where = rope_parameters(f, FULL)
    local, local_where = rope_parameters(f, SLIDING)
    if local_where == "rope_scaling":  # the hub's layout: rope_scaling is the global layers' alone
        local, local_where = {}, "rope_local_base_freq"
    return DecoderConfig("gemma3", **config, rope=rope(f, full, where, f.get("rope_theta")),
                         sliding_rope=rope(f, local, local_where, f.get("rope_local_base_freq")),
                         **gemma_switches(f), qk_norm=True, sliding_window=window, layer_types=types)
