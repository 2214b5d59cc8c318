"""gpt-oss (``GptOssForCausalLM``, model_type ``gpt_oss``: gpt-oss-20b and 120b), as transformers'
``GptOssModel`` computes it, through the switches of ``model.config``:

* attention with biases on q, k, v and o, a sliding window on every other layer (``layer_types``,
  ``sliding_window``), and per head a learned **sink**: a logit joined to each query's softmax
  and dropped after (``DecoderConfig.attention_sinks``);
* **YaRN** RoPE (``rope_parameters``; transformers' default: factor 32 over 4096 positions, the
  ramp not truncated);
* RMSNorms scaling in float32 (``norm_weight_in_float32``);
* every block's MLP a mixture of ``num_local_experts`` experts of ``intermediate_size``
  (``model.config.MoE``): a router with a bias whose ``num_experts_per_tok`` largest logits are
  chosen first and softmaxed (``top_k_before_softmax``), experts with biases and the clamped
  SwiGLU (``swiglu_limit``, ``swiglu_alpha``), their ``gate_up_proj`` columns interleaved (gate,
  up, gate, ...) and taken apart at load time.

The hub's checkpoints hold the experts in MXFP4 (``quantization_config``: ``mxfp4``;
``*_blocks`` and ``*_scales`` tensors), dequantized exactly at load time (``model.mxfp4``), as are
checkpoints saved dequantized."""

from __future__ import annotations

from model.config import FULL, SLIDING, DecoderConfig, MoE
from model.families.common import Fields, layer_types, rope, rope_parameters, shapes, sliding_window

ARCHITECTURES = ("GptOssForCausalLM", "GptOssModel")
QUANTIZATIONS = ("mxfp4",)  # quantization_config methods read (the experts' weights only: model.mxfp4)
# transformers' GptOssConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(vocab_size=201_088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                num_attention_heads=64, num_key_value_heads=8, head_dim=64, max_position_embeddings=131_072,
                rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=128, attention_bias=True,
                num_local_experts=128, num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0,
                rope_theta=150_000.0)
DEFAULT_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "gpt_oss")
    config = shapes(f)
    n = config["num_hidden_layers"]
    window = sliding_window(f)
    types = layer_types(f, n, [SLIDING if (i + 1) % 2 else FULL for i in range(n)], window)
    params, where = rope_parameters(f)
    if not params:
        params, where = dict(DEFAULT_ROPE), "rope_parameters"
    experts, k = f.number("num_local_experts"), f.number("num_experts_per_tok")
    if not 0 < k <= experts:
        raise f.refuse("num_experts_per_tok", k, f"a token's experts are 1 to num_local_experts ({experts})")
    moe = MoE(experts, k, config["intermediate_size"], normalize_top_k=False, router_bias=True,
              top_k_before_softmax=True, expert_bias=True, swiglu_limit=f.number("swiglu_limit", float),
              swiglu_alpha=f.number("swiglu_alpha", float))
    bias = bool(f.get("attention_bias"))
    return DecoderConfig("gpt_oss", **config, rope=rope(f, params, where, f.number("rope_theta", float)),
                         sliding_window=window if types else None, layer_types=types, qkv_bias=bias, o_bias=bias,
                         norm_weight_in_float32=True, attention_sinks=True, moe=moe)
