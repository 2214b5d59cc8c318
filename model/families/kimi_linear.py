"""Kimi Linear (``KimiLinearForCausalLM``, model_type ``kimi_linear``: Kimi-Linear-48B-A3B), as
transformers' ``KimiLinearModel`` computes it: Llama-like blocks (a norm before each sublayer)
whose mixer is

* **Kimi Delta Attention** on ``layer_types``' ``linear_attention`` blocks (the hub's
  ``linear_attn_config.kda_layers``, 1-based): Gated DeltaNet (``model.config.DeltaNet``) with as
  many q, k and v heads of one width (``linear_num_heads`` x ``linear_head_dim``), a causal
  convolution with SiLU over each, a decay per key channel g = -exp(A_log) softplus(f_b(f_a(x)) +
  dt_bias) through a rank of the head width, beta = sigmoid(b), and each head's output RMS-normed
  in float32 and gated by sigmoid(g_b(g_a(x)));
* **latent attention** on its ``full_attention`` ones: DeepSeek-V3's (the query straight from x
  where ``q_lora_rank`` is null, as Kimi's), with no rotation at all (``mla_use_nope``: the key
  part a rotation would take is shared by the heads all the same).

The MLP is dense on the ``mlp_layer_types``' ``dense`` blocks (the hub's first
``first_k_dense_replace``), else DeepSeek-V3's mixture (``model.families.deepseek_v3.grouped_moe``:
sigmoid scores, the choice bias, groups, renormalised and times ``routed_scaling_factor``, the
shared experts added ungated). The hub's config.json names these as transformers'
``attribute_map`` reads them (``num_experts``, ``num_experts_per_token``, ``moe_renormalize``, ...)."""

from __future__ import annotations

from typing import Any

from model.config import DecoderConfig, DeltaNet
from model.families.common import Fields
from model.families.deepseek_v3 import dense_layers_by_type, grouped_moe, latent_decoder
from model.families.qwen3_5 import FULL_ATTENTION, LINEAR

ARCHITECTURES = ("KimiLinearForCausalLM", "KimiLinearModel")
# transformers' KimiLinearConfig defaults, for keys a config.json may leave out (rope_theta: none is read,
# the blocks do not rotate).
DEFAULTS = dict(vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
                num_hidden_layers=27, num_attention_heads=32, n_shared_experts=1, n_routed_experts=256,
                routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
                qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=8, first_k_dense_replace=1,
                norm_topk_prob=True, hidden_act="silu", max_position_embeddings=1048576, rms_norm_eps=1e-5,
                tie_word_embeddings=False, attention_bias=False, rope_theta=10_000.0, linear_head_dim=128,
                linear_num_heads=32, linear_conv_kernel_dim=4)
# config.json's names (transformers' attribute_map) -> the names DeepSeek's readers read.
ALIASES = {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
           "num_experts_per_token": "num_experts_per_tok", "num_expert_group": "n_group",
           "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob",
           "model_max_length": "max_position_embeddings"}
# The hub's linear_attn_config keys -> transformers' top-level ones (the nested ones win, as there).
LINEAR_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
               "short_conv_kernel_size": "linear_conv_kernel_dim"}


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(read_names(raw), DEFAULTS, "kimi_linear")
    refuse_unhandled(f)
    layers = f.number("num_hidden_layers")
    dense = dense_layers_by_type(f, layers) if f.raw.get("mlp_layer_types") else range(
        min(f.number("first_k_dense_replace"), layers))
    moe = grouped_moe(f, dense, scoring="sigmoid", selection_bias=True, group_score="top2",
                      normalize_top_k=bool(f.optional("norm_topk_prob")), normalize_epsilon=1e-20)
    return latent_decoder(f, moe, interleave=False, rope_in_float32=False, rotates=False,
                          nope_layers=tuple(range(layers)), deltanet=delta_attention(f, layers))


def read_names(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with the hub's and transformers' other names of a key under the one read."""
    named = {ALIASES.get(key, key): value for key, value in raw.items()}
    nested = raw.get("linear_attn_config") or {}
    named.update({LINEAR_KEYS[key]: value for key, value in nested.items() if key in LINEAR_KEYS})
    return named


def refuse_unhandled(f: Fields) -> None:
    """The hub config's switches that transformers' Kimi Linear does not read, where set otherwise
    than the model has them (the numbers would not be the checkpoint's model's)."""
    if f.get("hidden_act") != "silu":  # the convolution's activation too
        raise f.refuse("hidden_act", f.get("hidden_act"), "Kimi Delta Attention's convolution's activation is SiLU")
    if f.raw.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise f.refuse("moe_router_activation_func", f.raw["moe_router_activation_func"], "the router's scores are "
                       "sigmoids (transformers' Kimi Linear reads no other)")
    if f.raw.get("moe_layer_freq", 1) != 1:
        raise f.refuse("moe_layer_freq", f.raw["moe_layer_freq"], "the experts are in every block past the dense ones")
    if f.raw.get("mla_use_nope") is False:
        raise f.refuse("mla_use_nope", False, "Kimi Linear's latent attention does not rotate (transformers' neither)")
    if f.raw.get("mla_use_output_gate"):
        raise f.refuse("mla_use_output_gate", f.raw["mla_use_output_gate"], "no gate on the latent attention's output "
                       "is read (transformers' Kimi Linear reads none)")
    nested = f.raw.get("linear_attn_config") or {}
    for key, why in (("gate_lower_bound", "the decay is not bounded below here (transformers' Kimi Linear reads "
                                          "no bound)"),
                     ("use_full_rank_gate", "the gates pass through a rank of the head width")):
        if nested.get(key) not in (None, False):
            raise f.refuse(f"linear_attn_config.{key}", nested[key], why)


def delta_attention(f: Fields, layers: int) -> DeltaNet:
    """The Kimi Delta Attention blocks and their mixer's shapes."""
    heads, width = f.number("linear_num_heads"), f.number("linear_head_dim")
    return DeltaNet(block_kinds(f, layers), heads, heads, width, width, f.number("linear_conv_kernel_dim"),
                    channel_decay=True, gate_rank=width, output_gate="sigmoid", norm_in_float32=True,
                    float32_params=("dt_bias",))


def block_kinds(f: Fields, layers: int) -> tuple[int, ...]:
    """The Kimi Delta Attention blocks: ``layer_types``' ``linear_attention`` ones; without it, all
    but the hub's ``linear_attn_config.full_attn_layers`` (1-based); without those, all but each
    fourth from block 4 (transformers' default). At least one of each kind."""
    types = f.raw.get("layer_types")
    nested = f.raw.get("linear_attn_config") or {}
    if types is None and "full_attn_layers" in nested and "kda_layers" in nested:
        numbered = {LINEAR: nested["kda_layers"], FULL_ATTENTION: nested["full_attn_layers"]}
        types = [None] * layers
        for kind, blocks in numbered.items():
            for block in blocks:
                if not isinstance(block, int) or not 1 <= block <= layers:
                    key = "kda_layers" if kind == LINEAR else "full_attn_layers"
                    raise f.refuse(f"linear_attn_config.{key}", blocks, f"blocks are numbered 1 to {layers}")
                types[block - 1] = kind
    elif types is None:
        types = [FULL_ATTENTION if i and i % 4 == 0 else LINEAR for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) != {LINEAR, FULL_ATTENTION}:
        raise f.refuse("layer_types", types, f"expected {layers} entries of {LINEAR} or {FULL_ATTENTION}, each kind "
                       "at least once")
    return tuple(i for i, kind in enumerate(types) if kind == LINEAR)
