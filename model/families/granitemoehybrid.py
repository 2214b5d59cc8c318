"""Granite 4 (``GraniteMoeHybridForCausalLM``, model_type ``granitemoehybrid``: granite-4.0-h-tiny,
-small, -micro): Mamba-2 mixers (``model.config.Mamba2``) on the ``linear_attention`` blocks of
``layer_types`` (``mamba`` in the released configs) and attention on the ``full_attention``
(``attention``) ones, each followed by a mixture of
``num_local_experts`` experts of ``intermediate_size`` (the top ``num_experts_per_tok`` logits
softmaxed, as gpt-oss's) plus the always-added ``shared_mlp`` of ``shared_intermediate_size``, or
by the shared MLP alone without experts. Granite's scalings: the embeddings times
``embedding_multiplier``, what each sublayer adds times ``residual_multiplier``, the attention
scores times ``attention_multiplier`` (in place of 1/sqrt(head_dim)), the logits divided by
``logits_scaling``. RoPE only where ``position_embedding_type`` is ``rope`` (the released models:
none). The convolution's and the MLPs' activation is ``hidden_act``: SiLU only."""

from __future__ import annotations

from model.config import DecoderConfig, Mamba2, MoE
from model.families.common import Fields, activation, rope, rope_parameters, shapes, time_step_limit

ARCHITECTURES = ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridModel")
MAMBA, ATTENTION = "linear_attention", "full_attention"
LEGACY_NAMES = {"mamba": MAMBA, "attention": ATTENTION}  # as transformers renames them when it reads a config
# transformers' GraniteMoeHybridConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
                tie_word_embeddings=False, attention_bias=False, embedding_multiplier=1.0, logits_scaling=1.0,
                residual_multiplier=1.0, attention_multiplier=1.0, num_local_experts=8, num_experts_per_tok=2,
                shared_intermediate_size=1024, mamba_n_heads=128, mamba_n_groups=1, mamba_d_state=256,
                mamba_d_head="auto", mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False,
                rope_theta=10_000.0)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "granitemoehybrid")
    if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None:  # transformers: one per query head
        raw = {**raw, "num_key_value_heads": raw.get("num_attention_heads") or DEFAULTS["num_attention_heads"]}
        f = Fields(raw, DEFAULTS, "granitemoehybrid")
    config = {**shapes(f), "intermediate_size": f.number("shared_intermediate_size")}
    act = activation(f, "hidden_act")
    if act != "silu":  # the Mamba-2 convolution's activation too
        raise f.refuse("hidden_act", act, "the Mamba-2 convolution's activation is SiLU here")
    n = config["num_hidden_layers"]
    kind = f.get("position_embedding_type")
    if kind not in (None, "rope", "nope"):
        raise f.refuse("position_embedding_type", kind, "rope or none are read")
    params, where = rope_parameters(f)
    multiplier = f.number("attention_multiplier", float)
    if multiplier <= 0:
        raise f.refuse("attention_multiplier", multiplier, "the scores' scale must be positive")
    return DecoderConfig("granitemoehybrid", **config, rope=rope(f, params, where, f.get("rope_theta")),
                         nope_layers=() if kind == "rope" else tuple(range(n)), mamba=mamba(f, config),
                         moe=experts(f, config), qkv_bias=bool(f.get("attention_bias")),
                         o_bias=bool(f.get("attention_bias")), query_pre_attn_scalar=multiplier ** -2,
                         embedding_multiplier=f.number("embedding_multiplier", float),
                         residual_multiplier=f.number("residual_multiplier", float),
                         logits_scaling=f.number("logits_scaling", float), hidden_act=act)


def mamba_layers(f: Fields, num_layers: int) -> tuple[int, ...]:
    """The Mamba-2 blocks: ``layer_types``' (or ``layers_block_type``'s) ``linear_attention``
    entries; absent, every block (transformers' default)."""
    types = f.raw.get("layer_types") or f.raw.get("layers_block_type") or [MAMBA] * num_layers
    if not isinstance(types, list):
        raise f.refuse("layer_types", types, f"expected a list of {MAMBA} or {ATTENTION}")
    types = [LEGACY_NAMES.get(kind, kind) for kind in types]  # the released configs' mamba / attention
    if len(types) != num_layers or set(types) - {MAMBA, ATTENTION}:
        raise f.refuse("layer_types", types, f"expected {num_layers} entries of {MAMBA} or {ATTENTION}")
    return tuple(i for i, kind in enumerate(types) if kind == MAMBA)


def mamba(f: Fields, config: dict) -> Mamba2:
    """The Mamba-2 blocks and their mixer's shapes (``mamba_d_head`` "auto": the expanded width
    over the heads)."""
    heads, groups = f.number("mamba_n_heads"), f.number("mamba_n_groups")
    inner = f.number("mamba_expand") * config["hidden_size"]
    head_dim = inner // heads if f.get("mamba_d_head") == "auto" else f.number("mamba_d_head")
    if heads < 1 or head_dim * heads != inner:
        raise f.refuse("mamba_n_heads", heads, f"mamba_expand x hidden_size ({inner}) must be its heads x mamba_d_head")
    if groups < 1 or heads % groups:
        raise f.refuse("mamba_n_groups", groups, f"it must divide mamba_n_heads ({heads})")
    return Mamba2(mamba_layers(f, config["num_hidden_layers"]), heads, head_dim, f.number("mamba_d_state"), groups,
                  f.number("mamba_d_conv"), conv_bias=bool(f.get("mamba_conv_bias")),
                  proj_bias=bool(f.get("mamba_proj_bias")), time_step_limit=time_step_limit(f))


def experts(f: Fields, config: dict) -> MoE | None:
    """The mixture of experts beside the shared MLP (None without experts: the shared MLP alone)."""
    count = f.number("num_local_experts")
    if count == 0:
        return None
    k = f.number("num_experts_per_tok")
    if not 0 < k <= count:
        raise f.refuse("num_experts_per_tok", k, f"a token's experts are 1 to num_local_experts ({count})")
    return MoE(count, k, f.number("intermediate_size"), normalize_top_k=False, top_k_before_softmax=True,
               shared_expert_size=config["intermediate_size"], shared_expert_gate=False)
