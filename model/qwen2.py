"""The Qwen2 decoder in Flax linen, returning the residual stream after chosen blocks.

Axis names in shape comments:
    B batch, S query positions, T key positions (T = S without a cache), H hidden_size,
    N attention heads, K key/value heads, G = N // K query heads per kv head, D head_dim,
    F intermediate_size, V vocab_size, L decoder blocks computed.

Parameter names follow Hugging Face's (``layers_3/self_attn/q_proj/kernel`` for
``model.layers.3.self_attn.q_proj.weight``, transposed), so loading is a rename.
Attention takes an explicit boolean mask ``[B, S, T]``: a key that is masked (padding, or in the
future) never influences a query. Softmax and normalisation statistics are computed in float32,
as Hugging Face does.
"""

from __future__ import annotations

import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import Qwen2Config

KVCache = tuple[jax.Array, jax.Array]  # keys, values: [B, T, K, D] each
MASKED = -1e30  # finite, so a fully masked row (a padding row) gives no NaN


def precision_for(dtype) -> jax.lax.Precision:
    """float32 asks for full-precision matmuls (TPUs default to bfloat16 passes otherwise)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Rotary tables for ``positions`` [B, S] -> cos, sin [B, S, D] in float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # [B, S, D]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x`` [B, S, heads, D] by the tables [B, S, D] (Hugging Face's rotate_half form)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # [..., H]
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return weight * normed.astype(self.dtype)


class Attention(nn.Module):
    config: Qwen2Config
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, cos, sin, mask, cache: KVCache | None = None, cache_index=None):
        c = self.config
        b, s, _ = x.shape
        dense = lambda n, bias, name: nn.Dense(n, use_bias=bias, dtype=self.dtype,  # noqa: E731
                                               param_dtype=self.dtype, name=name,
                                               precision=precision_for(self.dtype))
        q = dense(c.num_attention_heads * c.head_dim, True, "q_proj")(x).reshape(
            b, s, c.num_attention_heads, c.head_dim)  # [B, S, N, D]
        k = dense(c.num_key_value_heads * c.head_dim, True, "k_proj")(x).reshape(
            b, s, c.num_key_value_heads, c.head_dim)  # [B, S, K, D]
        v = dense(c.num_key_value_heads * c.head_dim, True, "v_proj")(x).reshape(
            b, s, c.num_key_value_heads, c.head_dim)  # [B, S, K, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # write this step's keys/values, attend over the whole cache
            k = jax.lax.dynamic_update_slice(cache[0], k, (0, cache_index, 0, 0))  # [B, T, K, D]
            v = jax.lax.dynamic_update_slice(cache[1], v, (0, cache_index, 0, 0))
        q = q.reshape(b, s, c.num_key_value_heads, c.kv_groups, c.head_dim)  # [B, S, K, G, D]
        scores = jnp.einsum("bskgd,btkd->bkgst", q, k, precision=precision_for(self.dtype))
        scores = scores.astype(jnp.float32) / math.sqrt(c.head_dim)  # [B, K, G, S, T]
        scores = jnp.where(mask[:, None, None, :, :], scores, MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bkgst,btkd->bskgd", probs, v, precision=precision_for(self.dtype))
        out = out.reshape(b, s, c.num_attention_heads * c.head_dim)  # [B, S, N*D]
        return dense(c.hidden_size, False, "o_proj")(out), (k, v)


class MLP(nn.Module):
    config: Qwen2Config
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [B, S, H]
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype,  # noqa: E731
                                         param_dtype=self.dtype, name=name,
                                         precision=precision_for(self.dtype))
        f = self.config.intermediate_size
        hidden = nn.silu(dense(f, "gate_proj")(x)) * dense(f, "up_proj")(x)  # [B, S, F]
        return dense(self.config.hidden_size, "down_proj")(hidden)


class DecoderLayer(nn.Module):
    config: Qwen2Config
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, cos, sin, mask, cache: KVCache | None = None, cache_index=None):
        eps = self.config.rms_norm_eps
        attn_out, new_cache = Attention(self.config, self.dtype, name="self_attn")(
            RMSNorm(eps, self.dtype, name="input_layernorm")(x), cos, sin, mask, cache, cache_index)
        x = x + attn_out
        x = x + MLP(self.config, self.dtype, name="mlp")(
            RMSNorm(eps, self.dtype, name="post_attention_layernorm")(x))
        return x, new_cache


class Qwen2(nn.Module):
    """Embedding + decoder blocks (+ final norm and LM head, used by ``logits`` only)."""
    config: Qwen2Config
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype,
                                     param_dtype=self.dtype)
        self.layers = [DecoderLayer(c, self.dtype, name=f"layers_{i}")
                       for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Dense(c.vocab_size, use_bias=False, dtype=self.dtype,
                                    param_dtype=self.dtype, precision=precision_for(self.dtype))

    def __call__(self, input_ids, positions, mask, num_layers: int,
                 caches: Sequence[KVCache] | None = None, cache_index=None):
        """Runs blocks ``0..num_layers-1`` only.

        input_ids, positions: [B, S]; mask: [B, S, T] (True = may attend).
        Returns (outputs of each block computed: list of [B, S, H], new caches).
        """
        x = self.embed_tokens(input_ids)  # [B, S, H]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        outputs, new_caches = [], []
        for i in range(num_layers):
            x, cache = self.layers[i](x, cos, sin, mask, None if caches is None else caches[i],
                                      cache_index)
            outputs.append(x)
            new_caches.append(cache)
        return outputs, new_caches

    def logits(self, x):
        """Next-token logits [..., V] from the last block's output [..., H]."""
        x = self.norm(x)
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(x)
        return self.lm_head(x)


def causal_mask(lengths: jax.Array, seq_len: int) -> jax.Array:
    """[B, S, S]: query q may attend key t iff t <= q and t is a real (non-padding) token."""
    pos = jnp.arange(seq_len)
    causal = pos[None, :] <= pos[:, None]  # [S, T]
    valid = pos[None, :] < lengths[:, None]  # [B, T]
    return causal[None, :, :] & valid[:, None, :]
