"""The Qwen2 architecture hyper-parameters, read from a Hugging Face ``config.json``.

Options this implementation does not support (sliding-window attention, rope scaling, another
architecture) raise ``UserError`` instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from common.cli import UserError

# The attention kernels of a forward without a cache (``model.qwen2.attention_for``); here, where
# the flag parsers can read them without importing JAX.
ATTENTION_KINDS = ("auto", "tiled", "fused")
RESIDUAL_DTYPES = ("float32", "compute")  # the residual stream's: see model.extract.resolve_residual_dtype

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen2Model")


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """Hyper-parameters of a Qwen2-family decoder (names as in Hugging Face's config)."""
    vocab_size: int
    hidden_size: int            # residual stream width
    intermediate_size: int      # SwiGLU width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int    # < num_attention_heads for grouped-query attention
    head_dim: int               # hidden_size // num_attention_heads unless given
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads


def _rope(raw: dict[str, Any]) -> float:
    """rope_theta from either config style (top level, or transformers 5's ``rope_parameters``)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UserError(f"unsupported rope scaling type {rope_type!r} (only default RoPE is implemented)")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise UserError("config has no rope_theta")
    return float(theta)


def config_from_dict(raw: dict[str, Any]) -> Qwen2Config:
    """A ``Qwen2Config`` from the parsed ``config.json``; unsupported options are errors."""
    architectures = raw.get("architectures") or []
    if raw.get("model_type") != "qwen2" or any(a not in SUPPORTED_ARCHITECTURES for a in architectures):
        raise UserError(f"unsupported architecture {architectures or raw.get('model_type')!r}: "
                        "only Qwen2 (model_type qwen2) is implemented")
    if raw.get("use_sliding_window"):
        raise UserError("sliding-window attention (use_sliding_window: true) is not implemented")
    try:
        heads = int(raw["num_attention_heads"])
        config = Qwen2Config(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rope_theta=_rope(raw),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        )
    except KeyError as e:
        raise UserError(f"config.json has no {e.args[0]!r}") from None
    if config.num_attention_heads % config.num_key_value_heads:
        raise UserError(f"num_attention_heads {heads} is not a multiple of "
                        f"num_key_value_heads {config.num_key_value_heads}")
    return config


def load_config(model_dir: str | os.PathLike) -> Qwen2Config:
    """The config of a local checkpoint directory."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise UserError(f"no config.json in {os.fspath(model_dir)!r}")
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON: {e}") from None
    return config_from_dict(raw)
