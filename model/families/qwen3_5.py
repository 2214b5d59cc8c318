"""Qwen3.5 (``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``), and the text model inside
``Qwen3_5ForConditionalGeneration`` (model_type ``qwen3_5`` with a ``text_config``: the released
checkpoints; the vision tower is not read); Qwen3.5-MoE the same way (``qwen3_5_moe_text``,
``qwen3_5_moe``: Qwen3.5-35B-A3B, 122B-A10B), whose every block's MLP is a mixture of experts
(``num_experts`` of ``moe_intermediate_size``, ``num_experts_per_tok`` of them renormalised) with a
shared expert (``shared_expert_intermediate_size``) scaled by sigmoid(``shared_expert_gate``(x)),
as Qwen2-MoE's.

Three layers of four (``layer_types``: ``linear_attention``; else every ``full_attention_interval``-th
is ``full_attention``) mix with Gated DeltaNet (``model.config.DeltaNet``); the others with
gated full attention: ``q_proj`` writes each head's query and a gate, the heads' outputs are
multiplied by sigmoid(gate) before ``o_proj``, q and k RMS-normed per head. Every RMSNorm scales
by (1 + w) in float32; RoPE rotates the first quarter of each head (``partial_rotary_factor``).
Text positions are the same on the three M-RoPE axes, so ``mrope_section`` changes nothing here.
Qwen3-Next (``model.families.qwen3_next``) is the same decoder with its tensors fused otherwise."""

from __future__ import annotations

from model.config import DecoderConfig, DeltaNet
from model.families.common import (Fields, activation, mixture_of_experts, rope, rope_parameters, rotary_dim, shapes,
                                   untied_text_config)

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5TextModel")
WRAPPER_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration",)
MOE_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextModel")
MOE_WRAPPER_ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration",)
WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
LINEAR, FULL_ATTENTION = "linear_attention", "full_attention"
# transformers' Qwen3_5TextConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=248_320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                num_attention_heads=16, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768,
                rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, head_dim=256,
                linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4,
                rope_theta=10_000.0)
# transformers' Qwen3_5MoeTextConfig defaults where they differ from Qwen3.5's.
MOE_DEFAULTS = dict(DEFAULTS, hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512, num_experts_per_tok=8, num_experts=256)


def decoder_config(raw: dict) -> DecoderConfig:
    wrapper = raw.get("model_type")
    if wrapper in WRAPPERS:  # the multimodal wrapper: its text model only
        raw = untied_text_config(raw, wrapper, WRAPPERS[wrapper])
    moe = raw.get("model_type") == "qwen3_5_moe_text"
    f = Fields(raw, MOE_DEFAULTS if moe else DEFAULTS, "qwen3_5_moe" if moe else "qwen3_5")
    experts = mixture_of_experts(f, "moe_intermediate_size", normalize_top_k=True,
                                 shared_expert_size=f.number("shared_expert_intermediate_size")) if moe else None
    return hybrid_config(f, experts)


def hybrid_config(f: Fields, moe=None) -> DecoderConfig:
    """Qwen3.5's decoder (Qwen3-Next's too): DeltaNet and gated-attention blocks, (1 + w) norms,
    partial RoPE; ``moe`` in place of the MLP where given."""
    config = shapes(f)
    params, where = rope_parameters(f)
    bias = bool(f.get("attention_bias"))
    return DecoderConfig(f.family, **config, rope=rope(f, params, where, f.get("rope_theta"), partial=True),
                         rotary_dim=rotary_dim(f, params, where, config["head_dim"], default=0.25),
                         qkv_bias=bias, o_bias=bias, qk_norm=True, norm_unit_offset=True, attn_output_gate=True,
                         deltanet=gated_deltanet(f, linear_layers(f, config["num_hidden_layers"])), moe=moe,
                         hidden_act=activation(f, "hidden_act"))


def linear_layers(f: Fields, num_layers: int) -> tuple[int, ...]:
    """The blocks whose mixer is Gated DeltaNet: ``layer_types``'s ``linear_attention`` ones, else
    all but every ``full_attention_interval``-th."""
    types = f.raw.get("layer_types")
    if types is None:
        interval = f.number("full_attention_interval")
        types = [LINEAR if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {LINEAR, FULL_ATTENTION}:
        raise f.refuse("layer_types", types, f"expected {num_layers} entries of {LINEAR} or {FULL_ATTENTION}")
    return tuple(i for i, kind in enumerate(types) if kind == LINEAR)


def gated_deltanet(f: Fields, layers: tuple[int, ...]) -> DeltaNet:
    keys, values = f.number("linear_num_key_heads"), f.number("linear_num_value_heads")
    if keys < 1 or values % keys:
        raise f.refuse("linear_num_value_heads", values, f"a multiple of linear_num_key_heads {keys} is needed")
    return DeltaNet(layers, keys, values, f.number("linear_key_head_dim"), f.number("linear_value_head_dim"),
                    f.number("linear_conv_kernel_dim"))
