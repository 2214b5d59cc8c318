"""GLM-5-next (GLM-5.3-Flash: ``Glm5NextForConditionalGeneration``, model_type ``glm5_next``; the
language model's settings in its ``text_config``, ``glm5_next_text``), as transformers'
``Glm5NextTextModel`` computes it: Llama-like blocks (a norm before each sublayer) whose residual is
**hyper-connections** (``hc_mult`` streams, ``model.config.HyperConnections``; the final norm
reads their mean), and whose mixer is

* **Kimi Delta Attention** on ``layer_types``' ``linear_attention`` blocks
  (``model.families.kimi_linear``'s, its decay bounded below: g = ``linear_lower_bound`` x
  sigmoid(exp(A_log) (f + dt_bias)), Kimi's softplus form where the bound is null);
* **latent attention without rotation** (``qk_rope_head_dim`` 0) on its ``indexed_attention``
  ones, with GLM-5's sparse attention: a lightning indexer scoring pools of ``index_kpool``
  keys (``model.indexer``), each query attending to its ``index_topk / index_kpool`` best pools
  and the visible keys after its last complete pool (``index_kpool_always_select_tail``); a
  ``shared`` block (``indexer_types``) reuses the choice of the attention block right before it.

The MLP is dense on ``mlp_layer_types``' ``dense`` blocks, else DeepSeek-V3's mixture (sigmoid
scores, the choice bias, groups, renormalised, times ``routed_scaling_factor``, the shared experts
added ungated); the dense MLP's and every expert's gate is clamped to at most ``swiglu_limit`` and
its up projection to within it. The vision tower is not read."""

from __future__ import annotations

import dataclasses
from typing import Any

from common.cli import UserError
from model.config import DecoderConfig, DeltaNet, HyperConnections, Indexer
from model.families.common import Fields
from model.families.deepseek_v3 import dense_layers_by_type, grouped_moe, latent_decoder
from model.families.deepseek_v32 import indexer_types

ARCHITECTURES = ("Glm5NextForConditionalGeneration",)
LINEAR, INDEXED = "linear_attention", "indexed_attention"
# transformers' Glm5NextTextConfig defaults, for keys a config.json may leave out (rope_theta: none is read).
DEFAULTS = dict(vocab_size=154880, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
                num_hidden_layers=45, num_attention_heads=64, n_shared_experts=1, n_routed_experts=288,
                routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=0, v_head_dim=256,
                qk_nope_head_dim=256, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True,
                num_key_value_heads=64, hidden_act="silu", max_position_embeddings=1048576, rms_norm_eps=1e-5,
                attention_bias=False,
                rope_theta=10_000.0, index_topk=2048, index_head_dim=128, index_n_heads=32, swiglu_limit=10.0,
                linear_head_dim=128, linear_num_heads=64, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
                hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, index_kpool=16, index_kpool_always_select_tail=True)
# The hub's linear_attn_config keys -> the top-level ones (the nested ones win, as transformers reads them).
LINEAR_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
               "short_conv_kernel_size": "linear_conv_kernel_dim"}


def decoder_config(raw: dict) -> DecoderConfig:
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UserError("glm5_next config.json has no 'text_config' (the language model's settings)")
    # The wrapper decides the head's tying, as transformers reads it (default untied).
    f = Fields(read_names({**text, "tie_word_embeddings": raw.get("tie_word_embeddings", False)}), DEFAULTS,
               "glm5_next")
    if f.get("hidden_act") != "silu":  # the convolution's activation too
        raise f.refuse("hidden_act", f.get("hidden_act"), "Kimi Delta Attention's convolution's activation is SiLU")
    if not f.optional("q_lora_rank"):
        raise f.refuse("q_lora_rank", f.raw.get("q_lora_rank"), "the indexer reads the low-rank query (transformers "
                       "requires one too)")
    if f.number("qk_rope_head_dim"):
        raise f.refuse("qk_rope_head_dim", f.raw["qk_rope_head_dim"], "GLM-5-next's latent attention does not rotate "
                       "(transformers refuses it too)")
    layers = f.number("num_hidden_layers")
    kinds = block_kinds(f, layers)
    limit = f.number("swiglu_limit", float)
    moe = grouped_moe(f, dense_layers(f, layers), scoring="sigmoid", selection_bias=True, group_score="top2",
                      normalize_top_k=bool(f.optional("norm_topk_prob")), normalize_epsilon=1e-20,
                      swiglu_limit=limit, swiglu_alpha=None)
    linear = tuple(i for i, kind in enumerate(kinds) if kind == LINEAR)
    config = latent_decoder(f, moe, interleave=False, rope_in_float32=False, rotates=False,
                            nope_layers=tuple(range(layers)), deltanet=delta_attention(f, linear),
                            hyper=hyper_connections(f), swiglu_limit=limit)
    mla = dataclasses.replace(config.mla, norm_eps=f.number("rms_norm_eps", float), indexer=indexer(f, kinds))
    return dataclasses.replace(config, mla=mla)


def read_names(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` as transformers' Glm5NextTextConfig reads it: ``num_local_experts`` is
    ``n_routed_experts``; ``linear_attn_config``'s shapes over the top-level ones."""
    named = {("n_routed_experts" if key == "num_local_experts" else key): value for key, value in raw.items()}
    nested = raw.get("linear_attn_config") or {}
    named.update({LINEAR_KEYS[key]: value for key, value in nested.items() if key in LINEAR_KEYS})
    return named


def block_kinds(f: Fields, layers: int) -> list[str]:
    """Each block's mixer, as transformers reads ``layer_types`` (``full_attention`` is
    ``indexed_attention``; default: every fourth block from block 3 attends), both kinds present."""
    types = f.raw.get("layer_types") or [LINEAR if i % 4 != 3 else INDEXED for i in range(layers)]
    types = [INDEXED if kind == "full_attention" else kind for kind in types] if isinstance(types, list) else types
    if not isinstance(types, list) or len(types) != layers or set(types) != {LINEAR, INDEXED}:
        raise f.refuse("layer_types", f.raw.get("layer_types"), f"expected {layers} entries of {LINEAR} or {INDEXED}, "
                       "each kind at least once")
    return types


def dense_layers(f: Fields, layers: int) -> list[int]:
    """The blocks with a dense MLP: ``mlp_layer_types``' ``dense`` ones (default: the first three)."""
    if f.raw.get("mlp_layer_types") is None:
        return list(range(min(3, layers)))
    return dense_layers_by_type(f, layers)


def delta_attention(f: Fields, layers: tuple[int, ...]) -> DeltaNet:
    """The Kimi Delta Attention blocks, their decay bounded below by ``linear_lower_bound``."""
    heads, width = f.number("linear_num_heads"), f.number("linear_head_dim")
    bound = f.optional("linear_lower_bound")
    nested = f.raw.get("linear_attn_config")
    if nested is not None:  # transformers reads the nested bound first, and bounds a safe gate without one
        bound = nested.get("gate_lower_bound", bound)
        if bound is None and nested.get("safe_gate", True):
            bound = -5.0
    if bound is not None and not float(bound) < 0:
        raise f.refuse("linear_lower_bound", bound, "the decay's lower bound is negative (g within (bound, 0))")
    return DeltaNet(layers, heads, heads, width, width, f.number("linear_conv_kernel_dim"), channel_decay=True,
                    gate_rank=width, output_gate="sigmoid", norm_in_float32=True,
                    decay_lower_bound=None if bound is None else float(bound),
                    float32_params=("dt_bias", "A_log", "conv_q", "conv_k", "conv_v"))


def hyper_connections(f: Fields, head: str = "mean") -> HyperConnections:
    """The residual's streams and their Sinkhorn normalisation; ``head``: how the last block's streams
    become one (``HyperConnections.head``)."""
    streams, iterations = f.number("hc_mult"), f.number("hc_sinkhorn_iters")
    if streams < 2:
        raise f.refuse("hc_mult", streams, "hyper-connections have 2 or more streams")
    if iterations < 1:
        raise f.refuse("hc_sinkhorn_iters", iterations, "Sinkhorn normalises at least once")
    return HyperConnections(streams, iterations, f.number("hc_eps", float), f.number("rms_norm_eps", float), head)


def indexer(f: Fields, kinds: list[str]) -> Indexer:
    """The indexed attention blocks' pooled indexer; a ``shared`` one (``indexer_types``) must follow
    an indexed attention block with an indexer of its own, whose choice transformers hands to the
    next block only."""
    layers = len(kinds)
    types = indexer_types(f, layers)[:layers]
    if len(types) != layers or set(types) - {"full", "shared"}:
        raise f.refuse("indexer_types", types, f"one of full or shared for each of the {layers} blocks")
    shared = tuple(i for i, kind in enumerate(types) if kind == "shared" and kinds[i] == INDEXED)
    orphan = next((i for i in shared if i == 0 or kinds[i - 1] != INDEXED or i - 1 in shared), None)
    if orphan is not None:
        raise f.refuse("indexer_types", types, f"block {orphan} reuses a choice of keys, but the block before it is "
                       "no indexed attention block with an indexer of its own (transformers hands a choice to the "
                       "next block only)")
    pool, topk = f.number("index_kpool"), f.number("index_topk")
    if pool < 1 or topk < pool or topk % pool:
        raise f.refuse("index_kpool", pool, f"index_topk ({topk}) must be a positive multiple of the pool size")
    ix = Indexer(f.number("index_n_heads"), f.number("index_head_dim"), topk, shared_layers=shared, pool=pool,
                 pool_tail=bool(f.get("index_kpool_always_select_tail")))
    if min(ix.num_heads, ix.head_dim) < 1:
        raise f.refuse("index_n_heads", ix.num_heads, "the indexer's heads and their width must be positive")
    return ix
