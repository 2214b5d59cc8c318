"""Falcon-H1 (``FalconH1ForCausalLM``, model_type ``falcon_h1``: Falcon-H1-0.5B to 34B, Falcon-H1R):
in every block attention (RoPE) and a Mamba-2 mixer (``model.config.Mamba2`` with ``parallel``) read
the same normed input and their outputs are added, then a gated MLP; Falcon's μP multipliers
(``model.config.Multipliers``): attention's input, keys and output, the Mamba-2 mixer's input, the
five parts of its ``in_proj`` output (``ssm_multipliers``) and its output, the MLP's gate and output,
the embeddings and the logits. The Mamba-2 mixer's width is ``mamba_d_ssm`` (else ``mamba_expand``
x hidden_size); its gated norm only where ``mamba_rms_norm`` (normalising before the gate where
``mamba_norm_before_gate``), else its output times SiLU(z) alone. The convolution's and the MLP's
activation is ``hidden_act``: SiLU only."""

from __future__ import annotations

from model.config import DecoderConfig, Mamba2, Multipliers
from model.families.common import Fields, activation, rope, rope_parameters, shapes, time_step_limit

ARCHITECTURES = ("FalconH1ForCausalLM", "FalconH1Model")
# transformers' FalconH1Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=128000, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                rms_norm_eps=1e-5, max_position_embeddings=8192, mamba_d_ssm=1024, mamba_n_heads=128,
                mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2,
                mamba_conv_bias=True, mamba_proj_bias=False, mamba_norm_before_gate=True, mamba_rms_norm=False,
                projectors_bias=False, lm_head_multiplier=1.0, embedding_multiplier=1.0, key_multiplier=1.0,
                attention_out_multiplier=1.0, attention_in_multiplier=1.0, ssm_in_multiplier=1.0,
                ssm_out_multiplier=1.0, attention_bias=False, mlp_bias=False, rope_theta=10_000.0)


def decoder_config(raw: dict) -> DecoderConfig:
    if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None:  # transformers: one per query head
        raw = {**raw, "num_key_value_heads": raw.get("num_attention_heads") or DEFAULTS["num_attention_heads"]}
    f = Fields(raw, DEFAULTS, "falcon_h1")
    act = activation(f, "hidden_act")
    if act != "silu":  # the Mamba-2 convolution's activation too
        raise f.refuse("hidden_act", act, "the Mamba-2 convolution's activation is SiLU here")
    config = shapes(f)
    params, where = rope_parameters(f)
    bias = bool(f.get("attention_bias"))
    return DecoderConfig("falcon_h1", **config, rope=rope(f, params, where, f.get("rope_theta")),
                         mamba=mamba(f, config), multipliers=multipliers(f), qkv_bias=bias, o_bias=bias,
                         mlp_bias=bool(f.get("mlp_bias")), hidden_act=act,
                         embedding_multiplier=f.number("embedding_multiplier", float))


def mamba(f: Fields, config: dict) -> Mamba2:
    """The Mamba-2 mixer beside attention in every block: ``mamba_n_heads`` over ``mamba_d_ssm``
    channels (``mamba_d_head`` "auto": that width over the heads)."""
    inner = f.optional("mamba_d_ssm") or f.number("mamba_expand") * config["hidden_size"]  # null: the expansion
    heads, groups = f.number("mamba_n_heads"), f.number("mamba_n_groups")
    head_dim = inner // heads if f.get("mamba_d_head") == "auto" else f.number("mamba_d_head")
    if heads < 1 or head_dim * heads != inner:
        raise f.refuse("mamba_n_heads", heads, f"the Mamba-2 width ({inner}) must be its heads x mamba_d_head")
    if groups < 1 or heads % groups:
        raise f.refuse("mamba_n_groups", groups, f"it must divide mamba_n_heads ({heads})")
    if bool(f.get("mamba_proj_bias")) != bool(f.get("projectors_bias")):
        raise f.refuse("projectors_bias", f.get("projectors_bias"), "in_proj's bias (mamba_proj_bias) and "
                       "out_proj's are read as one switch: both or neither")
    projection = f.raw.get("ssm_multipliers") or [1.0] * 5
    if not isinstance(projection, list) or len(projection) != 5:
        raise f.refuse("ssm_multipliers", projection, "five numbers: z, x, B, C and dt's")
    return Mamba2(tuple(range(config["num_hidden_layers"])), heads, head_dim, f.number("mamba_d_state"), groups,
                  f.number("mamba_d_conv"), conv_bias=bool(f.get("mamba_conv_bias")),
                  proj_bias=bool(f.get("mamba_proj_bias")), time_step_limit=time_step_limit(f), parallel=True,
                  gated_norm=bool(f.get("mamba_rms_norm")), norm_before_gate=bool(f.get("mamba_norm_before_gate")),
                  projection_multipliers=tuple(map(float, projection)))


def multipliers(f: Fields) -> Multipliers:
    """Falcon's μP multipliers, each a number (``mlp_multipliers``: the gate's, the output's)."""
    mlp = f.raw.get("mlp_multipliers") or [1.0, 1.0]
    if not isinstance(mlp, list) or len(mlp) != 2:
        raise f.refuse("mlp_multipliers", mlp, "two numbers: the gate's and the output's")
    number = lambda key: f.number(key, float)
    return Multipliers(attention_in=number("attention_in_multiplier"), attention_out=number("attention_out_multiplier"),
                       key=number("key_multiplier"), ssm_in=number("ssm_in_multiplier"),
                       ssm_out=number("ssm_out_multiplier"), mlp_gate=float(mlp[0]), mlp_down=float(mlp[1]),
                       lm_head=number("lm_head_multiplier"))
