"""Weights per chip of large models on a 2d mesh (``model.sharding``), by part, in bfloat16:
mixtures of experts (Qwen3-30B-A3B, Mixtral 8x7B, Qwen3.5-35B-A3B, Gemma 4 26B-A4B, gpt-oss-20b
and 120b, their MXFP4 experts as loaded: dequantized; DeepSeek-V2-Lite and V3) and dense
hybrids (Qwen3.5-27B, Gemma 4 31B), from their published config.json shapes, on a v5e-8 (8 chips of
16 GiB), a v6e-8 (8 of 32 GiB), a v4-8 (4 of 32 GiB) and a v5p-8 (4 of 95 GiB), at the default model axis (a dense
model's: gcd(chips, its kv heads), every chip for a mixture of experts) and, where that is fewer
than the chips, at every chip (``--model_axis_size``); a model no host holds (DeepSeek-V3) on
multi-host slices, its model axis over every chip of the slice. As extraction loads them (no LM head) and as
generation and ablation do (with it). Counted from the parameter shapes and partition specs the
loader uses; activations and XLA's temporaries come on top (a batch's worth).

    python benchmarks/model_memory.py
"""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np

from model.families import config_from_dict
from model.params import expected_shape, param_dtype, param_names
from model.sharding import default_model_axis, expert_slots, param_spec

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
QWEN3_5_LAYERS = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)]
GEMMA4_LAYERS = lambda n: ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
CONFIGS = {  # the hub's config.json values that set the shapes (a multimodal checkpoint's text_config)
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
                          hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                          tie_word_embeddings=False, norm_topk_prob=True),
    "Mixtral-8x7B": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000,
                         hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=32768, tie_word_embeddings=False),
    "Qwen3.5-27B": dict(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], vocab_size=248320,
                        hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                        num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
                        layer_types=QWEN3_5_LAYERS, tie_word_embeddings=False),
    "Qwen3.5-35B-A3B": dict(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"],
                            vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                            num_key_value_heads=2, head_dim=256, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
                            linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=False),
    "Gemma 4 31B": dict(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], vocab_size=262144,
                        hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
                        num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
                        attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=1024,
                        layer_types=GEMMA4_LAYERS(60), tie_word_embeddings=True),
    "Gemma 4 26B-A4B": dict(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], vocab_size=262144,
                            hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
                            attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=1024,
                            enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                            layer_types=GEMMA4_LAYERS(30), tie_word_embeddings=True),
    # gpt-oss: the experts as loaded (MXFP4 dequantized to bfloat16: model.mxfp4), not as shipped.
    "gpt-oss-20b": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_hidden_layers=24,
                        num_local_experts=32),
    "gpt-oss-120b": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_hidden_layers=36,
                         num_local_experts=128),
    # DeepSeek: latent attention, experts as loaded (bfloat16; an FP8 checkpoint's dequantized: model.fp8).
    "DeepSeek-V2-Lite": dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], vocab_size=102400,
                             hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                             num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                             n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
                             q_lora_rank=None, kv_lora_rank=512, max_position_embeddings=163840),
    "DeepSeek-V3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                        max_position_embeddings=163840),  # transformers' defaults are V3's (671B) shapes
}
SLICES = {"v5e-8": (8, 16), "v6e-8": (8, 32), "v4-8": (4, 32), "v5p-8": (4, 95)}  # one host: chips, GiB of HBM each
# Multi-host slices, for a model no host above holds: a model axis over all their chips (--model_axis_size).
MULTI_HOST_SLICES = {"v6e-64": (64, 32), "v5p-64": (32, 95), "v5p-128": (64, 95)}
PARTS = {"experts": ("experts",), "mixers": ("self_attn", "linear_attn", "mamba"), "embeddings": ("embed_tokens",
         "per_layer_inputs"), "LM head": ("lm_head",)}  # the rest: dense MLPs, routers, norms


def per_device_bytes(config, model_axis: int) -> dict[str, float]:
    """Bytes per device of each part (bfloat16; float32 where the loader keeps it: DeepSeek's
    routers) on a 2d mesh whose model axis is ``model_axis``."""
    mesh = types.SimpleNamespace(shape={"data": 1, "model": model_axis})
    out = dict.fromkeys([*PARTS, "MLPs, other"], 0.0)
    for path, _ in param_names(config, config.num_hidden_layers, True, ""):
        shape = list(expected_shape(path, config))
        if path[-2] == "experts":
            shape[0] = expert_slots(config, mesh)
        spec = param_spec(path, tuple(shape), mesh, config)
        split = mesh.shape["model"] if any(axis == "model" for axis in spec) else 1
        part = next((name for name, keys in PARTS.items() if any(k in path for k in keys)), "MLPs, other")
        itemsize = param_dtype(path, config, BFLOAT16).itemsize  # DeepSeek's routers: float32
        out[part] += itemsize * np.prod(shape) / split
    return out


def main() -> None:
    print("| model | slice | model axis | " + " | ".join([*PARTS, "MLPs, other"])
          + " | extraction | with the head | HBM per chip |")
    print("| --- " * (len(PARTS) + 7) + "|")
    for name, raw in CONFIGS.items():
        config = config_from_dict(raw)
        fits_a_host = False
        for slice_name, (chips, hbm) in SLICES.items():
            for axis in dict.fromkeys((default_model_axis(config, chips), chips)):
                extraction = row(name, slice_name, axis, hbm, config)
                fits_a_host |= extraction < hbm
        if not fits_a_host:
            for slice_name, (chips, hbm) in MULTI_HOST_SLICES.items():
                row(name, slice_name, chips, hbm, config)


def row(name: str, slice_name: str, axis: int, hbm: int, config) -> float:
    """Prints one table row; returns the GiB per chip of extraction."""
    parts = {k: v / 2**30 for k, v in per_device_bytes(config, axis).items()}
    extraction = sum(parts.values()) - parts["LM head"]
    print(f"| {name} | {slice_name} | {axis} | " + " | ".join(f"{v:.2f}" for v in parts.values())
          + f" | {extraction:.2f} GiB | {extraction + parts['LM head']:.2f} GiB | {hbm} GiB |")
    return extraction


if __name__ == "__main__":
    main()
