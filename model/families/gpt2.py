"""GPT-2 (``GPT2LMHeadModel``, model_type ``gpt2``): learned absolute positions added to the token
embeddings, LayerNorm with a bias before each sublayer, biases on every projection, the plain MLP
with the tanh GELU (``gelu_new``), a tied head. config.json names its sizes its own way (``n_embd``,
``n_layer``, ``n_head``, ``n_positions``, ``n_inner``)."""

from __future__ import annotations

from model.config import DecoderConfig
from model.families.common import Fields, activation, refuse_if_set, shapes

ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
# transformers' GPT2Config defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
                tie_word_embeddings=True)
# GPT-2's names for the sizes every family reads.
RENAMED = dict(hidden_size="n_embd", num_hidden_layers="n_layer", num_attention_heads="n_head",
               max_position_embeddings="n_positions")


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "gpt2")
    refuse_if_set(f, "scale_attn_by_inverse_layer_idx", "attention scores divided by the layer index are not "
                  "implemented")
    refuse_if_set(f, "reorder_and_upcast_attn", "the upcast attention is not implemented")
    refuse_if_set(f, "add_cross_attention", "only a decoder without cross-attention is implemented")
    if not f.get("scale_attn_weights"):
        raise f.refuse("scale_attn_weights", raw["scale_attn_weights"], "unscaled attention is not implemented")
    # transformers takes the common names as aliases of GPT-2's own (its attribute_map).
    names = {ours: f.number(theirs if raw.get(theirs) is not None or raw.get(ours) is None else ours)
             for ours, theirs in RENAMED.items()}
    hidden, heads = names["hidden_size"], names["num_attention_heads"]
    if heads < 1 or hidden % heads or raw.get("head_dim") not in (None, hidden // heads):
        raise f.refuse("n_head", heads, f"GPT-2's heads split n_embd {hidden} evenly")
    sizes = Fields({**raw, **names, "intermediate_size": f.get("n_inner") or 4 * hidden,
                    "num_key_value_heads": names["num_attention_heads"]}, DEFAULTS, "gpt2")
    return DecoderConfig("gpt2", **shapes(sizes, "layer_norm_epsilon"), rope=None, positions="learned",
                         norm="layer", gated_mlp=False, qkv_bias=True, o_bias=True, mlp_bias=True,
                         hidden_act=activation(f, "activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu")))
