"""DeepSeek-V4 (``DeepseekV4ForCausalLM``, model_type ``deepseek_v4``: V4-Flash, V4-Pro), as
transformers' ``DeepseekV4Model`` computes it: Llama-like blocks (a norm before each sublayer) whose
residual is **hyper-connections** (GLM-5-next's, ``hc_mult`` streams; the final norm reads their
weighted collapse, ``hc_head``), whose mixer is **DeepSeek-V4's attention**
(``model.config.CompressedAttention``: one key/value head through a sliding window, and on
``layer_types``' ``heavily_compressed_attention`` and ``compressed_sparse_attention`` blocks the
compressed entries of the whole past, every closed one or an indexer's ``index_topk``), and whose
MLP is a **mixture of experts** in every block: sqrt(softplus) scores, ``e_score_correction_bias``
added to choose ``num_experts_per_tok`` of them (or on ``mlp_layer_types``' ``hash_moe`` blocks the
experts a token's id gives, ``tid2eid``), the chosen scores renormalised (+ 1e-20) and times
``routed_scaling_factor``, the shared experts added ungated; every gate clamped to at most
``swiglu_limit`` and every up projection to within it.

Two rotaries: the sliding blocks' (``rope_parameters.main``, ``rope_theta``) and the compressed
blocks' and compressors' (``rope_parameters.compress``, ``compress_rope_theta``, YaRN with cos and
sin unscaled), each over the last ``qk_rope_head_dim`` of a head.

The hub's files (deepseek-ai/DeepSeek-V4-Flash, V4-Pro) are read as they are: their names (no
``model.``, ``embed.weight``, ``hc_head_fn``: ``model.params.DEEPSEEK_V4``), the attention's
projections, the indexer's ``wq_b`` and the shared expert block-FP8 (e4m3, an e8m0 ``.scale`` per
128 x 128 block) and the routed experts FP4 (``expert_dtype`` ``fp4``: e2m1 two a byte, an e8m0
``.scale`` per 32 values of a row; V4-Flash-Base's ``fp8``: block-FP8), dequantized at load as
transformers' ``Fp8Dequantize`` does (``model.fp8``, ``model.mxfp4``). ``quantization_config``: the
hub's (``fp8``, fmt ``e4m3``, ``scale_fmt`` ``ue8m0``, ``activation_scheme`` ``dynamic``,
``weight_block_size``); any other method, fmt, scale format, expert format or activation scheme is
refused in one line. The activations are not quantized (as transformers' dequantized model)."""

from __future__ import annotations

from typing import Any

from model import fp8
from model.config import CSA, HCA, SLIDING, SLIDING_ONLY, CompressedAttention, DecoderConfig, Indexer, MoE
from model.families.common import Fields, rope, shapes
from model.families.glm5_next import hyper_connections

ARCHITECTURES = ("DeepseekV4ForCausalLM",)
QUANTIZATIONS = ("fp8",)  # quantization_config methods read (block-FP8 and FP4 experts: model.fp8)
# What the hub's quantization_config may say, beside fmt and weight_block_size (model.fp8.block_size), as
# transformers' FineGrainedFP8Config accepts it: the scales' format (transformers' default float: float32
# scales), the routed experts' (fp4, or V4-Flash-Base's fp8; default fp8), activations quantized on the fly.
SCALE_FORMATS, EXPERT_FORMATS, ACTIVATION_SCHEMES = ("ue8m0", "float"), ("fp4", "fp8"), ("dynamic",)
# transformers' DeepseekV4Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
                num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024, num_experts_per_tok=6,
                n_routed_experts=256, n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True,
                routed_scaling_factor=1.5, max_position_embeddings=1048576, rope_theta=10000.0,
                compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
                sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128,
                index_topk=512, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
                partial_rotary_factor=64 / 512, attention_bias=False, mlp_bias=False)
RATES = {CSA: 4, HCA: 128}  # compress_rates' defaults
# The hub's per-block compress_ratios -> the kind each means (transformers' legacy reading).
RATIO_KINDS = {0: SLIDING_ONLY, 4: CSA, 128: HCA}


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "deepseek_v4")
    for key, value, why in (("hidden_act", f.get("hidden_act") != "silu", "the experts' activation is SiLU"),
                            ("scoring_func", f.get("scoring_func") != "sqrtsoftplus", "the router's scores are "
                             "sqrt(softplus) (transformers' others are no DeepSeek-V4 checkpoint's)"),
                            ("num_key_value_heads", f.number("num_key_value_heads") != 1, "one key/value head"),
                            ("attention_bias", bool(f.get("attention_bias")), "the projections have no bias"),
                            ("mlp_bias", bool(f.get("mlp_bias")), "the projections have no bias")):
        if value:
            raise f.refuse(key, f.raw.get(key), why)
    # transformers reads the shared expert's width as the intermediate size: the model has no dense MLP.
    config = shapes(Fields({**raw, "intermediate_size": f.get("moe_intermediate_size")}, DEFAULTS, f.family))
    layers = config["num_hidden_layers"]
    attention = compressed_attention(f, layers, config)
    moe = experts(f, layers)
    window = f.number("sliding_window")
    if window < 1:
        raise f.refuse("sliding_window", window, "every block attends through a window of 1 or more keys")
    main = rope(f, _rope_params(f, "main"), "rope_parameters.main", f.number("rope_theta", float), partial=True)
    return DecoderConfig(f.family, **config, rope=main, rotary_dim=attention.rope_dim, sliding_window=window,
                         layer_types=(SLIDING,) * layers, attention_sinks=True, norm_weight_in_float32=True,
                         moe=moe, compressed=attention,
                         hyper=hyper_connections(f, head="weighted"), swiglu_limit=f.number("swiglu_limit", float),
                         weight_block_size=quantized_blocks(f))


def quantized_blocks(f: Fields) -> tuple[int, int] | None:
    """The FP8 blocks of the hub's ``quantization_config`` (None where there is none); its other
    fields as the hub has them, else refused in one line naming the field. ``expert_dtype``: in
    ``quantization_config``, or beside it at the top level as the hub writes it (transformers moves
    it in)."""
    quantization = f.raw.get("quantization_config")
    if not quantization:
        return None
    block = fp8.block_size(quantization, f.refuse)
    in_config = "expert_dtype" in quantization
    experts = quantization.get("expert_dtype", f.raw.get("expert_dtype", "fp8"))
    for key, value, accepted, why in (
            ("quantization_config.scale_fmt", quantization.get("scale_fmt", "float"), SCALE_FORMATS,
             "the FP8 scales read are e8m0 powers of two (ue8m0) or floats"),
            ("quantization_config.expert_dtype" if in_config else "expert_dtype", experts, EXPERT_FORMATS,
             "the routed experts read are FP4 (e2m1 with e8m0 scales per 32 values) or block-FP8"),
            ("quantization_config.activation_scheme", quantization.get("activation_scheme", "dynamic"),
             ACTIVATION_SCHEMES, "the weights are dequantized; static activation scales are not read")):
        if value not in accepted:
            raise f.refuse(key, value, why)
    return block


def compressed_attention(f: Fields, layers: int, config: dict[str, Any]) -> CompressedAttention:
    """The attention's shapes, its blocks' kinds and compression rates, its rotaries and indexer."""
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    rope_dim = rotated_dims(f, head_dim)
    groups, rank = f.number("o_groups"), f.number("o_lora_rank")
    if groups < 1 or heads * head_dim % groups:
        raise f.refuse("o_groups", groups, f"the heads' outputs ({heads} x {head_dim}) split into equal groups")
    rates = {**RATES, **(f.raw.get("compress_rates") or {})}
    for key in ("compress_rate_csa", "compress_rate_hca"):  # the hub's names
        if f.raw.get(key) is not None:
            rates[CSA if key.endswith("csa") else HCA] = f.raw[key]
    if set(rates) != {CSA, HCA} or not all(isinstance(r, int) and r >= 1 for r in rates.values()):
        raise f.refuse("compress_rates", f.raw.get("compress_rates"), f"a positive whole rate for {CSA} and {HCA}")
    kinds = block_kinds(f, layers)
    ix = Indexer(f.number("index_n_heads"), f.number("index_head_dim"), f.number("index_topk"))
    for key, value in (("index_n_heads", ix.num_heads), ("index_topk", ix.topk), ("o_lora_rank", rank)):
        if value < 1:
            raise f.refuse(key, value, "a positive number")
    if ix.head_dim < rope_dim:
        raise f.refuse("index_head_dim", ix.head_dim, f"the indexer's heads rotate their last {rope_dim} dims")
    compress = rope(f, _rope_params(f, "compress"), "rope_parameters.compress", f.number("compress_rope_theta", float),
                    partial=True)
    return CompressedAttention(f.number("q_lora_rank"), rope_dim, groups, rank, tuple(kinds), rates[CSA], rates[HCA],
                               compress, ix)


def rotated_dims(f: Fields, head_dim: int) -> int:
    """The last dims of each head that rotate: head_dim x ``partial_rotary_factor``, or the hub's
    ``qk_rope_head_dim`` where no factor is given (as transformers reads them); both rotaries the same."""
    factor, legacy = f.raw.get("partial_rotary_factor"), f.raw.get("qk_rope_head_dim")
    dims = int(head_dim * float(factor)) if factor is not None else int(legacy) if legacy is not None else \
        int(head_dim * DEFAULTS["partial_rotary_factor"])
    if not 2 <= dims <= head_dim or dims % 2:
        raise f.refuse("partial_rotary_factor", factor if factor is not None else legacy, f"it rotates {dims} of "
                       f"head_dim {head_dim}: an even number of dims, at least 2")
    for kind in ("main", "compress"):  # transformers would rotate another share on that rotary's blocks
        params = (f.raw.get("rope_parameters") or {}).get(kind)
        own = params.get("partial_rotary_factor") if isinstance(params, dict) else None
        if own is not None and int(head_dim * float(own)) != dims:
            raise f.refuse(f"rope_parameters.{kind}.partial_rotary_factor", own, f"both rotaries rotate the same "
                           f"{dims} dims of each head")
    return dims


def block_kinds(f: Fields, layers: int) -> list[str]:
    """Each block's attention, as transformers reads it: ``layer_types``, else the hub's per-block
    ``compress_ratios`` (0, 4, 128), else two heavily compressed blocks then CSA and HCA in turn."""
    types = f.raw.get("layer_types")
    ratios = f.raw.get("compress_ratios")
    if types is None and ratios is not None:
        if not isinstance(ratios, list) or set(ratios) - set(RATIO_KINDS) or len(ratios) < layers:
            raise f.refuse("compress_ratios", ratios, f"one of {sorted(RATIO_KINDS)} for each of the {layers} blocks")
        types = [RATIO_KINDS[r] for r in ratios]
    if types is None:
        types = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    if not isinstance(types, list) or len(types) < layers or set(types[:layers]) - {SLIDING_ONLY, CSA, HCA}:
        raise f.refuse("layer_types", types, f"one of {SLIDING_ONLY}, {CSA} or {HCA} for each of the {layers} blocks")
    return types[:layers]


def experts(f: Fields, layers: int) -> MoE:
    """Every block's mixture of experts, hash-routed on ``mlp_layer_types``' ``hash_moe`` blocks
    (the hub's ``num_hash_layers``: the first ones; default 3)."""
    types = f.raw.get("mlp_layer_types")
    if types is None:
        hashed = f.raw.get("num_hash_layers")
        types = ["hash_moe"] * min(layers, 3 if hashed is None else int(hashed))
        types += ["moe"] * (layers - len(types))
    if not isinstance(types, list) or len(types) < layers or set(types[:layers]) - {"hash_moe", "moe"}:
        raise f.refuse("mlp_layer_types", types, f"one of hash_moe or moe for each of the {layers} blocks")
    count, k = f.number("n_routed_experts"), f.number("num_experts_per_tok")
    if not 0 < k <= count:
        raise f.refuse("num_experts_per_tok", k, f"a token's experts are 1 to the {count} experts")
    shared = f.number("n_shared_experts")
    if shared != 1:
        raise f.refuse("n_shared_experts", shared, "one shared expert, of moe_intermediate_size (transformers' "
                       "DeepseekV4MLP)")
    limit = f.number("swiglu_limit", float)
    return MoE(count, k, f.number("moe_intermediate_size"), normalize_top_k=True, weights_in_float32=True,
               shared_expert_size=f.number("moe_intermediate_size"), shared_expert_gate=False, scoring="sqrtsoftplus",
               hash_layers=tuple(i for i, kind in enumerate(types[:layers]) if kind == "hash_moe"),
               selection_bias=True, groups=1, routed_scaling=f.number("routed_scaling_factor", float),
               normalize_epsilon=1e-20, swiglu_limit=limit, swiglu_alpha=None)


def _rope_params(f: Fields, kind: str) -> dict[str, Any]:
    """One rotary's parameters (``main`` or ``compress``): transformers 5's nested ones, else the flat
    ``rope_parameters`` / ``rope_scaling`` that transformers applies to the compressed blocks alone
    (YaRN there with cos and sin unscaled)."""
    params = f.raw.get("rope_parameters") or {}
    if isinstance(params.get(kind), dict):
        return dict(params[kind])
    if kind == "main":
        return {}
    flat = {key: value for key, value in {**(f.raw.get("rope_scaling") or {}), **params}.items()
            if key not in ("main", "compress")}
    if (flat.get("rope_type") or flat.get("type")) == "yarn":
        flat.setdefault("attention_factor", 1.0)
    flat.pop("rope_theta", None)  # the compressed blocks' base is compress_rope_theta
    return flat
