"""The layers the decoder's blocks and its mixture of experts are built of: linear layers with
the matmul precision and accumulation a dtype asks for, the two norms and the dense MLP."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import DecoderConfig
from model.sites import MLP_POST, MLP_PRE, MLP_PRE_LINEAR

_TANH_GELU = functools.partial(jax.nn.gelu, approximate=True)  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
ACTIVATIONS = {"silu": nn.silu, "gelu_pytorch_tanh": _TANH_GELU, "gelu_new": _TANH_GELU,
               "gelu": functools.partial(jax.nn.gelu, approximate=False), "relu2": lambda x: jnp.square(nn.relu(x))}


def precision_for(dtype) -> jax.lax.Precision:
    """float32 asks for full-precision matmuls (TPUs default to bfloat16 passes otherwise)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def full_precision(fn):
    """``fn`` with its matmuls traced at full precision: the recurrences (``model.deltanet``,
    ``model.mamba2``) compute in float32 whatever the model's dtype, as transformers' torch paths
    do, which TPUs would otherwise run as one bfloat16 pass and GPUs as TF32."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)
    return traced


def accumulation(dtype, residual_dtype) -> Any:
    """The dtype matmuls of ``dtype`` operands return: None (their own dtype: the plain graph)
    unless the residual stream is wider, then the residual dtype."""
    if residual_dtype is None or jnp.dtype(residual_dtype) == jnp.dtype(dtype):
        return None
    return jnp.dtype(residual_dtype)


def dense(features: int, use_bias: bool, name: str, dtype, accumulate=None) -> nn.Dense:
    """A linear layer of ``dtype`` weights and operands; ``accumulate``: the dtype it accumulates
    in and returns (a bias is then added in it too), None for ``dtype``."""
    dot = None if accumulate is None else functools.partial(jax.lax.dot_general,
                                                             preferred_element_type=accumulate)
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name,
                    precision=precision_for(dtype), dot_general=dot)


class RMSNorm(nn.Module):
    """x / rms(x) scaled by its weight: ``x * w`` (``unit_offset`` False) or ``x * (1 + w)``."""
    eps: float
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None  # wider than dtype: the weight applies in float32, one rounding
    unit_offset: bool = False   # Gemma: (1 + w), in float32 whatever the dtype, as transformers does
    keep_wide: bool = False     # with a wider stream, return float32 (what is added to it, or roped)
    normalized_site: str | None = None  # sow x / rms(x), before the weight, as this site
    weight_in_float32: bool = False  # w * x / rms(x) in float32, rounded once (OLMo 2); else rounded, then scaled
    groups: int = 1             # x / rms(x) over each of this many equal parts of the last axis apart (the
                                # weight spans them all: Qwen4-Exp's per-stream norms)

    @nn.compact
    def __call__(self, x: jax.Array, ablation: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """x: [..., W] -> [..., W] in ``dtype`` (a matmul operand) or, ``keep_wide``, float32.
        ``ablation`` (keep, fill), scalars: unless kept, the weight becomes neutral (ones, or
        zeros with ``unit_offset``), or with ``fill`` its mean."""
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.dtype)
        wide = accumulation(self.dtype, self.residual_dtype) is not None
        if wide:
            weight = weight.astype(jnp.float32)
        if ablation is not None:
            keep, fill = ablation
            neutral = jnp.zeros_like(weight) if self.unit_offset else jnp.ones_like(weight)
            weight = jnp.where(keep, weight, jnp.where(fill, jnp.mean(weight), neutral))
        x32 = x.astype(jnp.float32)
        if self.groups > 1:  # [..., groups, W / groups]: each part normed apart
            x32 = x32.reshape(*x.shape[:-1], self.groups, -1)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        normed = normed.reshape(x.shape)
        if self.normalized_site:
            self.sow("sites", self.normalized_site, normed)
        out_dtype = jnp.float32 if wide and self.keep_wide else self.dtype
        if self.unit_offset:
            return (normed * (1.0 + weight.astype(jnp.float32))).astype(out_dtype)
        if wide or self.weight_in_float32:
            return (weight.astype(jnp.float32) * normed).astype(out_dtype)
        # Llama's order in Hugging Face: the normalised values rounded to dtype, then scaled in it.
        return weight * normed.astype(self.dtype)


class LayerNorm(nn.Module):
    """(x - mean(x)) / sqrt(var(x) + eps) * w + b, computed in float32 whatever the dtype (as
    torch's LayerNorm does) and rounded once."""
    eps: float
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None  # wider than dtype (with keep_wide): the output stays float32
    keep_wide: bool = False     # with a wider stream, return float32
    normalized_site: str | None = None  # sow the normalised x, before the weight and bias, as this site

    @nn.compact
    def __call__(self, x: jax.Array, ablation: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """x: [..., W] -> [..., W]. ``ablation`` (keep, fill), scalars: unless kept, the weight and
        bias become neutral (ones and zeros: the bare normalisation), or with ``fill`` their means."""
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype).astype(jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],), self.dtype).astype(jnp.float32)
        if ablation is not None:
            keep, fill = ablation
            weight = jnp.where(keep, weight, jnp.where(fill, jnp.mean(weight), jnp.ones_like(weight)))
            bias = jnp.where(keep, bias, jnp.where(fill, jnp.mean(bias), jnp.zeros_like(bias)))
        x32 = x.astype(jnp.float32)
        centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        normed = centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + self.eps)
        if self.normalized_site:
            self.sow("sites", self.normalized_site, normed)
        wide = accumulation(self.dtype, self.residual_dtype) is not None
        return (normed * weight + bias).astype(jnp.float32 if wide and self.keep_wide else self.dtype)


def scaled(x: jax.Array, factor) -> jax.Array:
    """``x`` times a multiplier (a scalar, or an array along its last axis) in float32, rounded
    once to its dtype, as torch multiplies a tensor by a Python float; ``x`` itself for a scalar 1."""
    if isinstance(factor, (int, float)) and factor == 1:
        return x
    return (x.astype(jnp.float32) * factor).astype(x.dtype)


def rms_normalized(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32, without a weight (Gemma 4's value norm and
    router input, Gated DeltaNet's output norm before its weight)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def norm_for(config: DecoderConfig, name: str, dtype, residual_dtype, keep_wide: bool = False,
             normalized_site: str | None = None) -> nn.Module:
    """The model's norm (``config.norm``): an RMSNorm or a LayerNorm."""
    if config.norm == "layer":
        return LayerNorm(config.norm_eps, dtype, residual_dtype, keep_wide, normalized_site, name=name)
    return RMSNorm(config.norm_eps, dtype, residual_dtype, config.norm_unit_offset, keep_wide, normalized_site,
                   config.norm_weight_in_float32, name=name)


class MLP(nn.Module):
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None  # wider than dtype: matmuls accumulate in it, the gating is in it
    returned: tuple[str, ...] = ()  # also return these hidden sites: mlp.hook_pre, mlp.hook_pre_linear, mlp.hook_post
    intermediate_size: int | None = None  # None: the config's (Qwen2-MoE's shared expert has its own)

    @nn.compact
    def __call__(self, x):  # [B, S, H] in dtype
        c = self.config
        accumulate = accumulation(self.dtype, self.residual_dtype)
        project = lambda n, name: dense(n, c.mlp_bias, name, self.dtype, accumulate)
        act = ACTIVATIONS[c.hidden_act]
        f = self.intermediate_size or c.intermediate_size
        if c.gated_mlp:  # (Falcon-H1's multiplier on the gate, after its site)
            gate, up = project(f, "gate_proj")(x), project(f, "up_proj")(x)  # [B, S, F] each
            sites = {MLP_PRE: gate, MLP_PRE_LINEAR: up}
            if c.swiglu_limit is not None:  # GLM-5-next's clamps (its sites are the projections' outputs)
                gate, up = jnp.minimum(gate, c.swiglu_limit), jnp.clip(up, -c.swiglu_limit, c.swiglu_limit)
            hidden = act(scaled(gate, c.multipliers.mlp_gate)) * up  # [B, S, F]
            sites[MLP_POST] = hidden
        else:  # GPT-2's c_fc, GPT-NeoX's dense_h_to_4h: our up_proj
            pre = project(f, "up_proj")(x)  # [B, S, F]
            hidden = act(pre)
            sites = {MLP_PRE: pre, MLP_POST: hidden}
        out = project(c.hidden_size, "down_proj")(hidden.astype(self.dtype))  # [B, S, H]
        out = scaled(out, c.multipliers.mlp_down)  # (Falcon-H1's)
        # Returned rather than sown: the MLP may run inside a scan over token chunks.
        return (out, {site: sites[site] for site in self.returned}) if self.returned else out
