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
    wide. The experts' tensors are stacked: ``gate_up_proj`` [E, H, 2F], ``down_proj`` [E, F, H].

Maverick's ``-Instruct-FP8`` (``quantization_config`` ``compressed-tensors``, format ``float-quantized``:
float8 e4m3 weights, each with its ``weight_scale`` per output channel, and dynamic per-token
activations) is dequantized at load (``model.fp8``), wherever a float8 weight has its scale beside
it (its ``ignore`` list is not read); its experts are one Linear an expert
(``experts.{e}.gate_proj.weight``, ...: ``model.params``). The activations are not quantized
(dynamic or static: a static ``input_scale`` is not read, as Mistral 4's are not): what is computed
is the model of the dequantized weights. Any other compressed-tensors scheme is refused
in one line naming its key."""

from __future__ import annotations

from typing import Any

from model import fp8
from model.config import CHUNKED, FULL, DecoderConfig, MoE, QueryTemperature
from model.families.common import Fields, activation, rope, rope_parameters, shapes, untied_text_config

ARCHITECTURES = ("Llama4ForCausalLM", "Llama4TextModel")
WRAPPER_ARCHITECTURES = ("Llama4ForConditionalGeneration",)
QUANTIZATIONS = ("compressed-tensors",)  # quantization_config methods read (FP8 per channel or tensor: model.fp8)
__all__ = ["ARCHITECTURES", "WRAPPER_ARCHITECTURES", "QUANTIZATIONS", "decoder_config"]
# compressed-tensors' formats that store an 8-bit float weight as float8 beside its weight_scale
# (float-quantized is naive-quantized under another name).
COMPRESSED_FORMATS = ("float-quantized", "naive-quantized")
# A group's weights as read: (the key below its ``weights``, compressed-tensors' default where absent, the
# values accepted, why).
WEIGHT_SCHEME = (("num_bits", 8, (8,), "the quantized weights read are 8-bit floats (FP8)"),
                 ("type", "int", ("float",), "the quantized weights read are 8-bit floats (FP8)"),
                 ("strategy", "tensor", ("channel", "tensor"), "the FP8 scales read are per output channel or per "
                  "tensor"),
                 ("symmetric", True, (True,), "the FP8 weights read have no zero point"),
                 ("dynamic", False, (False,), "the FP8 weights read have stored scales"),
                 ("group_size", None, (None,), "the FP8 scales read are per output channel or per tensor"),
                 ("block_structure", None, (None,), "the FP8 scales read are per output channel or per tensor"))
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
                         moe=experts(f, n), hidden_act=activation(f, "hidden_act"),
                         weight_block_size=compressed_fp8(f, f.raw.get("quantization_config")))


def compressed_fp8(f: Fields, quantization: dict | None) -> tuple[int, int] | None:
    """``fp8.FROM_SCALES`` for compressed-tensors' FP8 (every group's weights 8-bit floats, symmetric,
    scaled per channel or per tensor; its input activations' scheme not applied; nothing else compressed),
    None without a ``quantization_config``; anything else refused in one line naming its key."""
    if not quantization:
        return None
    check = lambda key, value, accepted, why: _accepted(f, f"quantization_config.{key}", value, accepted, why)
    top = quantization.get("format")  # a group's own format, where it has one, overrides it (mixed-precision)
    check("format", top, (None, "mixed-precision", *COMPRESSED_FORMATS), "the compressed-tensors formats read "
          "store FP8 weights as float8 beside their weight_scale")
    check("quantization_status", quantization.get("quantization_status", "compressed"), ("compressed",),
          "the weights read are stored compressed")
    for key, why in (("sparsity_config", "sparse weights are not read"),
                     ("transform_config", "transformed (rotated) weights are not read"),
                     ("kv_cache_scheme", "a quantized KV cache would change the computation")):
        check(key, quantization.get(key) or None, (None,), why)
    groups = quantization.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise f.refuse("quantization_config.config_groups", groups, "expected the quantization schemes by group")
    for name, group in groups.items():
        _check_group(f, f"config_groups.{name}", group, top)
    return fp8.FROM_SCALES


def _check_group(f: Fields, where: str, group: dict[str, Any], top: str | None) -> None:
    """Refuses a compressed-tensors scheme (``config_groups.<name>``; ``top``: the config's format)
    other than FP8 weights with per-channel or per-tensor scales (whatever its activations' scheme:
    they are not quantized here, as Mistral 4's static scales are not read)."""
    check = lambda key, value, accepted, why: _accepted(f, f"quantization_config.{where}.{key}", value, accepted, why)
    check("format", group.get("format") or top, COMPRESSED_FORMATS, "the compressed-tensors formats read "
          "store FP8 weights as float8 beside their weight_scale")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise f.refuse(f"quantization_config.{where}.weights", weights, "expected the weights' scheme")
    for key, default, accepted, why in WEIGHT_SCHEME:
        check(f"weights.{key}", weights.get(key, default), accepted, why)
    check("output_activations", group.get("output_activations"), (None,), "quantized outputs are not read")


def _accepted(f: Fields, key: str, value: Any, accepted: tuple, why: str) -> None:
    """Refuses ``value`` of ``key`` unless it is one of ``accepted``, of its type too."""
    # (bool is an int: True must not pass for num_bits 1, nor 1 for symmetric)
    if not any(value == a and type(value) is type(a) for a in accepted):
        raise f.refuse(key, value, why)


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
