"""Qwen4-Exp (``Qwen4ExpForCausalLM``, model_type ``qwen4_exp_text``), and the text model inside
``Qwen4ExpForConditionalGeneration`` (model_type ``qwen4_exp`` with a ``text_config``; the vision
tower is not read), as transformers' ``Qwen4ExpTextModel`` computes it: Qwen3.5-MoE's mixers and
experts in blocks without norms, around which the residual is

* a **gated residual** of ``hc_count`` streams (``model.config.HyperConnections`` kind gated): each
  sublayer reads the mean of the per-stream-normed streams gated per channel through a low rank
  (``hc_lowrank``), and its output is added to each stream with its own weight; a last such
  collapse (``hyper_connection_mixer``) is what the LM head reads, with no final norm;

and whose mixer is

* **Gated DeltaNet** on ``layer_types``' ``linear_attention`` blocks (Qwen3.5's; its output gate
  ``output_gate_type``, else ``hidden_act``), some (``ple_layer_ids``, 1-based) adding **hashed n-gram
  embeddings** to the streams first (``model.config.NGram``, ``model.ngram``);
* Qwen3.5's **gated attention** on the ``indexed_attention`` (or ``full_attention``) ones, with
  **QSA**: an indexer scoring pools of ``indexer_compress_ratio`` keys, each the mean of their raw
  index keys (``model.config.Indexer.mean_pool``), each query attending to its
  ``indexer_budget / indexer_compress_ratio`` best pools and the keys after its last whole pool.

Every block's MLP is the mixture of experts with a sigmoid-gated shared expert. RoPE rotates the
first ``partial_rotary_factor`` of each head (1 by default here, unlike Qwen3.5)."""

from __future__ import annotations

import dataclasses

from model.config import DecoderConfig, HyperConnections, Indexer, NGram
from model.families.common import (Fields, activation, mixture_of_experts, rope, rope_parameters, rotary_dim, shapes,
                                   untied_text_config)
from model.families.qwen3_5 import gated_deltanet

ARCHITECTURES = ("Qwen4ExpForCausalLM", "Qwen4ExpTextModel")
WRAPPER_ARCHITECTURES = ("Qwen4ExpForConditionalGeneration",)
LINEAR, INDEXED, FULL = "linear_attention", "indexed_attention", "full_attention"
INDEXER_KEYS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
# transformers' Qwen4ExpTextConfig defaults, for keys a config.json may leave out (intermediate_size: none, as
# every block's MLP is the experts).
DEFAULTS = dict(vocab_size=248_320, hidden_size=2048, intermediate_size=0, num_hidden_layers=40, num_attention_heads=16,
                num_key_value_heads=2, head_dim=256, hidden_act="silu", max_position_embeddings=32768,
                rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, rope_theta=10_000.0,
                linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
                shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512, norm_topk_prob=True,
                full_attention_interval=4, hc_count=4, hc_lowrank=320, ple_conv_kernel_size=4, ngram_size=3,
                heads_per_ngram=8, ngram_vocab_size_base=20_000_000, make_ngram_vocab_size_divisible_by=128,
                seed=1234, split_ngram_parts=512)


def decoder_config(raw: dict) -> DecoderConfig:
    if raw.get("model_type") == "qwen4_exp":  # the multimodal wrapper: its text model only
        raw = untied_text_config(raw, "qwen4_exp", "qwen4_exp_text")
    f = Fields(raw, DEFAULTS, "qwen4_exp")
    config = shapes(f)
    layers = config["num_hidden_layers"]
    kinds = layer_kinds(f, layers)
    params, where = rope_parameters(f)
    bias = bool(f.get("attention_bias"))
    deltanet = gated_deltanet(f, tuple(i for i, kind in enumerate(kinds) if kind == LINEAR))
    gate = f.raw.get("output_gate_type") or activation(f, "hidden_act")
    if gate not in ("sigmoid", "silu"):
        raise f.refuse("output_gate_type", gate, "the gated output norm's gate is sigmoid or silu")
    experts = mixture_of_experts(f, "moe_intermediate_size",
                                 shared_expert_size=f.number("shared_expert_intermediate_size"))
    return DecoderConfig(f.family, **config, rope=rope(f, params, where, f.get("rope_theta"), partial=True),
                         rotary_dim=rotary_dim(f, params, where, config["head_dim"], default=1.0),
                         qkv_bias=bias, o_bias=bias, qk_norm=True, norm_unit_offset=True, attn_output_gate=True,
                         pre_norms=False, final_norm=False, deltanet=dataclasses.replace(deltanet, output_gate=gate),
                         moe=experts, hidden_act=activation(f, "hidden_act"), hyper=gated_residual(f),
                         attention_indexer=indexer(f, config["head_dim"], params, where) if INDEXED in kinds else None,
                         ngram=ngram(f, kinds))


def layer_kinds(f: Fields, layers: int) -> list[str]:
    """Each block's mixer: ``layer_types``' (``full_attention`` read as ``indexed_attention``, as
    transformers renames it), else every ``full_attention_interval``-th block attention."""
    types = f.raw.get("layer_types")
    if types is None:
        interval = f.number("full_attention_interval")
        types = [LINEAR if (i + 1) % interval else INDEXED for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {LINEAR, INDEXED, FULL}:
        raise f.refuse("layer_types", types, f"expected {layers} entries of {LINEAR} or {INDEXED}")
    return [INDEXED if kind == FULL else kind for kind in types]


def gated_residual(f: Fields) -> HyperConnections:
    streams, rank = f.number("hc_count"), f.number("hc_lowrank")
    if streams < 2:
        raise f.refuse("hc_count", streams, "the gated residual has 2 or more streams")
    if rank < 1:
        raise f.refuse("hc_lowrank", rank, "the streams' gate needs a rank of at least 1")
    return HyperConnections(streams, norm_eps=f.number("rms_norm_eps", float), head="gated", kind="gated", rank=rank)


def indexer(f: Fields, head_dim: int, params: dict, where: str) -> Indexer:
    """The attention blocks' QSA indexer (transformers requires every ``indexer_*`` key where a block
    attends)."""
    for key in INDEXER_KEYS:
        if not isinstance(f.raw.get(key), int) or f.raw[key] < 1:
            raise f.refuse(key, f.raw.get(key), "a positive integer: the attention blocks' QSA indexer needs it")
    if f.raw["indexer_kv_heads"] != 1:
        raise f.refuse("indexer_kv_heads", f.raw["indexer_kv_heads"], "the indexer has one key head")
    ratio, budget = f.raw["indexer_compress_ratio"], f.raw["indexer_budget"]
    if budget % ratio:
        raise f.refuse("indexer_budget", budget, f"a multiple of indexer_compress_ratio {ratio}")
    rotated = rotary_dim(f, params, where, head_dim, default=1.0) or head_dim
    if rotated > f.raw["indexer_head_dim"]:
        raise f.refuse("indexer_head_dim", f.raw["indexer_head_dim"], f"at least the {rotated} dims RoPE rotates")
    return Indexer(f.raw["indexer_n_heads"], f.raw["indexer_head_dim"], budget, pool=ratio, pool_tail=True,
                   mean_pool=True)


def ngram(f: Fields, kinds: list[str]) -> NGram | None:
    """The blocks adding hashed n-gram embeddings (``ple_layer_ids``, 1-based, Gated DeltaNet blocks only)."""
    ids = f.raw.get("ple_layer_ids") or []
    if not isinstance(ids, list) or any(not isinstance(i, int) or not 1 <= i <= len(kinds) for i in ids):
        raise f.refuse("ple_layer_ids", ids, f"block numbers from 1 to {len(kinds)}")
    layers = tuple(sorted({i - 1 for i in ids}))
    if not layers:
        return None
    if any(kinds[i] != LINEAR for i in layers):
        raise f.refuse("ple_layer_ids", ids, "n-gram embeddings are added on linear_attention blocks only")
    eos = f.raw.get("eos_token_id")
    if not isinstance(eos, int):  # (a list: transformers' hashing needs one id)
        raise f.refuse("eos_token_id", eos, "one token id: it ends an n-gram's segment")
    order, per_order = f.number("ngram_size"), f.number("heads_per_ngram")
    width = f.raw.get("ple_embed_dim") or f.number("hidden_size")
    if order < 2 or per_order < 1 or width % ((order - 1) * per_order):
        raise f.refuse("ple_embed_dim", width, f"a multiple of (ngram_size - 1) x heads_per_ngram "
                       f"({order - 1} x {per_order}), ngram_size at least 2")
    return NGram(layers, width, order, per_order, f.number("ple_conv_kernel_size"), f.number("ngram_vocab_size_base"),
                 f.number("make_ngram_vocab_size_divisible_by"), f.number("seed"), eos, f.number("split_ngram_parts"))
