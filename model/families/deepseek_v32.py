"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``, model_type ``deepseek_v32``) and GLM-5's mixture of
experts (``GlmMoeDsaForCausalLM``, model_type ``glm_moe_dsa``): DeepSeek-V3's decoder
(``model.families.deepseek_v3``: latent attention with a low-rank query, its rotated dims
interleaved, YaRN; the biased sigmoid router in groups, shared experts, dense blocks by
``mlp_layer_types``, else the first ``first_k_dense_replace``) with DeepSeek sparse attention in
every block: a lightning indexer (``index_n_heads`` heads of ``index_head_dim``) chooses each
query's ``index_topk`` keys (``model.config.Indexer``, ``model.indexer``). GLM-5's indexer pairs
its rotated dims interleaved (reordered at load time); its ``shared`` blocks (``indexer_types``)
have no indexer and reuse the last full block's choice (``Indexer.shared_layers``). transformers 5
holds their experts stacked."""

from __future__ import annotations

import dataclasses

from model.config import DecoderConfig, Indexer
from model.families.common import Fields
from model.families.deepseek_v3 import DEFAULTS as V3_DEFAULTS
from model.families.deepseek_v3 import dense_layers_by_type, grouped_moe, latent_decoder

ARCHITECTURES = ("DeepseekV32ForCausalLM", "DeepseekV32Model")
GLM5_ARCHITECTURES = ("GlmMoeDsaForCausalLM", "GlmMoeDsaModel")
QUANTIZATIONS = ("fp8",)  # quantization_config methods read (block-FP8: model.fp8)
# transformers' DeepseekV32Config defaults, where they differ from V3's.
DEFAULTS = {**V3_DEFAULTS, **dict(max_position_embeddings=163840, index_topk=2048, index_head_dim=128,
                                  index_n_heads=64)}
# transformers' GlmMoeDsaConfig's.
GLM5_DEFAULTS = {**DEFAULTS, **dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288,
                                    moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64,
                                    n_routed_experts=256, q_lora_rank=2048, v_head_dim=256, qk_nope_head_dim=192,
                                    n_group=1, topk_group=1, max_position_embeddings=202752, rms_norm_eps=1e-5,
                                    index_n_heads=32)}


def decoder_config(raw: dict) -> DecoderConfig:
    glm = raw.get("model_type") == "glm_moe_dsa"
    f = Fields(raw, GLM5_DEFAULTS if glm else DEFAULTS, "glm_moe_dsa" if glm else "deepseek_v32")
    layers = f.number("num_hidden_layers")
    types = f.raw.get("mlp_layer_types")
    dense = dense_layers_by_type(f, layers) if types else range(min(f.number("first_k_dense_replace"), layers))
    moe = grouped_moe(f, dense, scoring="sigmoid", selection_bias=True, group_score="top2",
                      normalize_top_k=bool(f.optional("norm_topk_prob")), normalize_epsilon=1e-20)
    config = latent_decoder(f, moe, interleave=True, rope_in_float32=False)  # both always pair them so
    if not config.mla.q_lora_rank:
        raise f.refuse("q_lora_rank", f.raw.get("q_lora_rank"), "the indexer reads the low-rank query")
    kinds = indexer_types(f, layers)[:layers] if glm else ["full"] * layers  # (transformers reads the first N)
    if len(kinds) != layers or set(kinds) - {"full", "shared"} or kinds[0] != "full":
        raise f.refuse("indexer_types", kinds, f"one of full or shared for each of the {layers} blocks, the first "
                       "full (a shared block reuses the last full block's choice of keys)")
    indexer = Indexer(f.number("index_n_heads"), f.number("index_head_dim"), f.number("index_topk"),
                      rope_interleave=glm, shared_layers=tuple(i for i, kind in enumerate(kinds) if kind == "shared"))
    if indexer.head_dim < config.mla.qk_rope_head_dim or min(indexer.num_heads, indexer.topk) < 1:
        raise f.refuse("index_head_dim", indexer.head_dim, f"the indexer rotates its first qk_rope_head_dim "
                       f"({config.mla.qk_rope_head_dim}) dims; heads and top-k must be positive")
    return dataclasses.replace(config, mla=dataclasses.replace(config.mla, indexer=indexer))


def indexer_types(f: Fields, layers: int) -> list[str]:
    """GLM-5's per-block indexer (``full``: its own; ``shared``: an earlier block's choice), as
    transformers reads it: ``indexer_types``, else ``index_topk_pattern`` (F / S), else every block
    from ``index_skip_topk_offset`` on whose distance to it ``index_topk_freq`` divides is full."""
    given = f.raw.get("indexer_types")
    if given is not None:
        return list(given)
    pattern = f.raw.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    offset = f.raw.get("index_skip_topk_offset")
    freq, offset = max(int(f.raw.get("index_topk_freq") or 1), 1), 2 if offset is None else int(offset)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
