"""OLMo hybrid (``OlmoHybridForCausalLM``, model_type ``olmo_hybrid``: Olmo-Hybrid-7B): Gated
DeltaNet blocks (``layer_types``' ``linear_attention``; by default three of four) beside OLMo 2's
attention blocks (``model.families.olmo2``: no norm before attention or the MLP, one after each,
q and k RMS-normed over the whole projection, the norm weight applied in float32). A null
``rope_theta`` (the released checkpoint's) turns RoPE off: no block rotates (NoPE).

The DeltaNet blocks are Llama-like: norms before the mixer and the MLP, none after
(``DeltaNet.pre_norm_blocks``). Their mixer is Qwen3.5's (``model.config.DeltaNet``) with q, k, v,
the output gate (``g_proj``, our ``z``), a and b projected apart, one convolution over q | k | v,
beta = 2 sigmoid(b) where ``linear_allow_neg_eigval`` (the default: the delta rule's eigenvalues
may be negative) and the gated output norm's epsilon fixed at 1e-5. The convolution's and the
MLP's activation is ``hidden_act``: SiLU only."""

from __future__ import annotations

from model.config import DecoderConfig, DeltaNet
from model.families.common import Fields, rope, rope_parameters, shapes
from model.families.olmo2 import olmo2_switches
from model.families.qwen3_5 import FULL_ATTENTION, LINEAR

ARCHITECTURES = ("OlmoHybridForCausalLM", "OlmoHybridModel")
# transformers' OlmoHybridConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=100_352, hidden_size=3840, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=30, hidden_act="silu", max_position_embeddings=65536, rms_norm_eps=1e-6,
                tie_word_embeddings=False, attention_bias=False, rope_theta=10_000.0, linear_conv_kernel_dim=4,
                linear_allow_neg_eigval=True)
OUTPUT_NORM_EPS = 1e-5  # transformers builds the DeltaNet's gated output norm with it, whatever rms_norm_eps


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "olmo_hybrid")
    config = shapes(f)
    params, where = rope_parameters(f)
    switches = olmo2_switches(f)
    if switches["hidden_act"] != "silu":  # the DeltaNet convolution's activation too
        raise f.refuse("hidden_act", switches["hidden_act"], "the DeltaNet convolution's activation is SiLU here")
    theta = rope_theta(f, params)
    nope = tuple(range(config["num_hidden_layers"])) if theta is None else ()  # no block rotates
    return DecoderConfig("olmo_hybrid", **config, rope=rope(f, params, where, theta or DEFAULTS["rope_theta"]),
                         nope_layers=nope, deltanet=deltanet(f, config), **switches)


def rope_theta(f: Fields, params: dict) -> float | None:
    """The RoPE base, as transformers reads it: a null one (Olmo-Hybrid-7B's, given in the RoPE
    parameters or at the top level) means no rotation at all; absent, the default."""
    if "rope_theta" in params:
        return params["rope_theta"]
    return f.raw["rope_theta"] if "rope_theta" in f.raw else DEFAULTS["rope_theta"]


def deltanet(f: Fields, config: dict) -> DeltaNet:
    """The DeltaNet blocks and their mixer's shapes, with transformers' defaults: as many key and
    value heads as attention heads, keys of 0.75 hidden / key heads, values twice as wide."""
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    keys = int(f.get("linear_num_key_heads") or config["num_attention_heads"])
    values = int(f.get("linear_num_value_heads") or config["num_attention_heads"])
    if keys < 1 or values % keys:
        raise f.refuse("linear_num_value_heads", values, f"a multiple of linear_num_key_heads {keys} is needed")
    key_dim = int(f.get("linear_key_head_dim") or int(0.75 * hidden / keys))
    value_dim = int(f.get("linear_value_head_dim") or 2 * key_dim)
    return DeltaNet(linear_layers(f, n), keys, values, key_dim, value_dim, f.number("linear_conv_kernel_dim"),
                    beta_scale=2.0 if f.get("linear_allow_neg_eigval") else 1.0, norm_eps=OUTPUT_NORM_EPS,
                    pre_norm_blocks=True)


def linear_layers(f: Fields, num_layers: int) -> tuple[int, ...]:
    """The DeltaNet blocks: ``layer_types``' ``linear_attention`` ones, else every block but each
    fourth (and the last, where that leaves no attention block). At least one of each kind."""
    types = f.raw.get("layer_types")
    if types is not None and not isinstance(types, list):
        raise f.refuse("layer_types", types, f"expected a list of {LINEAR} or {FULL_ATTENTION}")
    if types is None:
        types = [FULL_ATTENTION if i % 4 == 3 else LINEAR for i in range(num_layers)]
        if FULL_ATTENTION not in types:
            types[-1] = FULL_ATTENTION
    if len(types) != num_layers or set(types) - {LINEAR, FULL_ATTENTION} or len(set(types)) < 2:
        raise f.refuse("layer_types", types, f"expected {num_layers} entries of {LINEAR} or {FULL_ATTENTION}, "
                       "each kind at least once")
    return tuple(i for i, kind in enumerate(types) if kind == LINEAR)
