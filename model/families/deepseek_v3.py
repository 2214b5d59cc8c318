"""DeepSeek-V3 and R1, Kimi K2 and Moonlight (``DeepseekV3ForCausalLM``, model_type ``deepseek_v3``;
Kimi K2's config.json says ``kimi_k2``),
and GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``, model_type ``glm4_moe_lite``), as transformers'
``DeepseekV3Model`` computes them, through the switches of ``model.config``:

* **multi-head latent attention** (``LatentAttention``): the query through ``q_lora_rank`` (or
  straight from x where it is null), keys and values from a compressed latent of
  ``kv_lora_rank`` and one rotated key part of ``qk_rope_head_dim`` shared by the heads; each
  head's query and key ``qk_nope_head_dim`` + ``qk_rope_head_dim`` wide, its value
  ``v_head_dim``; the rotated dims paired as (0, 1), (2, 3), ... where ``rope_interleave``
  (reordered at load time); YaRN (``rope_parameters`` / ``rope_scaling``) with its ``mscale`` on
  the softmax scale where ``mscale_all_dim`` is set;
* a mixture of ``n_routed_experts`` SwiGLU experts of ``moe_intermediate_size`` in every block
  from ``first_k_dense_replace`` on (GLM-4.7-Flash: the ``sparse`` entries of
  ``mlp_layer_types``), dense MLPs of ``intermediate_size`` before; the **router**: float32
  logits, sigmoid scores, ``e_score_correction_bias`` added to choose the experts only, the
  ``num_experts_per_tok`` chosen within the ``topk_group`` best of ``n_group`` groups (a group's
  score: the sum of its two best), their scores renormalised (``norm_topk_prob``, + 1e-20) and
  times ``routed_scaling_factor``; ``n_shared_experts`` shared experts as one MLP of
  ``moe_intermediate_size * n_shared_experts``, added ungated;
* block-FP8 weights (``quantization_config`` ``fp8``: ``weight_scale_inv``) dequantized at load
  (``model.fp8``).

The multi-token-prediction layer (``model.layers.<num_hidden_layers>``) is not read: it is no
block of the model's forward (transformers ignores it too)."""

from __future__ import annotations

import math
from typing import Any

from model import fp8
from model.config import DecoderConfig, LatentAttention, MoE
from model.families.common import Fields, activation, rope, rope_parameters, shapes

ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV3Model")
LITE_ARCHITECTURES = ("Glm4MoeLiteForCausalLM", "Glm4MoeLiteModel")
QUANTIZATIONS = ("fp8",)  # quantization_config methods read (block-FP8: model.fp8)
# transformers' DeepseekV3Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
                tie_word_embeddings=False, rope_interleave=True, attention_bias=False, rope_theta=10_000.0)
# transformers' Glm4MoeLiteConfig's, where they differ.
LITE_DEFAULTS = {**DEFAULTS, **dict(vocab_size=154880, hidden_size=2048, intermediate_size=10240,
                                    moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20,
                                    n_routed_experts=64, routed_scaling_factor=1.8, q_lora_rank=768, v_head_dim=256,
                                    qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=4,
                                    max_position_embeddings=202752, rms_norm_eps=1e-5)}


def decoder_config(raw: dict) -> DecoderConfig:
    lite = raw.get("model_type") == "glm4_moe_lite"
    f = Fields(raw, LITE_DEFAULTS if lite else DEFAULTS, "glm4_moe_lite" if lite else "deepseek_v3")
    layers = f.number("num_hidden_layers")
    dense = dense_layers_by_type(f, layers) if lite else range(min(f.number("first_k_dense_replace"), layers))
    # Null is off for these two, as transformers reads it (absent: on).
    moe = grouped_moe(f, dense, scoring="sigmoid", selection_bias=True, group_score="top2",
                      normalize_top_k=bool(f.optional("norm_topk_prob")), normalize_epsilon=1e-20)
    return latent_decoder(f, moe, interleave=bool(f.optional("rope_interleave")), rope_in_float32=False)


def latent_decoder(f: Fields, moe: MoE, interleave: bool, rope_in_float32: bool, partial_rope: bool = False,
                   rotates: bool = True, per_tensor_fp8: bool = False, **switches: Any) -> DecoderConfig:
    """A DeepSeek decoder of latent attention (the reading V2 shares) with ``moe``; ``partial_rope``:
    the RoPE parameters may state the rotated share (Mistral 4's, qk_rope_head_dim over the head);
    ``rotates`` off: no block rotates (Kimi Linear's), so no RoPE parameters are read (nor YaRN's
    softmax scale); ``per_tensor_fp8``: FP8 with per-tensor scales is read (Mistral's files:
    ``model.fp8.block_size``)."""
    config = shapes(f)
    heads = config["num_attention_heads"]
    if config["num_key_value_heads"] != heads:
        raise f.refuse("num_key_value_heads", config["num_key_value_heads"], "latent attention gives every one of "
                       f"the {heads} heads its own keys and values")
    q_rank = f.optional("q_lora_rank")
    mla = LatentAttention(f.number("kv_lora_rank"), int(q_rank) if q_rank else None, f.number("qk_nope_head_dim"),
                          f.number("qk_rope_head_dim"), interleave, rope_in_float32)
    if mla.qk_rope_head_dim % 2 or (rotates and mla.qk_rope_head_dim < 2):  # (none: GLM-5-next's keys)
        raise f.refuse("qk_rope_head_dim", mla.qk_rope_head_dim, "RoPE rotates pairs of dims")
    params, where = rope_parameters(f) if rotates else ({}, "rope_parameters")
    rotary = rope(f, params, where, f.number("rope_theta", float), partial=partial_rope)
    scalar = None  # transformers' yarn_apply_mscale: the softmax scale times mscale(factor, mscale_all_dim)^2
    if rotary.kind != "default" and params.get("mscale_all_dim"):
        mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(rotary.factor) + 1.0 if rotary.factor > 1 else 1.0
        scalar = mla.qk_head_dim / mscale ** 4
    bias = bool(f.get("attention_bias"))
    config.update(head_dim=f.number("v_head_dim"))
    return DecoderConfig(f.family, **config, rope=rotary, rotary_dim=mla.qk_rope_head_dim, mla=mla,
                         query_pre_attn_scalar=scalar, qkv_bias=bias, o_bias=bias,
                         hidden_act=activation(f, "hidden_act"), moe=moe,
                         weight_block_size=fp8.block_size(f.raw.get("quantization_config"), f.refuse, per_tensor_fp8),
                         **switches)


def grouped_moe(f: Fields, dense_layers, **switches: Any) -> MoE:
    """The mixture of experts of DeepSeek's lineage: its router's groups (``n_group``, ``topk_group``),
    ``routed_scaling_factor``, ``n_shared_experts`` ungated, a float32 router (unless ``switches``
    say otherwise: Nemotron-H's shared MLP has a width of its own); ``switches``: the rest."""
    experts, k = f.number("n_routed_experts"), f.number("num_experts_per_tok")
    groups, top_groups = int(f.get("n_group") or 1), int(f.get("topk_group") or 1)
    if groups < 1 or experts % groups:
        raise f.refuse("n_group", groups, f"the {experts} experts must split into equal groups")
    if not 1 <= top_groups <= groups:
        raise f.refuse("topk_group", top_groups, f"the groups chosen are 1 to n_group ({groups})")
    if switches.get("group_score") == "top2" and experts // groups < 2:
        raise f.refuse("n_group", groups, "a group's score is the sum of its two best experts: 2 or more a group")
    if not 0 < k <= top_groups * experts // groups:
        raise f.refuse("num_experts_per_tok", k, f"a token's experts are 1 to the {top_groups} chosen groups' "
                       f"{top_groups * experts // groups}")
    shared = f.number("n_shared_experts")
    switches = {"router_in_float32": True,
                "shared_expert_size": shared * f.number("moe_intermediate_size") if shared else None, **switches}
    return MoE(experts, k, f.number("moe_intermediate_size"), weights_in_float32=True, shared_expert_gate=False,
               dense_layers=tuple(dense_layers), groups=groups, top_groups=top_groups,
               routed_scaling=f.number("routed_scaling_factor", float), **switches)


def dense_layers_by_type(f: Fields, layers: int) -> list[int]:
    """GLM-4.7-Flash's blocks with a dense MLP: its ``mlp_layer_types``' ``dense`` entries
    (transformers' default: the first block)."""
    types = f.raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    if len(types) != layers or set(types) - {"dense", "sparse"}:
        raise f.refuse("mlp_layer_types", types, f"one of dense or sparse for each of the {layers} layers")
    return [i for i, kind in enumerate(types) if kind == "dense"]
