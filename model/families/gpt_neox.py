"""GPT-NeoX and Pythia (``GPTNeoXForCausalLM``, model_type ``gpt_neox``): LayerNorm with a bias,
RoPE on the first ``rotary_pct`` of each head's dims (Pythia: 0.25), the parallel residual
``x + attn(ln1(x)) + mlp(ln2(x))`` (``use_parallel_residual``, on in every Pythia), the plain MLP
with the exact GELU, biases on every projection (``attention_bias`` on the attention's), an
untied head (``embed_out``). The hub's config.json gives ``rotary_pct`` and ``rotary_emb_base``;
transformers 5 writes them into ``rope_parameters``."""

from __future__ import annotations

from model.config import DecoderConfig
from model.families.common import Fields, activation, rope, rope_parameters, rotary_dim, shapes

ARCHITECTURES = ("GPTNeoXForCausalLM", "GPTNeoXModel")
# transformers' GPTNeoXConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=50432, hidden_size=6144, num_hidden_layers=44, num_attention_heads=64,
                intermediate_size=24576, hidden_act="gelu", max_position_embeddings=2048, layer_norm_eps=1e-5,
                tie_word_embeddings=False, use_parallel_residual=True, attention_bias=True,
                rotary_emb_base=10_000.0, rotary_pct=0.25)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "gpt_neox")
    config = shapes(f, "layer_norm_eps")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    if config["num_key_value_heads"] != heads:
        raise f.refuse("num_key_value_heads", config["num_key_value_heads"], "GPT-NeoX has one kv head per query head")
    if hidden % heads or config["head_dim"] != hidden // heads:
        raise f.refuse("head_dim" if raw.get("head_dim") else "num_attention_heads", raw.get("head_dim") or heads,
                       f"GPT-NeoX's heads split hidden_size {hidden} evenly")
    params, where = rope_parameters(f)
    # The hub's layout keeps both at the top level under their own names.
    params.setdefault("rope_theta", f.get("rotary_emb_base"))
    params.setdefault("partial_rotary_factor", f.get("rotary_pct"))
    bias = bool(f.get("attention_bias"))
    return DecoderConfig("gpt_neox", **config, rope=rope(f, params, where, f.get("rotary_emb_base"), partial=True),
                         rotary_dim=rotary_dim(f, params, where, config["head_dim"]), norm="layer",
                         parallel_residual=bool(f.get("use_parallel_residual")), gated_mlp=False,
                         qkv_bias=bias, o_bias=bias, mlp_bias=True,
                         hidden_act=activation(f, "hidden_act", ("gelu", "gelu_new", "gelu_pytorch_tanh")))
