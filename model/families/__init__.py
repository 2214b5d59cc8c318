"""The supported families, and a checkpoint's ``config.json`` read through its family: each module
here maps a ``config.json`` onto ``model.config.DecoderConfig`` and refuses what it does not handle.
Adding a family is a module here and a line in ``FAMILIES``."""

from __future__ import annotations

import json
import os
from types import ModuleType

from common.cli import UserError
from model.config import DecoderConfig
from model.families import (deepseek_v2, deepseek_v3, deepseek_v32, deepseek_v4, falcon_h1, gemma2, gemma3, gemma4,
                            glm4_moe, glm5_next, gpt2, gpt_neox, gpt_oss, granitemoehybrid, kimi_linear, llama, llama4,
                            minimax_m2, mistral, mistral4, mixtral, nemotron_h, olmo2, olmo3, olmo_hybrid, olmoe, phi3,
                            qwen2, qwen2_moe, qwen3, qwen3_5, qwen3_moe, qwen3_next, qwen4_exp, smollm3)

# config.json's model_type -> (its reader, the architectures it accepts).
FAMILIES: dict[str, tuple[ModuleType, tuple[str, ...]]] = {
    "llama": (llama, llama.ARCHITECTURES),
    "llama4_text": (llama4, llama4.ARCHITECTURES),
    "llama4": (llama4, llama4.WRAPPER_ARCHITECTURES),
    "mistral": (mistral, mistral.ARCHITECTURES),
    "qwen2": (qwen2, qwen2.ARCHITECTURES),
    "qwen3": (qwen3, qwen3.ARCHITECTURES),
    "gemma2": (gemma2, gemma2.ARCHITECTURES),
    "gemma3_text": (gemma3, gemma3.ARCHITECTURES),
    "gemma3": (gemma3, gemma3.WRAPPER_ARCHITECTURES),
    "gemma4_text": (gemma4, gemma4.ARCHITECTURES),
    "gemma4": (gemma4, gemma4.WRAPPER_ARCHITECTURES),
    "gpt2": (gpt2, gpt2.ARCHITECTURES),
    "gpt_neox": (gpt_neox, gpt_neox.ARCHITECTURES),
    "olmo2": (olmo2, olmo2.ARCHITECTURES),
    "olmo3": (olmo3, olmo3.ARCHITECTURES),
    "olmo_hybrid": (olmo_hybrid, olmo_hybrid.ARCHITECTURES),
    "smollm3": (smollm3, smollm3.ARCHITECTURES),
    "qwen3_5_text": (qwen3_5, qwen3_5.ARCHITECTURES),
    "qwen3_5": (qwen3_5, qwen3_5.WRAPPER_ARCHITECTURES),
    "qwen3_5_moe_text": (qwen3_5, qwen3_5.MOE_ARCHITECTURES),
    "qwen3_5_moe": (qwen3_5, qwen3_5.MOE_WRAPPER_ARCHITECTURES),
    "qwen3_next": (qwen3_next, qwen3_next.ARCHITECTURES),
    "phi3": (phi3, phi3.ARCHITECTURES),
    "qwen2_moe": (qwen2_moe, qwen2_moe.ARCHITECTURES),
    "qwen3_moe": (qwen3_moe, qwen3_moe.ARCHITECTURES),
    "olmoe": (olmoe, olmoe.ARCHITECTURES),
    "mixtral": (mixtral, mixtral.ARCHITECTURES),
    "gpt_oss": (gpt_oss, gpt_oss.ARCHITECTURES),
    "deepseek_v2": (deepseek_v2, deepseek_v2.ARCHITECTURES),
    "deepseek_v3": (deepseek_v3, deepseek_v3.ARCHITECTURES),
    "deepseek_v32": (deepseek_v32, deepseek_v32.ARCHITECTURES),
    "glm_moe_dsa": (deepseek_v32, deepseek_v32.GLM5_ARCHITECTURES),
    "kimi_k2": (deepseek_v3, deepseek_v3.ARCHITECTURES),  # Kimi K2's config.json: DeepSeek-V3's model
    "glm4_moe_lite": (deepseek_v3, deepseek_v3.LITE_ARCHITECTURES),
    "glm4_moe": (glm4_moe, glm4_moe.ARCHITECTURES),
    "minimax_m2": (minimax_m2, minimax_m2.ARCHITECTURES),
    "mistral4": (mistral4, mistral4.ARCHITECTURES),
    "mistral3": (mistral4, mistral4.WRAPPER_ARCHITECTURES),  # Mistral Small 4: its mistral4 text model
    "granitemoehybrid": (granitemoehybrid, granitemoehybrid.ARCHITECTURES),
    "nemotron_h": (nemotron_h, nemotron_h.ARCHITECTURES),
    "falcon_h1": (falcon_h1, falcon_h1.ARCHITECTURES),
    "kimi_linear": (kimi_linear, kimi_linear.ARCHITECTURES),
    "glm5_next": (glm5_next, glm5_next.ARCHITECTURES),
    "deepseek_v4": (deepseek_v4, deepseek_v4.ARCHITECTURES),
    "qwen4_exp_text": (qwen4_exp, qwen4_exp.ARCHITECTURES),
    "qwen4_exp": (qwen4_exp, qwen4_exp.WRAPPER_ARCHITECTURES),
}
# Types transformers has that reduce to none of the switches, each with what it lacks (docs/model.md).
REFUSED = {
    "glm5_next_text": "a GLM-5-next text model alone has no LM head in transformers: read the "
                      "Glm5NextForConditionalGeneration checkpoint (model_type glm5_next)",
}
SUPPORTED_ARCHITECTURES = tuple(a for _, architectures in FAMILIES.values() for a in architectures
                                if a.endswith(("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")))


def config_from_dict(raw: dict) -> DecoderConfig:
    """The ``DecoderConfig`` of a parsed ``config.json``: its family's reading, or ``UserError``
    naming the architecture or option that is not supported (before any weight is read)."""
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    if model_type in REFUSED:
        raise UserError(f"unsupported architecture: config.json's model_type {model_type!r}: {REFUSED[model_type]}")
    family, accepted = FAMILIES.get(model_type, (None, ()))
    unknown = [a for a in architectures if a not in accepted]
    if family is None or unknown:
        name = unknown[0] if unknown else f"model_type {model_type!r}"
        raise UserError(f"unsupported architecture {name!r} in config.json: supported are "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if quantization := raw.get("quantization_config"):
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        if method not in getattr(family, "QUANTIZATIONS", ()):  # (gpt-oss's MXFP4 experts are dequantized at load)
            raise UserError(f"{model_type} config.json: quantization_config ({method}) is not supported: the "
                            "checkpoint's weights must be float (dequantize it first)")
    return family.decoder_config(raw)


def load_config(model_dir: str | os.PathLike) -> DecoderConfig:
    """The config of a local checkpoint directory."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise UserError(f"no config.json in {os.fspath(model_dir)!r}")
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} is not a JSON object")
    return config_from_dict(raw)
