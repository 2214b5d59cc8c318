"""Llama 4 (``Llama4ForCausalLM``, model_type ``llama4_text``), and the text model inside
``Llama4ForConditionalGeneration`` (model_type ``llama4`` with a ``text_config``: Llama-4-Scout,
Maverick; the vision tower is not read).

Llama's pre-norm block, with:
  * RoPE on three blocks of four (``no_rope_layers``: 1 where a block rotates; else every
    ``no_rope_layer_interval``-th block does not), rotating dims (2i, 2i + 1) together (its complex
    product: ``DecoderConfig.rope_interleaved``), llama3 frequency scaling where given;
  * on the rotating blocks, chunked local attention (``attention_chunk_size``: a query sees the
    earlier keys of its own chunk) and q and k divided by their rms after rotary, without a weight
    (``use_qk_norm``); the NoPE blocks attend to every earlier key, their queries scaled by
    1 + ``attn_scale`` log(1 + floor((p + 1) / ``floor_scale``)) (``attn_temperature_tuning``);
  * a mixture of experts on ``moe_layers`` (else every ``interleave_moe_layer_step``-th block):
    ``num_local_experts`` of ``intermediate_size``, the top ``num_experts_per_tok`` logits chosen,
    each expert reading x times the sigmoid of its logit (input-scaled, ``MoE.input_scaled``), plus
    an ungated shared expert of ``intermediate_size``; the other blocks' MLP is ``intermediate_size_mlp``
    wide. The experts' tensors are stacked: ``gate_up_proj`` [E, H, 2F], ``down_proj`` [E, F, H]."""

from __future__ import annotations

from model.config import CHUNKED, FULL, DecoderConfig, MoE, QueryTemperature
from model.families.common import Fields, activation, rope, rope_parameters, shapes, untied_text_config

ARCHITECTURES = ("Llama4ForCausalLM", "Llama4TextModel")
WRAPPER_ARCHITECTURES = ("Llama4ForConditionalGeneration",)
# transformers' Llama4TextConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=202_048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, tie_word_embeddings=False,
                num_experts_per_tok=1, num_local_experts=16, interleave_moe_layer_step=1, use_qk_norm=True,
                no_rope_layer_interval=4, attention_chunk_size=8192, attn_temperature_tuning=True,
                floor_scale=8192, attn_scale=0.1, attention_bias=False, rope_theta=500_000.0)


def decoder_config(raw: dict) -> DecoderConfig:
    if raw.get("model_type") == "llama4":  # the multimodal wrapper: its text model only
        raw = untied_text_config(raw, "llama4", "llama4_text")
    if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None:  # transformers: one per query head
        raw = {**raw, "num_key_value_heads": raw.get("num_attention_heads") or DEFAULTS["num_attention_heads"]}
    f = Fields(raw, DEFAULTS, "llama4")
    config = {**shapes(f), "intermediate_size": f.number("intermediate_size_mlp")}
    n = config["num_hidden_layers"]
    rotates = rotating_layers(f, n)
    chunk = f.optional("attention_chunk_size")
    types = layer_types(f, n, rotates, chunk)
    params, where = rope_parameters(f)
    bias = bool(f.get("attention_bias"))
    temperature = (QueryTemperature(f.number("attn_scale", float), f.number("floor_scale"), offset=1, nope_only=True)
                   if f.get("attn_temperature_tuning") else None)
    return DecoderConfig("llama4", **config, rope=rope(f, params, where, f.get("rope_theta")),
                         nope_layers=tuple(i for i in range(n) if not rotates[i]), rope_interleaved=True,
                         qk_l2_norm=bool(f.get("use_qk_norm")), query_temperature=temperature,
                         attention_chunk_size=int(chunk) if CHUNKED in types else None,
                         layer_types=types if CHUNKED in types else (), qkv_bias=bias, o_bias=bias,
                         moe=experts(f, n), hidden_act=activation(f, "hidden_act"))


def rotating_layers(f: Fields, num_layers: int) -> list[bool]:
    """Per block, whether it rotates q and k: ``no_rope_layers`` (1 where it does; transformers
    reads its first ``num_layers`` entries), else all but every ``no_rope_layer_interval``-th."""
    given = f.raw.get("no_rope_layers")
    if not given:
        interval = f.number("no_rope_layer_interval")
        if interval < 1:
            raise f.refuse("no_rope_layer_interval", interval, "it must be at least 1")
        return [(i + 1) % interval != 0 for i in range(num_layers)]
    if not isinstance(given, list) or len(given) < num_layers or any(v not in (0, 1) for v in given):
        raise f.refuse("no_rope_layers", given, f"expected {num_layers} entries of 0 or 1, one per layer")
    return [bool(v) for v in given[:num_layers]]


def layer_types(f: Fields, num_layers: int, rotates: list[bool], chunk) -> tuple[str, ...]:
    """Per block, FULL or CHUNKED: ``layer_types`` where given, else transformers' rule (the
    rotating blocks chunked, where there is a chunk size)."""
    given = f.raw.get("layer_types")
    if given is not None and not isinstance(given, list):
        raise f.refuse("layer_types", given, f"expected a list of {FULL} or {CHUNKED}")
    types = tuple(given) if given is not None else tuple(
        CHUNKED if rotates[i] and chunk is not None else FULL for i in range(num_layers))
    if len(types) != num_layers or set(types) - {FULL, CHUNKED}:
        raise f.refuse("layer_types", list(types), f"expected {num_layers} entries of {FULL} or {CHUNKED}")
    if CHUNKED in types and (not isinstance(chunk, int) or chunk < 1):
        raise f.refuse("attention_chunk_size", chunk, f"the {CHUNKED} layers need a positive chunk size")
    return types


def experts(f: Fields, num_layers: int) -> MoE:
    """The mixture of experts of ``moe_layers`` (else every ``interleave_moe_layer_step``-th block)."""
    experts, k = f.number("num_local_experts"), f.number("num_experts_per_tok")
    if not 0 < k <= experts:
        raise f.refuse("num_experts_per_tok", k, f"a token's experts are 1 to num_local_experts ({experts})")
    sparse = f.raw.get("moe_layers")
    if sparse is None:
        step = f.number("interleave_moe_layer_step")
        if step < 1:
            raise f.refuse("interleave_moe_layer_step", step, "it must be at least 1")
        sparse = list(range(step - 1, num_layers, step))
    if not isinstance(sparse, list) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in sparse):
        raise f.refuse("moe_layers", sparse, f"expected block numbers below {num_layers}")
    size = f.number("intermediate_size")
    return MoE(experts, k, size, normalize_top_k=False, shared_expert_size=size, shared_expert_gate=False,
               top_k_before_softmax=True, scoring="sigmoid", input_scaled=True,
               dense_layers=tuple(i for i in range(num_layers) if i not in sparse))
