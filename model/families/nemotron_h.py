"""Nemotron-H (``NemotronHForCausalLM``, model_type ``nemotron_h``: NVIDIA-Nemotron-3-Nano,
Nemotron-H 8B/47B/56B, Nemotron-Nano-9B-v2): blocks of one sublayer each (``DecoderConfig.sublayers``),
``x + mixer(norm(x))``, the mixer by ``layers_block_type`` (the released configs'
``hybrid_override_pattern``, one letter a block): a Mamba-2 mixer (``linear_attention``, ``M``),
attention without positions (``full_attention``, ``*``: no RoPE, no biases whatever
``attention_bias`` says, as transformers builds it), a plain MLP of ``intermediate_size``
(``mlp``, ``-``: down(act(up(x))), ``mlp_hidden_act`` the squared ReLU), or a mixture of plain
experts (``moe``, ``E``) routed as DeepSeek-V3's (sigmoid scores plus a choice bias, within the
best groups, times ``routed_scaling_factor``) beside an always-added plain shared MLP of
``moe_shared_expert_intermediate_size``; where ``moe_latent_size`` is set (Nemotron 3 Super), the
routed experts work in a latent of that width, x projected down before them and their weighted
sum back up after (``fc1_latent_proj``, ``fc2_latent_proj``). The norms multiply their weight in float32. The Mamba-2
time step is clamped below at ``time_step_min`` over a sequence (transformers' ``time_step_limit``
is not read) and, as in transformers' decoding step, not while decoding. Multi-token prediction
layers (``num_nextn_predict_layers``) are not read, as transformers does not."""

from __future__ import annotations

import math

from model.config import MIXER_ONLY, MLP_ONLY, DecoderConfig, Mamba2
from model.families.common import Fields, activation, shapes
from model.families.deepseek_v3 import grouped_moe

ARCHITECTURES = ("NemotronHForCausalLM", "NemotronHModel")
MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}  # hybrid_override_pattern's letters
# transformers' NemotronHConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=131072, hidden_size=4096, tie_word_embeddings=False, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, intermediate_size=21504,
                mlp_hidden_act="relu2", mlp_bias=False, ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64,
                mamba_hidden_act="silu", n_groups=8, conv_kernel=4, time_step_min=0.001, use_conv_bias=True,
                n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=7688,
                moe_shared_expert_intermediate_size=7688, num_experts_per_tok=2, routed_scaling_factor=1.0,
                n_group=1, topk_group=1, norm_topk_prob=True, use_bias=False, layer_norm_epsilon=1e-5)
LEGACY_KINDS = {"mamba": MAMBA, "attention": ATTENTION}
# The released configs' older names (transformers' NemotronHConfig reads them as the new ones).
LEGACY_NAMES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_min": "time_step_min",
                "mamba_conv_bias": "use_conv_bias"}


def decoder_config(raw: dict) -> DecoderConfig:
    raw = {**raw, **{new: raw[old] for old, new in LEGACY_NAMES.items() if old in raw}}  # the older name wins
    types = block_types(raw)
    f = Fields({**raw, "num_hidden_layers": len(types)}, DEFAULTS, "nemotron_h")
    mixer_act = f.get("mamba_hidden_act")
    if mixer_act != "silu":
        raise f.refuse("mamba_hidden_act", mixer_act, "the Mamba-2 convolution's activation is SiLU here")
    config = shapes(f, eps_key="layer_norm_epsilon")
    where = lambda kind: tuple(i for i, t in enumerate(types) if t == kind)
    moe = None
    if where(MOE):
        moe = grouped_moe(f, where(MLP), scoring="sigmoid", selection_bias=True, group_score="top2",
                          normalize_top_k=bool(f.get("norm_topk_prob")), normalize_epsilon=1e-20,
                          shared_expert_size=f.number("moe_shared_expert_intermediate_size"),
                          latent_size=latent_size(f))
    sublayers = tuple(MIXER_ONLY if kind in (MAMBA, ATTENTION) else MLP_ONLY for kind in types)
    return DecoderConfig("nemotron_h", **config, rope=None, nope_layers=tuple(range(len(types))),
                         mamba=mamba(f, where(MAMBA)), moe=moe, sublayers=sublayers, gated_mlp=False,
                         mlp_bias=bool(f.get("mlp_bias")), hidden_act=activation(f, "mlp_hidden_act"),
                         norm_weight_in_float32=True)


def latent_size(f: Fields) -> int | None:
    """The width the experts work in (``moe_latent_size``: Nemotron 3 Super's), or None: x's."""
    size = f.get("moe_latent_size")
    if size is not None and (not isinstance(size, int) or size < 1):
        raise f.refuse("moe_latent_size", size, "a positive width (or null: the experts read x)")
    return size


def block_types(raw: dict) -> list[str]:
    """Each block's kind: ``layers_block_type`` (or ``layer_types``), else the letters of
    ``hybrid_override_pattern``; absent, transformers' default (one of each)."""
    types = raw.get("layers_block_type") or raw.get("layer_types")
    pattern = raw.get("hybrid_override_pattern")
    f = Fields(raw, DEFAULTS, "nemotron_h")
    if types is None and pattern is not None:
        if not isinstance(pattern, str) or set(pattern) - set(PATTERN):
            raise f.refuse("hybrid_override_pattern", pattern, f"expected letters of {''.join(PATTERN)}")
        types = [PATTERN[letter] for letter in pattern]
    types = [MAMBA, MOE, ATTENTION, MLP] if types is None else types
    if isinstance(types, list):  # the older kind names, as transformers renames them when it reads a config
        types = [LEGACY_KINDS.get(kind, kind) for kind in types]
    if not isinstance(types, list) or not types or set(types) - set(PATTERN.values()):
        raise f.refuse("layers_block_type", types, f"expected a list of {', '.join(PATTERN.values())}")
    return types


def mamba(f: Fields, layers: tuple[int, ...]) -> Mamba2 | None:
    """The Mamba-2 blocks' mixer: ``mamba_num_heads`` of ``mamba_head_dim`` (its width is theirs,
    not ``expand`` x hidden_size), B and C in ``n_groups`` of ``ssm_state_size``, the time step at
    least ``time_step_min``."""
    if not layers:
        return None
    heads, groups = f.number("mamba_num_heads"), f.number("n_groups")
    if heads < 1 or f.number("mamba_head_dim") < 1:
        raise f.refuse("mamba_num_heads", heads, "the Mamba-2 mixer needs heads of a positive width")
    if groups < 1 or heads % groups:
        raise f.refuse("n_groups", groups, f"it must divide mamba_num_heads ({heads})")
    return Mamba2(layers, heads, f.number("mamba_head_dim"), f.number("ssm_state_size"), groups,
                  f.number("conv_kernel"), conv_bias=bool(f.get("use_conv_bias")), proj_bias=bool(f.get("use_bias")),
                  time_step_limit=(f.number("time_step_min", float), math.inf))
