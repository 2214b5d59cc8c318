"""Qwen3-Next (``Qwen3NextForCausalLM``, model_type ``qwen3_next``: Qwen3-Next-80B-A3B): Qwen3.5's
decoder (``model.families.qwen3_5``: Gated DeltaNet on three blocks of four, gated full attention
on the others, (1 + w) norms, a quarter of each head rotated) with Qwen2-MoE's mixture of
experts and shared expert (``norm_topk_prob``; dense MLPs of ``intermediate_size`` in
``mlp_only_layers`` and off ``decoder_sparse_step``). Its DeltaNet projections are fused per key
head (``in_proj_qkvz``: q, k, then its value heads' v and z; ``in_proj_ba``): ``model.params``
takes them apart at load time."""

from __future__ import annotations

from model.config import DecoderConfig
from model.families.common import Fields, mixture_of_experts, qwen_dense_layers
from model.families.qwen3_5 import DEFAULTS as QWEN3_5_DEFAULTS
from model.families.qwen3_5 import hybrid_config

ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3NextModel")
# transformers' Qwen3NextConfig defaults, for keys a config.json may leave out.
DEFAULTS = dict(QWEN3_5_DEFAULTS, vocab_size=151_936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                num_key_value_heads=2, decoder_sparse_step=1, moe_intermediate_size=512,
                shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512, norm_topk_prob=True)


def decoder_config(raw: dict) -> DecoderConfig:
    f = Fields(raw, DEFAULTS, "qwen3_next")
    dense = qwen_dense_layers(f, f.number("num_hidden_layers"))
    moe = mixture_of_experts(f, "moe_intermediate_size", dense_layers=dense,
                             shared_expert_size=f.number("shared_expert_intermediate_size") or None)
    return hybrid_config(f, moe)
