"""Weights per device of a mixture of experts on a 2d mesh (``model.sharding``), by part, in
bfloat16: Qwen3-30B-A3B and Mixtral 8x7B (their published config.json shapes) on a v5e-8 (8
chips of 16 GiB) and a v4-8 (4 chips of 32 GiB), as extraction loads them (no LM head) and as
generation and ablation do (with it). Counted from the parameter shapes and partition specs the
loader uses; activations and XLA's temporaries come on top (a batch's worth).

    python benchmarks/moe_memory.py
"""

from __future__ import annotations

import types

import numpy as np

from model.config import config_from_dict
from model.params import expected_shape, param_names
from model.sharding import default_model_axis, expert_slots, param_spec

CONFIGS = {  # the hub's config.json values that set the shapes
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
                          hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                          tie_word_embeddings=False, norm_topk_prob=True),
    "Mixtral-8x7B": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000,
                         hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=32768, tie_word_embeddings=False),
}
SLICES = {"v5e-8": (8, 16), "v4-8": (4, 32)}  # chips, GiB of HBM each
PARTS = {"experts": ("experts",), "attention": ("self_attn",), "embedding": ("embed_tokens",),
         "LM head": ("lm_head",)}


def per_device_bytes(config, devices: int) -> dict[str, float]:
    """Bytes per device of each part (bfloat16) on a 2d mesh of one host of ``devices``."""
    mesh = types.SimpleNamespace(shape={"data": 1, "model": default_model_axis(config, devices)})
    out = dict.fromkeys([*PARTS, "other"], 0.0)
    for path, _ in param_names(config, config.num_hidden_layers, True, ""):
        shape = list(expected_shape(path, config))
        if path[-2] == "experts":
            shape[0] = expert_slots(config, mesh)
        spec = param_spec(path, tuple(shape), mesh, config)
        split = mesh.shape["model"] if any(axis == "model" for axis in spec) else 1
        part = next((name for name, keys in PARTS.items() if any(k in path for k in keys)), "other")
        out[part] += 2 * np.prod(shape) / split
    return out


def main() -> None:
    print("| model | slice | model axis | experts | attention | embedding | LM head | other | extraction | "
          "with the head | HBM per chip |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, raw in CONFIGS.items():
        config = config_from_dict(raw)
        for slice_name, (chips, hbm) in SLICES.items():
            parts = {k: v / 2**30 for k, v in per_device_bytes(config, chips).items()}
            extraction = sum(parts.values()) - parts["LM head"]
            print(f"| {name} | {slice_name} | {default_model_axis(config, chips)} | "
                  + " | ".join(f"{parts[k]:.2f}" for k in (*PARTS, "other"))
                  + f" | {extraction:.2f} GiB | {extraction + parts['LM head']:.2f} GiB | {hbm} GiB |")


if __name__ == "__main__":
    main()
