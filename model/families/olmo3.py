"""OLMo 3 (``Olmo3ForCausalLM``, model_type ``olmo3``): OLMo 2's block (``model.families.olmo2``)
with sliding-window attention on three layers of four (``layer_types``; the window 4096 by
default) and RoPE per layer type: transformers 5 writes ``rope_parameters`` for each of
``full_attention`` and ``sliding_attention``; in the hub's layout ``rope_scaling`` is the full
layers' alone (as ``Olmo3Config`` reads it) and the sliding ones rotate by ``rope_theta``."""

from __future__ import annotations

from model.config import FULL, SLIDING, DecoderConfig
from model.families.common import Fields, layer_types, rope, rope_parameters, shapes, sliding_window
from model.families.olmo2 import olmo2_switches

ARCHITECTURES = ("Olmo3ForCausalLM", "Olmo3Model")
# transformers' Olmo3Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-5,
                tie_word_embeddings=False, attention_bias=False, rope_theta=500_000.0, sliding_window=4096)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "olmo3")
    config = shapes(f)
    n, window = config["num_hidden_layers"], sliding_window(f)
    types = layer_types(f, n, [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(n)], window)
    full, where = rope_parameters(f, FULL)
    local, local_where = rope_parameters(f, SLIDING)
    if local_where == "rope_scaling":  # the hub's layout: rope_scaling is the full layers' alone
        local, local_where = {}, "rope_theta"
    return DecoderConfig("olmo3", **config, rope=rope(f, full, where, f.get("rope_theta")),
                         sliding_rope=rope(f, local, local_where, f.get("rope_theta")), sliding_window=window,
                         layer_types=types, **olmo2_switches(f))
