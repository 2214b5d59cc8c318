"""SmolLM3 (``SmolLM3ForCausalLM``, model_type ``smollm3``): Llama's block with RoPE left out on
some layers (``no_rope_layers``: 1 where a layer rotates q and k, 0 where it does not; by default
every fourth layer has no RoPE, ``no_rope_layer_interval``), and a sliding window on the layers
``layer_types`` names (``use_sliding_window``; off on the released models)."""

from __future__ import annotations

from model.config import FULL, SLIDING, DecoderConfig
from model.families.common import Fields, activation, layer_types, rope, rope_parameters, shapes, sliding_window

ARCHITECTURES = ("SmolLM3ForCausalLM", "SmolLM3Model")
# transformers' SmolLM3Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=128_256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                num_attention_heads=16, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768,
                rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                rope_theta=2_000_000.0, no_rope_layer_interval=4, use_sliding_window=False)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "smollm3")
    config = shapes(f)
    n = config["num_hidden_layers"]
    rotates = no_rope_layers(f, n)
    window = sliding_window(f) if f.get("use_sliding_window") else None
    # transformers' rule where layer_types is absent: a window on the layers without RoPE.
    derived = [SLIDING if window and not rotates[i] else FULL for i in range(n)]
    types = layer_types(f, n, derived, window) if window else ()
    params, where = rope_parameters(f)
    bias = bool(f.get("attention_bias"))
    return DecoderConfig("smollm3", **config, rope=rope(f, params, where, f.get("rope_theta")),
                         nope_layers=tuple(i for i in range(n) if not rotates[i]), sliding_window=window,
                         layer_types=types, qkv_bias=bias, o_bias=bias, mlp_bias=bool(f.get("mlp_bias")),
                         hidden_act=activation(f, "hidden_act"))


def no_rope_layers(f: Fields, num_layers: int) -> list[bool]:
    """Per layer, whether it rotates q and k (``no_rope_layers``, else every
    ``no_rope_layer_interval``-th layer does not)."""
    given = f.raw.get("no_rope_layers")
    if given is None:
        interval = f.number("no_rope_layer_interval")
        return [(i + 1) % interval != 0 for i in range(num_layers)]
    if not isinstance(given, list) or len(given) != num_layers or any(v not in (0, 1) for v in given):
        raise f.refuse("no_rope_layers", given, f"expected {num_layers} entries of 0 or 1, one per layer")
    return [bool(v) for v in given]
