"""Gemma 4 (``Gemma4ForCausalLM``, model_type ``gemma4_text``), and the text model inside
``Gemma4ForConditionalGeneration`` (model_type ``gemma4`` with a ``text_config``: the released
checkpoints; the vision and audio towers are not read).

Gemma 3's block (sandwich norms, q/k norms, sliding and full layers with a RoPE each, embeddings
x sqrt(H), tanh GELU, a soft-capped LM head) with these differences, each a ``DecoderConfig`` switch:
  * every RMSNorm scales by w (not 1 + w), in float32; the values are RMS-normed too, without a
    weight; scores are not scaled (q . k, the q/k norms doing that work);
  * full-attention layers have their own head size (``global_head_dim``) and, where keys equal
    values (``attention_k_eq_v``: no v_proj, the values are k_proj's output through the value
    norm), their own kv heads (``num_global_key_value_heads``); transformers 5 writes both as a
    ``per_layer_config``. Their RoPE is ``proportional``: the first quarter of the head's pairs
    rotate, at the frequencies of the whole head;
  * the last ``num_kv_shared_layers`` blocks compute no keys or values: each attends to those of
    the last earlier block of its layer type; with ``use_double_wide_mlp`` their MLPs are twice as wide;
  * per-layer embeddings (``hidden_size_per_layer_input``): a second table of
    ``num_layers x that`` per token, plus a projection of the embeddings, give each block a small
    input that gates an addition to the stream after its MLP;
  * each block's output is multiplied by its learned ``layer_scalar``.
With ``enable_moe_block`` (26B-A4B) every block's dense MLP has experts beside it
(``model.config.MoE.beside_dense``): a router reading the normed stream after attention, experts
of their own normed input, the two outputs normed apart and summed before the post-MLP norm.
Refused in one line: fully bidirectional attention, attention biases."""

from __future__ import annotations

from typing import Any

from model.config import FULL, SLIDING, DecoderConfig, MoE, RoPE
from model.families.common import (Fields, activation, layer_types, refuse_if_set, rope, rope_parameters, shapes,
                                   sliding_window, wrapped_text_config)

ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4TextModel")
WRAPPER_ARCHITECTURES = ("Gemma4ForConditionalGeneration",)
PATTERN = 6  # without layer_types: five sliding layers to one full, as transformers derives them
# transformers' Gemma4TextConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                max_position_embeddings=131_072, rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=512,
                final_logit_softcapping=None, vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256,
                num_kv_shared_layers=0, global_head_dim=512)
# Each layer type's RoPE when config.json gives none (transformers' defaults).
DEFAULT_ROPE = {SLIDING: dict(rope_type="default", rope_theta=10_000.0),
                FULL: dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1_000_000.0)}
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")  # what a per_layer_config entry may override


def decoder_config(raw: dict) -> DecoderConfig:
    if raw.get("model_type") == "gemma4":  # the multimodal wrapper: its text model only
        raw = wrapped_text_config(raw, "gemma4")
    f = Fields(raw, DEFAULTS, "gemma4")
    refuse_if_set(f, "attention_bias", "Gemma 4 checkpoints have no attention biases")
    if f.raw.get("use_bidirectional_attention") == "all":
        raise f.refuse("use_bidirectional_attention", "all", "only causal attention over text is implemented")
    config = shapes(f)
    n = config["num_hidden_layers"]
    window = sliding_window(f)
    types = _layer_types(f, n, window)
    head_dim, kv_heads = _full_layer_shape(f, types, config)
    shared = f.number("num_kv_shared_layers")
    _check_sharing(f, types or (FULL,) * n, shared)
    per_layer = int(f.get("hidden_size_per_layer_input") or 0)
    cap = f.optional("final_logit_softcapping")
    return DecoderConfig(
        "gemma4", **config, rope=_rope(f, FULL), sliding_rope=_rope(f, SLIDING) if SLIDING in types else None,
        sliding_window=window if SLIDING in types else None, layer_types=types, sandwich_norms=True,
        scale_embeddings=True, norm_weight_in_float32=True, qk_norm=True, value_norm=True, query_pre_attn_scalar=1.0,
        hidden_act=activation(f, "hidden_activation"), final_logit_softcap=float(cap) if cap else None,
        global_head_dim=head_dim, global_key_value_heads=kv_heads, attention_k_eq_v=bool(f.get("attention_k_eq_v")),
        kv_shared_layers=shared, double_wide_mlp=bool(f.get("use_double_wide_mlp")) and shared > 0,
        per_layer_input_size=per_layer, per_layer_vocab_size=f.number("vocab_size_per_layer_input") if per_layer else 0,
        layer_scalar=True, moe=_experts(f) if f.raw.get("enable_moe_block") else None)


def _experts(f: Fields) -> MoE:
    """The experts beside every block's dense MLP (Gemma 4 26B-A4B): ``num_experts`` of
    ``moe_intermediate_size``, the ``top_k_experts`` of a softmax over a normed router's logits,
    renormalised and scaled per expert, kept in float32 as they scale the outputs."""
    experts, k = f.number("num_experts"), f.number("top_k_experts")
    if not 0 < k <= experts:
        raise f.refuse("top_k_experts", k, f"a token's experts are 1 to num_experts ({experts})")
    # moe_intermediate_size, or the name the first Gemma 4 config.json files gave it
    size_key = "moe_intermediate_size" if f.get("moe_intermediate_size") is not None else "expert_intermediate_size"
    return MoE(experts, k, f.number(size_key), normalize_top_k=True, weights_in_float32=True,
               beside_dense=True, router_norm=True, per_expert_scale=True)


def _layer_types(f: Fields, num_layers: int, window: int | None) -> tuple[str, ...]:
    """``layer_types``, or five sliding layers to one full; the last layer full whatever they say
    (transformers forces it, with a warning)."""
    given = f.raw.get("layer_types")
    types = list(given) if given is not None else [FULL if (i + 1) % PATTERN == 0 else SLIDING
                                                   for i in range(num_layers)]
    if types:
        types[-1] = FULL
    return layer_types(Fields({**f.raw, "layer_types": types}, f.defaults, f.family), num_layers, types, window)


def _full_layer_shape(f: Fields, types: tuple[str, ...], config: dict[str, Any]) -> tuple[int | None, int | None]:
    """(head size, kv heads) of the full-attention layers where they differ from the others
    (None where they do not): from transformers 5's ``per_layer_config``, else from
    ``global_head_dim`` and, with ``attention_k_eq_v``, ``num_global_key_value_heads``."""
    full = [i for i in range(config["num_hidden_layers"]) if not types or types[i] == FULL]
    entries = f.raw.get("per_layer_config")
    if entries is not None:
        if not isinstance(entries, dict):
            raise f.refuse("per_layer_config", entries, "expected a dict of layer -> overrides")
        base = {"head_dim": config["head_dim"], "num_key_value_heads": config["num_key_value_heads"]}
        overrides = {int(layer): dict(values) for layer, values in entries.items()}
        for layer, values in overrides.items():
            # An entry may restate the model's values (transformers can write every layer's).
            differs = {key for key, value in values.items() if base.get(key) != value}
            if differs - set(PER_LAYER_KEYS) or (differs and layer not in full):
                raise f.refuse(f"per_layer_config.{layer}", values, f"only the full-attention layers' "
                               f"{' and '.join(PER_LAYER_KEYS)} may differ")
        shapes_of_full = {tuple(sorted({**base, **overrides.get(i, {})}.items())) for i in full}
        if len(shapes_of_full) > 1:
            raise f.refuse("per_layer_config", entries, "the full-attention layers must share one shape")
        values = overrides.get(full[0], {}) if full else {}
        head_dim, kv_heads = values.get("head_dim"), values.get("num_key_value_heads")
    else:
        head_dim = f.number("global_head_dim")
        kv_heads = f.raw.get("num_global_key_value_heads") if f.get("attention_k_eq_v") else None
    head_dim = int(head_dim) if head_dim and int(head_dim) != config["head_dim"] else None
    kv_heads = int(kv_heads) if kv_heads and int(kv_heads) != config["num_key_value_heads"] else None
    if kv_heads is not None and config["num_attention_heads"] % kv_heads:
        raise f.refuse("per_layer_config" if entries is not None else "num_global_key_value_heads", kv_heads,
                       f"num_attention_heads {config['num_attention_heads']} must be a multiple of it")
    return head_dim, kv_heads


def _check_sharing(f: Fields, types: tuple[str, ...], shared: int) -> None:
    """Refuses a kv sharing no earlier block can serve (transformers raises for it)."""
    if not 0 <= shared < len(types):
        raise f.refuse("num_kv_shared_layers", shared, f"0 to {len(types) - 1}: at least one block must compute "
                       "keys and values")
    if shared and set(types[len(types) - shared:]) - set(types[:len(types) - shared]):
        raise f.refuse("num_kv_shared_layers", shared, "a shared block's layer type has no earlier block to share "
                       "keys and values with")


def _rope(f: Fields, layer_type: str) -> RoPE:
    """The RoPE of one layer type: ``proportional`` (a fraction of the pairs rotated, at the whole
    head's frequencies) or one of the common kinds."""
    params, where = rope_parameters(f, layer_type)
    if not f.raw.get("rope_parameters"):
        params, where = dict(DEFAULT_ROPE[layer_type]), f"rope_parameters.{layer_type}"
    theta = DEFAULT_ROPE[layer_type]["rope_theta"]
    if (params.get("rope_type") or "default") != "proportional":
        return rope(f, params, where, theta)
    try:
        fraction = float(params.get("partial_rotary_factor", 1.0))
        return RoPE(float(params.get("rope_theta") or theta), "proportional", float(params.get("factor") or 1.0),
                    fraction=fraction)
    except (TypeError, ValueError):
        raise f.refuse(where, params, "rope_theta, factor and partial_rotary_factor must be numbers") from None
