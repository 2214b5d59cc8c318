"""What every family's config reading shares: defaults, the two layouts of RoPE and layer types,
and the one-line refusals.

The two layouts: the hub's ``config.json`` files (written by transformers 4.4x: ``rope_theta``,
``rope_scaling``, ``sliding_window_pattern``, ``rope_local_base_freq``, no ``layer_types``) and
what transformers 5 writes (``rope_parameters``, nested per layer type where the types differ,
``layer_types``; keys it moved are written as null). A key that is absent, or null, reads as
transformers' default for the family, so a reader gives the same ``DecoderConfig`` from either.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from common.cli import UserError
from model.config import ACTIVATIONS, FULL, ROPE_KINDS, SLIDING, MoE, RoPE


class Fields:
    """One family's ``config.json`` (or a ``text_config`` inside one), read with its defaults."""

    def __init__(self, raw: dict[str, Any], defaults: dict[str, Any], family: str):
        self.raw = raw
        self.defaults = defaults
        self.family = family

    def get(self, key: str) -> Any:
        """The value of ``key``; absent or null: the family's default (None without one)."""
        value = self.raw.get(key)
        return self.defaults.get(key) if value is None else value

    def optional(self, key: str) -> Any:
        """The value of an option that null turns off (``sliding_window``): absent reads as the
        family's default, null as None."""
        return self.raw[key] if key in self.raw else self.defaults.get(key)

    def number(self, key: str, kind: Callable = int) -> Any:
        """A number (the family's default where absent); ``UserError`` when it is not one, or
        absent from a family without a default for it."""
        value = self.get(key)
        if value is None:
            raise UserError(f"{self.family} config.json has no {key!r}")
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise UserError(f"{self.family} config.json: {key} = {value!r} is not a number") from None

    def refuse(self, key: str, value: Any, why: str) -> UserError:
        """The one-line refusal of an option that would change the computation."""
        return UserError(f"{self.family} config.json: {key} = {value!r} is not supported: {why}")


def wrapped_text_config(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """The text model's config of a ``*ForConditionalGeneration`` whose head is tied by default
    (Gemma's, Mistral 3's): its ``text_config``, the wrapper alone deciding the tying of the LM head,
    as transformers reads it (default tied: the text_config's own key is not read), with the
    wrapper's ``quantization_config``."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UserError(f"{family} config.json has no 'text_config' (the language model's settings)")
    return {**text, **_quantization(raw), "tie_word_embeddings": raw.get("tie_word_embeddings", True)}


def untied_text_config(raw: dict[str, Any], family: str, text_type: str) -> dict[str, Any]:
    """The text model's config of a ``*ForConditionalGeneration`` whose head is untied by default
    (Llama 4's, Qwen3.5's, Qwen4-Exp's): its ``text_config`` as model_type ``text_type``, the head's
    tying the wrapper's, else the text config's, else none; with the wrapper's ``quantization_config``."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UserError(f"{family} config.json has no 'text_config' (the language model's settings)")
    return {**text, **_quantization(raw), "model_type": text_type,
            "tie_word_embeddings": raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}


def _quantization(raw: dict[str, Any]) -> dict[str, Any]:
    """A wrapper's ``quantization_config``, which covers its text model's weights, as a text config's
    key (none where it has none)."""
    return {"quantization_config": raw["quantization_config"]} if raw.get("quantization_config") else {}


def shapes(f: Fields, eps_key: str = "rms_norm_eps") -> dict[str, Any]:
    """The fields every family reads the same way: widths, heads, norm epsilon (under
    ``eps_key``), head tying."""
    heads = f.number("num_attention_heads")
    kv_heads = int(f.get("num_key_value_heads") or heads)
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise f.refuse("num_key_value_heads", kv_heads,
                       f"num_attention_heads {heads} must be a positive multiple of it")
    hidden = f.number("hidden_size")
    return dict(vocab_size=f.number("vocab_size"), hidden_size=hidden,
                intermediate_size=f.number("intermediate_size"),
                num_hidden_layers=f.number("num_hidden_layers"), num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=int(f.get("head_dim") or hidden // heads),
                norm_eps=f.number(eps_key, float),
                tie_word_embeddings=bool(f.get("tie_word_embeddings")),
                max_position_embeddings=f.number("max_position_embeddings"))


def sliding_window(f: Fields) -> int | None:
    """The sliding layers' window: absent, the family's default; null or 0, none."""
    window = f.optional("sliding_window")
    return int(window) if window else None


def activation(f: Fields, key: str, allowed: Sequence[str] = ACTIVATIONS) -> str:
    """The MLP's activation, by transformers' name (one of ``allowed``)."""
    name = f.get(key)
    if name not in allowed:
        raise f.refuse(key, name, f"the MLP activation must be one of {', '.join(allowed)}")
    return name


def rope_parameters(f: Fields, layer_type: str | None = None) -> tuple[dict[str, Any], str]:
    """(the RoPE parameters of ``layer_type`` (None: the model's one set), the key they came from).

    transformers 5: ``rope_parameters``, nested per layer type where they differ; the hub's:
    ``rope_scaling`` (None or a dict without ``rope_theta``)."""
    params = f.raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        nested = FULL in params or SLIDING in params
        if nested and layer_type is not None:
            return dict(params.get(layer_type) or {}), f"rope_parameters.{layer_type}"
        if nested:
            return dict(params.get(FULL) or {}), f"rope_parameters.{FULL}"
        return dict(params), "rope_parameters"
    scaling = f.raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise f.refuse("rope_scaling", scaling, "expected a dict or null")
    return dict(scaling or {}), "rope_scaling"


def rope(f: Fields, params: dict[str, Any], where: str, theta: float, partial: bool = False) -> RoPE:
    """A ``RoPE`` from one set of parameters (``where`` names their key for refusals); ``theta``
    is the base to use where the parameters give none. ``partial``: the family reads a partial
    rotary factor (``rotary_dim``); elsewhere one is refused."""
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_KINDS:
        raise f.refuse(f"{where}.rope_type", kind, f"the implemented RoPE types are {', '.join(ROPE_KINDS)}")
    factor = params.get("partial_rotary_factor", f.raw.get("partial_rotary_factor"))
    if not partial and factor not in (None, 1, 1.0):
        raise f.refuse(f"{where}.partial_rotary_factor", factor, f"{f.family} rotates the whole head")
    try:
        theta = float(params.get("rope_theta") or theta)
    except (TypeError, ValueError):
        raise f.refuse(f"{where}.rope_theta", params.get("rope_theta") or theta, "not a number") from None
    if kind == "default":
        return RoPE(theta)
    if kind == "yarn":
        return yarn(f, params, where, theta)
    try:
        factor = float(params["factor"])
        if kind == "linear":
            return RoPE(theta, kind, factor)
        return RoPE(theta, kind, factor, float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                    int(params.get("original_max_position_embeddings") or f.number("max_position_embeddings")))
    except KeyError as e:
        raise UserError(f"{f.family} config.json: {where} of type {kind!r} has no {e.args[0]!r}") from None


def yarn(f: Fields, params: dict[str, Any], where: str, theta: float) -> RoPE:
    """YaRN's RoPE as transformers reads its parameters: ``factor`` (default: the context over
    ``original_max_position_embeddings``), ``beta_fast`` 32, ``beta_slow`` 1, ``truncate`` true,
    and the factor on cos and sin: ``attention_factor``, else from ``mscale`` / ``mscale_all_dim``,
    else 0.1 ln(factor) + 1."""
    number = lambda key, default=None: float(params[key]) if params.get(key) is not None else default
    try:
        # A top-level original_max_position_embeddings wins, as transformers standardises it (Phi-3's).
        original = int(f.raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                       or f.number("max_position_embeddings"))
        factor = number("factor", f.number("max_position_embeddings") / original)
        scale = lambda m=1.0: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
        mscale, mscale_all_dim = number("mscale"), number("mscale_all_dim")
        attention = number("attention_factor", scale(mscale) / scale(mscale_all_dim) if mscale and mscale_all_dim
                           else scale())
        # transformers reads truncate from the top of rope_parameters: per layer type, it is never there.
        truncate = bool(params.get("truncate", True)) if "." not in where else True
        return RoPE(theta, "yarn", factor, original_max_position_embeddings=original,
                    beta_fast=number("beta_fast") or 32.0, beta_slow=number("beta_slow") or 1.0,
                    truncate=truncate, attention_factor=attention)
    except (TypeError, ValueError):
        raise f.refuse(where, params, "YaRN's parameters must be numbers") from None


def rotary_dim(f: Fields, params: dict[str, Any], where: str, head_dim: int, default: float = 1.0) -> int | None:
    """The dims of each head RoPE rotates, as transformers computes them (int(head_dim * factor),
    the factor from the RoPE parameters, or the config's top level, or ``default``); None for
    the whole head. Refused unless it leaves whole pairs: at least one, at most head_dim / 2."""
    factor = params.get("partial_rotary_factor", f.get("partial_rotary_factor"))
    factor = default if factor is None else factor
    try:
        dims = int(head_dim * float(factor))
    except (TypeError, ValueError):
        raise f.refuse(f"{where}.partial_rotary_factor", factor, "not a number") from None
    if dims == head_dim:
        return None
    if not 0 < dims < head_dim or dims % 2:
        raise f.refuse(f"{where}.partial_rotary_factor", factor, f"it rotates {dims} of head_dim {head_dim}: "
                       "an even number of dims, at least 2, is needed")
    return dims


def layer_types(f: Fields, num_layers: int, derived: Sequence[str], window: int | None) -> tuple[str, ...]:
    """Per block, FULL or SLIDING: transformers 5's ``layer_types`` where given, else ``derived``
    (the hub layout's rule for the family); checked against the window."""
    given = f.raw.get("layer_types")
    types = tuple(given) if given is not None else tuple(derived)
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise f.refuse("layer_types", unknown[0], f"the implemented layer types are {FULL} and {SLIDING}")
    if len(types) != num_layers:
        raise f.refuse("layer_types", f"{len(types)} entries", f"the model has {num_layers} layers")
    if SLIDING in types and not window:
        raise f.refuse("sliding_window", window, f"layer_types has {SLIDING} layers, which need a window")
    return types if SLIDING in types else ()


def refuse_if_set(f: Fields, key: str, why: str) -> None:
    """Refuses a boolean option that is on."""
    if f.raw.get(key):
        raise f.refuse(key, f.raw[key], why)


def mixture_of_experts(f: Fields, expert_size_key: str, normalize_top_k: bool | None = None,
                       dense_layers: Sequence[int] = (), **switches: Any) -> MoE:
    """The ``MoE`` of a mixture-of-experts family: ``num_experts`` (or ``num_local_experts``, as
    transformers 5 writes Qwen3-MoE's and Mixtral reads it), ``num_experts_per_tok``, each expert's
    width from ``expert_size_key``; ``normalize_top_k`` None reads ``norm_topk_prob``."""
    key = "num_local_experts" if f.raw.get("num_local_experts") is not None else "num_experts"
    experts, k = f.number(key), f.number("num_experts_per_tok")
    if not 0 < k <= experts:
        raise f.refuse("num_experts_per_tok", k, f"a token's experts are 1 to {key} ({experts})")
    normalize = bool(f.get("norm_topk_prob")) if normalize_top_k is None else normalize_top_k
    return MoE(experts, k, f.number(expert_size_key), normalize, dense_layers=tuple(dense_layers), **switches)


def qwen_dense_layers(f: Fields, num_layers: int) -> list[int]:
    """Qwen-MoE's blocks with a dense MLP: those in ``mlp_only_layers``, and those whose number
    plus one ``decoder_sparse_step`` does not divide (transformers' rule)."""
    step = f.number("decoder_sparse_step")
    only = f.get("mlp_only_layers") or []
    if step < 1:
        raise f.refuse("decoder_sparse_step", step, "it must be at least 1")
    return [i for i in range(num_layers) if i in only or (i + 1) % step]


def time_step_limit(f: Fields) -> tuple[float, float]:
    """A Mamba-2 mixer's clamp of dt (``time_step_limit``: two numbers, transformers writing
    infinity as {"__float__": "Infinity"}; absent, none)."""
    limit = f.raw.get("time_step_limit") or (0.0, math.inf)
    bound = lambda v: float(v["__float__"] if isinstance(v, dict) and "__float__" in v else v)
    try:
        low, high = (bound(v) for v in limit)
    except (TypeError, ValueError):
        raise f.refuse("time_step_limit", limit, "expected two numbers (min, max)") from None
    return low, high
