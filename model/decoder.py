"""The decoder in Flax linen, for every supported family, returning the residual stream after
chosen blocks.

One module whose family differences are the switches of its ``DecoderConfig`` (see
``model/config.py``): nothing here knows a family by name. A block is

    x = x + post_attention_norm(attention(pre_attention_norm(x)))
    x = x + post_mlp_norm(mlp(pre_mlp_norm(x)))

with the pre-norms only where ``pre_norms`` (not OLMo 2), the post-norms only where
``sandwich_norms`` (Gemma 2, 3, OLMo 2), each an RMSNorm or a LayerNorm (``norm``); with a
``parallel_residual`` (GPT-NeoX) both sublayers read the block's input instead:

    x = mlp(pre_mlp_norm(x)) + attention(pre_attention_norm(x)) + x

The MLP is gated or plain (``gated_mlp``), or a mixture of experts (``moe``: ``model.moe``); q
and k are normed before RoPE where ``qk_norm``, per head or over the whole projection; RoPE
rotates each head's first ``rope_dim`` dims, with each layer's sliding window and RoPE from its
layer type, or positions are a learned table added to the embeddings (``positions``: GPT-2).

Axis names in shape comments:
    B batch, S query positions, T key positions (T = S without a cache), H hidden_size,
    N attention heads, K key/value heads, G = N // K query heads per kv head, D head_dim,
    F intermediate_size, V vocab_size, L decoder blocks computed.

Parameter names: ``layers_3/self_attn/q_proj/kernel`` is ``model.layers.3.self_attn.q_proj.weight``
transposed; the block's norms are named for their place (``pre_attention_norm``, ...), which
``model.params`` maps to each family's names. Attention takes an explicit boolean mask
``[B, S, T]``: a key that is masked (padding, or in the future) never influences a query.
Without a cache, attention is causal: the mask must allow no future key, and the masked upper
triangle is skipped (``model.attention``). Softmax and normalisation statistics are computed in
float32, as Hugging Face does.

Numerics: ``dtype`` is the compute dtype (weights and matmul operands). ``residual_dtype`` is the
residual stream's: by default (None) the compute dtype, every sum rounded to it as Hugging Face's
bfloat16 forward does. float32 with bfloat16 compute keeps the stream in float32 (the embedding
output, every residual add, the norms, the block outputs) while matmul operands stay bfloat16 and
accumulate in float32 (``preferred_element_type``): the sum of a sublayer's output and the
residual is never rounded, and the error grows far less with depth. A float32 compute dtype gives
the same graph either way.

Interventions (``model.interventions``) enter as arrays, per block: which heads, sublayers or
blocks to keep, and what replaces the others (zero or a mean), so that one compiled forward
serves every intervention of a grid. Without them the graph is the plain model's. Each block
also ``sow``s its heads' outputs, sublayer outputs and contribution into the ``stats``
collection, which only a caller that asks for it (the mean pass) receives, and every activation
site of ``model.sites`` (by its name) into the ``sites`` collection, which only the extraction
forward asks for: what it does not return is compiled away.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from model import deltanet, hyper, mamba2
from model.attention import (Window, cache_written, causal_attention, dense_attention, fused_attention, score_rows,
                             windowed)
from model.compressed import CompressedAttention
from model.heads import heads_output
from model.config import DecoderConfig, QueryTemperature
from model.indexer import LightningIndexer, MeanPoolIndexer
from model.ngram import NGramInjection
from model.rope import apply_rope, rope_cos_sin
from model.moe import MoEMLP, dispatch_for
from model.interventions import STEER_TOKENS, block_arrays, delta_key, patch_key, steer_key
from model.layers import (ACTIVATIONS, MLP, RMSNorm, accumulation, dense, norm_for, precision_for, rms_normalized,
                          scaled)
from model.sites import (ATTN_GATE, ATTN_IN, ATTN_K, ATTN_MODULE_OUT, ATTN_OUT, ATTN_PATTERN, ATTN_Q, ATTN_SCORES,
                         ATTN_V, ATTN_Z, DELTA_OUT, HC_ATTN, HC_MLP, INDEXED_KEYS, K_NORM_OUT, LN1_NORMALIZED,
                         LN2_NORMALIZED, MLP_IN, MLP_MODULE_OUT, MLP_OUT, Q_NORM_OUT, RESID_MID, RESID_POST, RESID_PRE,
                         ROT_K, ROT_Q, SSM_MODULE_OUT, SSM_OUT, EMBED, FINAL_NORMALIZED, NGRAM_OUT)

KVCache = tuple[jax.Array, jax.Array]  # keys, values: [B, T, K, D] each
BLOCK_NORMS = ("pre_attention_norm", "post_attention_norm", "pre_mlp_norm", "post_mlp_norm")


class Attention(nn.Module):
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    mesh: Mesh | None = None  # where the batch lives; causal attention then runs per device
    attention: str = "tiled"  # without a cache: tiled (causal_attention) | fused | cudnn (fused_attention) | dense
    residual_dtype: Any = None  # wider than dtype: matmuls accumulate in it, o_proj returns it
    window: Window = None       # this layer's sliding window or chunk (None: every earlier key)
    patterns: bool = False      # sow the scores and pattern too, recomputed from q and k (extraction only)

    @nn.compact
    def __call__(self, x, cos, sin, mask, positions, cache: KVCache | None = None, cache_index=None,
                 heads=None, norms=None, kv_from: KVCache | None = None):
        """x: [B, S, H] in ``dtype``. ``heads`` (keep [N] bool, fill [N] bool, mean [N, D]): a head
        not kept has its output (its slice of the o_proj input) replaced by zero, or with
        ``fill`` by its mean. ``norms``: the block's norm ablation, for the q/k norms.
        ``kv_from``: another block's keys and values (what it returned) to attend to instead of
        computing any (a kv-sharing block: ``DecoderConfig.kv_shared_layers``); its cache then."""
        c = self.config
        b, s, _ = x.shape
        accumulate = accumulation(self.dtype, self.residual_dtype)
        project = lambda n, bias, name: dense(n, bias, name, self.dtype, accumulate)
        q = project(c.num_attention_heads * c.head_dim * (2 if c.attn_output_gate else 1), c.qkv_bias, "q_proj")(x)
        gate = None
        if c.attn_output_gate:  # per head: its query, then its gate (Qwen3.5)
            q, gate = jnp.split(q.reshape(b, s, c.num_attention_heads, 2 * c.head_dim), 2, axis=-1)  # [B, S, N, D]
            q, gate = q.reshape(b, s, -1), gate.reshape(b, s, -1)  # [B, S, N*D]
            self.sow("sites", ATTN_GATE, gate)
        self.sow("sites", ATTN_Q, q)  # [B, S, N*D]
        shared = kv_from is not None
        if shared and (c.clip_qkv is not None or (c.qk_norm and c.qk_norm_scope == "projection")):
            raise ValueError("a kv-sharing block has no k or v to clip or to norm over the projection")
        k = v = None
        if not shared:
            k = project(c.num_key_value_heads * c.head_dim, c.qkv_bias, "k_proj")(x)  # [B, S, K*D]
            # Gemma 4's full layers: the values are the keys' projection (normed apart below).
            k_eq_v = c.attention_k_eq_v and self.window is None
            v = k if k_eq_v else project(c.num_key_value_heads * c.head_dim, c.qkv_bias, "v_proj")(x)  # [B, S, K*D]
            self.sow("sites", ATTN_K, k)
            self.sow("sites", ATTN_V, v)
            k = scaled(k, c.multipliers.key)  # Falcon-H1's, after k_proj
        # q/k norms before RoPE, float32 out with a wide stream (RoPE follows): over the whole
        # projection (OLMo 2) before the split into heads, or per head over head_dim after it.
        qk_norm = lambda name, y: norm_for(c, name, self.dtype, self.residual_dtype, keep_wide=True)(y, norms)
        if c.qk_norm and c.qk_norm_scope == "projection":
            q, k = qk_norm("q_norm", q), qk_norm("k_norm", k)
            self.sow("sites", Q_NORM_OUT, q)
            self.sow("sites", K_NORM_OUT, k)
        if c.clip_qkv is not None:  # OLMoE: after the norms, before the split into heads
            q, k, v = (jnp.clip(y, -c.clip_qkv, c.clip_qkv) for y in (q, k, v))
        q = q.reshape(b, s, c.num_attention_heads, c.head_dim)  # [B, S, N, D]
        if not shared:
            k = k.reshape(b, s, c.num_key_value_heads, c.head_dim)  # [B, S, K, D]
            v = v.reshape(b, s, c.num_key_value_heads, c.head_dim)  # [B, S, K, D]
        if c.qk_norm and c.qk_norm_scope == "head":
            q, k = qk_norm("q_norm", q), k if shared else qk_norm("k_norm", k)
            self.sow("sites", Q_NORM_OUT, q.reshape(b, s, -1))
            if not shared:
                self.sow("sites", K_NORM_OUT, k.reshape(b, s, -1))
        if c.value_norm and not shared:  # v / rms(v) per head, without a weight (Gemma 4)
            v = rms_normalized(v, c.norm_eps).astype(v.dtype)
        if cos is not None:  # RoPE (learned positions were added to the embeddings instead)
            rotate = lambda y: apply_rope(y, cos, sin, c.rope_interleaved)
            q, k = rotate(q), k if shared else rotate(k)
            self.sow("sites", ROT_Q, q.reshape(b, s, -1))
            if not shared:
                self.sow("sites", ROT_K, k.reshape(b, s, -1))
            if c.qk_l2_norm:  # Llama 4's: after rotary, no weight
                q, k = (y if y is None else rms_normalized(y, c.norm_eps).astype(y.dtype) for y in (q, k))
        temperature = c.query_temperature
        if temperature is not None and (cos is None or not temperature.nope_only):  # Llama 4's NoPE blocks'
            q = (q * query_temperature(positions, temperature)[:, :, None, None]).astype(q.dtype)
        divisor = c.query_scale_divisor
        scored_q = q  # [B, S, N, D]: rotated, not yet scaled
        prescaled = accumulate is not None
        if prescaled:  # rotated and scaled in float32, rounded once to matmul operands
            q = q / divisor
            q = q.astype(self.dtype)
            if not shared:
                k, v = k.astype(self.dtype), v.astype(self.dtype)
        if shared:  # already normed, rotated, rounded (and written to its block's cache)
            k, v = kv_from
        elif cache is not None:  # write this step's keys/values, attend over the whole cache
            k, v = cache_written(cache[0], k, cache_index), cache_written(cache[1], v, cache_index)  # [B, T, K, D]
        index_keys = ()
        if c.attention_indexer is not None:  # Qwen4-Exp's QSA: each query's keys chosen by the indexer
            cached = None if cache is None else lambda keys: cache_written(cache[2], keys.astype(cache[2].dtype),
                                                                          cache_index)
            mask, chosen, raw = MeanPoolIndexer(c, self.dtype, self.residual_dtype, name="indexer")(
                x, cos, sin, mask, cached)
            self.sow("sites", INDEXED_KEYS, chosen)                                     # [B, S, width] int32
            index_keys = (raw,)
        q = q.reshape(b, s, c.num_key_value_heads, c.kv_groups, c.head_dim)  # [B, S, K, G, D]
        sinks = None
        if c.attention_sinks:  # query head n = kv head * G + its group
            sinks = self.param("sinks", nn.initializers.zeros, (c.num_attention_heads,), self.dtype)
            sinks = sinks.astype(jnp.float32).reshape(c.num_key_value_heads, c.kv_groups)  # [K, G]
        cached = cache is not None or (shared and cache_index is not None)
        if self.patterns and not cached:
            scores, pattern = score_rows(scored_q, k, mask, positions, self.window, divisor,
                                         c.attn_logit_softcap, sinks)  # [B, S, N*T] each
            self.sow("sites", ATTN_SCORES, scores)
            self.sow("sites", ATTN_PATTERN, pattern)
        out = attended(q, k, v, mask, positions, c, self.attention, self.mesh, self.window, precision_for(self.dtype),
                       accumulate, None if prescaled else divisor, cached, sinks)  # [B, S, K, G, D]
        out = out.reshape(b, s, c.num_attention_heads, c.head_dim).astype(self.dtype)  # [B, S, N, D]
        if gate is not None:
            gated = out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32)).reshape(out.shape)
            out = gated.astype(self.dtype)
        out = heads_output(self, out, heads)  # [B, S, N*D]
        return project(c.hidden_size, c.o_bias, "o_proj")(out), None if shared else (k, v, *index_keys)


def attended(q, k, v, mask, positions, config: DecoderConfig, kernel: str, mesh: Mesh | None, window: Window,
             precision, accumulate, divisor: float | None, cached: bool, sinks=None) -> jax.Array:
    """Attention of q [B, S, K, G, D] over k [B, T, K, D] and v [B, T, K, Dv] (``cached``: keys at
    cache slots, one-shot; else causal, by ``kernel``; ``dense``: one-shot over the causal mask,
    whose reverse mode works with windows, soft-caps and sinks alike: attribution patching's)
    -> [B, S, K, G, Dv]. ``divisor``: None when q comes scaled already; ``sinks`` [K, G] or None."""
    c = config
    if not cached and kernel in ("fused", "cudnn"):
        if sinks is not None:
            raise ValueError("the fused attention kernels have no attention sinks (attention_for picks tiled)")
        # The kernels take one head size: the narrower of q/k and v (a latent attention's) zero-padded
        # to the other's, which changes no score and no value; then scaled as told, not by 1/sqrt(D).
        d, dv = q.shape[-1], v.shape[-1]
        pad = lambda x, width: jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, width - x.shape[-1]),))
        q, k, v = pad(q, max(d, dv)), pad(k, max(d, dv)), pad(v, max(d, dv))
        default = c.query_pre_attn_scalar in (None, c.attention_head_dim) and d >= dv
        scale = 1.0 if divisor is None else (None if default else 1 / divisor)
        out = fused_attention(q, k, v, mask, precision, scale, window, "cudnn" if kernel == "cudnn" else None)
        return out[..., :dv]
    if not cached and kernel != "dense":
        return causal_attention(q, k, v, mask, precision, mesh, accumulate, divisor, c.attn_logit_softcap, window,
                                sinks)
    return dense_attention(q, k, v, windowed(mask, positions, window), precision, accumulate, divisor,
                           c.attn_logit_softcap, sinks)


def query_temperature(positions: jax.Array, temperature: QueryTemperature) -> jax.Array:
    """Each position's query scale [B, S], float32: 1 + beta * log(1 + floor((p + offset) / span))
    (1 in the first positions)."""
    shifted = positions.astype(jnp.float32) + temperature.offset
    return 1 + temperature.beta * jnp.log1p(jnp.floor(shifted / temperature.span))


class LatentAttention(nn.Module):
    """Multi-head latent attention (``DecoderConfig.mla``: DeepSeek-V2/V3), as transformers'
    ``DeepseekV3Attention`` computes it. Its cache for decoding holds, per position, the normed
    latent [B, T, 1, kv_lora_rank] and the rotated key part every head shares [B, T, 1, rope dims]:
    each step expands the whole cache through ``kv_b_proj`` again (what transformers does; the
    cache is (2 * N * qk head size) / (kv_lora_rank + rope dims) times smaller than keys and values)."""
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    mesh: Mesh | None = None
    attention: str = "tiled"
    residual_dtype: Any = None

    @nn.compact
    def __call__(self, x, cos, sin, mask, positions, cache: KVCache | None = None, cache_index=None, heads=None,
                 norms=None, index_from: tuple[jax.Array, jax.Array] | None = None):
        """x: [B, S, H] in ``dtype``; the rest as ``Attention``'s (``norms``: for the q and latent
        norms); ``index_from``: the keys an earlier block's indexer chose (its narrowed mask [B, S, T],
        their positions [B, S, topk]) for a block without an indexer of its own (GLM-5's shared ones).
        -> ([B, S, H], (latent, key part[, index keys]), the keys chosen as ``index_from`` or None)."""
        c, m = self.config, self.config.mla
        b, s, _ = x.shape
        n, dn, dr, dv = c.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, c.head_dim
        accumulate = accumulation(self.dtype, self.residual_dtype)
        project = lambda width, bias, name: dense(width, bias, name, self.dtype, accumulate)
        norm = lambda name, y: RMSNorm(m.norm_eps, self.dtype, self.residual_dtype, name=name)(y, norms)
        if m.q_lora_rank:
            q_resid = norm("q_a_layernorm", project(m.q_lora_rank, c.qkv_bias, "q_a_proj")(x))  # [B, S, Rq]
            q = project(n * m.qk_head_dim, False, "q_b_proj")(q_resid)
        else:
            q = project(n * m.qk_head_dim, False, "q_proj")(x)
        q = q.reshape(b, s, n, m.qk_head_dim)                                           # [B, S, N, Dn + Dr]
        compressed = project(m.kv_lora_rank + dr, c.qkv_bias, "kv_a_proj_with_mqa")(x)  # [B, S, R + Dr]
        latent = norm("kv_a_layernorm", compressed[..., :m.kv_lora_rank])[:, :, None]   # [B, S, 1, R]
        rotate = lambda y: (y if cos is None  # a block that does not rotate (Kimi Linear's: NoPE)
                            else apply_rope(y.astype(jnp.float32), cos, sin).astype(y.dtype) if m.rope_in_float32
                            else apply_rope(y, cos, sin))
        q_rot, k_rot = rotate(q[..., dn:]), rotate(compressed[..., None, m.kv_lora_rank:])  # [B, S, N|1, Dr]
        prescaled = accumulate is not None
        q = jnp.concatenate([q[..., :dn], q_rot], axis=-1)
        if c.query_temperature is not None:  # Mistral 4's: queries past P positions scaled up
            q = q * query_temperature(positions, c.query_temperature).astype(q.dtype)[:, :, None, None]
        divisor = c.query_scale_divisor
        if prescaled:  # scaled in float32, rounded once to matmul operands
            q, k_rot = (q / divisor).astype(self.dtype), k_rot.astype(self.dtype)
        if cache is not None:  # the compressed keys and values are what a cache holds
            latent, k_rot = cache_written(cache[0], latent, cache_index), cache_written(cache[1], k_rot, cache_index)
        index_keys, picked = (), None
        if m.indexer is not None and index_from is not None:  # an earlier block's choice (GLM-5's shared blocks)
            picked = index_from
        elif m.indexer is not None:  # DeepSeek sparse attention: each query's keys chosen by the indexer
            cached = None if cache is None else lambda keys: cache_written(cache[2], keys.astype(cache[2].dtype),
                                                                          cache_index)
            narrowed, chosen, keys = LightningIndexer(c, self.dtype, self.residual_dtype, name="indexer")(
                x, q_resid, cos, sin, mask, cached)
            picked, index_keys = (narrowed, chosen), (keys,)
        if picked is not None:
            mask = picked[0]
            self.sow("sites", INDEXED_KEYS, picked[1])                                  # [B, S, topk] int32
        t = latent.shape[1]
        kv = project(n * (dn + dv), False, "kv_b_proj")(latent[:, :, 0]).reshape(b, t, n, dn + dv)
        if prescaled:
            kv = kv.astype(self.dtype)
        k = jnp.concatenate([kv[..., :dn], jnp.broadcast_to(k_rot, (b, t, n, dr)).astype(kv.dtype)], axis=-1)
        out = attended(q[:, :, :, None], k, kv[..., dn:], mask, positions, c, self.attention, self.mesh, None,
                       precision_for(self.dtype), accumulate, None if prescaled else divisor,
                       cache is not None)                                                # [B, S, N, 1, Dv]
        out = heads_output(self, out.reshape(b, s, n, dv).astype(self.dtype), heads)    # [B, S, N*Dv]
        return project(c.hidden_size, c.o_bias, "o_proj")(out), (latent, k_rot, *index_keys), picked


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet mixer (``DecoderConfig.deltanet``; the recurrence: ``model.deltanet``), as
    transformers' ``Qwen3_5GatedDeltaNet`` computes it, or Kimi Delta Attention, as its
    ``KimiLinearDeltaAttention`` does (``DeltaNet.channel_decay``: a decay per key channel, the gates
    through a low rank, a sigmoid output gate). Its cache for decoding (``model.generate``) is (the
    convolution's last K - 1 inputs of q, k and v, [B, K - 1, C] each in the compute dtype, the
    recurrent state [B, Hv, Dk, Dv] in float32): a prefill leaves each row's as of its last real
    token, a step advances every row by one position."""
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None
    chunk_size: int = 64

    @nn.compact
    def __call__(self, x, mask, cache=None, cache_index=None):
        """x: [B, S, H] in ``dtype``; ``mask`` [B, S, T] (causal_mask's): each row's length is its
        diagonal's count of real positions. ``cache``: None (no decoding), or the states a prefill
        (``cache_index`` a scalar) replaces or a step (``cache_index`` [B], S = 1) advances.
        -> ([B, S, H], the new cache or None)."""
        c, d = self.config, self.config.deltanet
        b, s, _ = x.shape
        accumulate = accumulation(self.dtype, self.residual_dtype)
        project = lambda n, name: dense(n, False, name, self.dtype, accumulate)

        def gate_input(width, name, low_rank_names):  # Kimi's gates pass through a low rank
            if d.gate_rank is None:
                return project(width, name)(x)
            return project(width, low_rank_names[1])(project(d.gate_rank, low_rank_names[0])(x))

        z = gate_input(d.value_dim, "in_proj_z", ("g_a_proj", "g_b_proj")).reshape(b, s, d.num_value_heads,
                                                                                  d.value_head_dim)
        beta_in = project(d.num_value_heads, "in_proj_b")(x)                           # [B, S, Hv]
        decays = d.key_dim if d.channel_decay else d.num_value_heads
        a = gate_input(decays, "in_proj_a", ("f_a_proj", "f_b_proj"))                   # [B, S, Hv | Hv*Dk]
        dt_bias = self.param("dt_bias", nn.initializers.ones, (decays,), self.dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (d.num_value_heads,), self.dtype)
        stepping = cache is not None and jnp.ndim(cache_index) == 1
        lengths = None if stepping else row_lengths(mask, s)  # [B]
        # q, k and v apart (transformers' in_proj_qkv and conv1d are split at load time), so that
        # each is split by whole heads over a mesh's model axis; the convolution is per channel.
        parts, conv_states = [], []
        for i, (part, width) in enumerate((("q", d.key_dim), ("k", d.key_dim), ("v", d.value_dim))):
            mixed = project(width, f"in_proj_{part}")(x)                                # [B, S, C]
            weight = self.param(f"conv_{part}", nn.initializers.normal(0.02), (width, 1, d.conv_kernel), self.dtype)
            out, conv_state = convolved(mixed, weight[:, 0, :], lengths, None if cache is None else cache[0][i])
            parts.append(out)
            conv_states.append(conv_state)
        q = parts[0].reshape(b, s, d.num_key_heads, d.key_head_dim)
        k = parts[1].reshape(b, s, d.num_key_heads, d.key_head_dim)
        v = parts[2].reshape(b, s, d.num_value_heads, d.value_head_dim)
        beta = jax.nn.sigmoid(beta_in.astype(jnp.float32))
        if d.beta_scale != 1.0:  # (transformers multiplies in the compute dtype: exact for 2)
            beta = beta * d.beta_scale
        g = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
        rate = jnp.exp(a_log.astype(jnp.float32))
        if d.channel_decay:  # [B, S, Hv, Dk]: each head's rate over its channels
            g, rate = g.reshape(b, s, d.num_value_heads, d.key_head_dim), rate[:, None]
        if d.decay_lower_bound is not None:  # GLM-5-next's: within (bound, 0)
            g = d.decay_lower_bound * jax.nn.sigmoid(rate * g)
        else:
            g = -rate * jax.nn.softplus(g)                                              # [B, S, Hv(, Dk)]
        if stepping:
            out, state = deltanet.recurrent(q, k, v, g, beta, cache[1])                # [B, 1, Hv, Dv] float32
        else:
            g, beta = deltanet.masked_gates(g, beta, lengths)  # padding neither decays nor writes the state
            out, state = deltanet.chunked(q, k, v, g, beta, chunk_size=self.chunk_size)  # [B, S, Hv, Dv] float32
        out = out.astype(self.dtype)
        self.sow("sites", DELTA_OUT, out.reshape(b, s, d.value_dim))                      # [B, S, Hv*Dv]
        norm_weight = self.param("norm", nn.initializers.ones, (d.value_head_dim,), self.dtype)
        normed = rms_normalized(out, c.norm_eps if d.norm_eps is None else d.norm_eps)   # float32
        if d.norm_in_float32:
            weighted = norm_weight.astype(jnp.float32) * normed
        else:
            weighted = (norm_weight * normed.astype(self.dtype)).astype(jnp.float32)
        gate = jax.nn.sigmoid if d.output_gate == "sigmoid" else jax.nn.silu
        out = (weighted * gate(z.astype(jnp.float32))).astype(self.dtype).reshape(b, s, d.value_dim)  # [B, S, Hv*Dv]
        return project(c.hidden_size, "out_proj")(out), None if cache is None else (tuple(conv_states), state)

def convolved(mixed: jax.Array, weight: jax.Array, lengths: jax.Array | None, cached: jax.Array | None,
              bias: jax.Array | None = None):
    """A recurrent mixer's causal convolution (``causal_conv``) of ``mixed`` [B, S, C] (``weight``
    [C, K], ``bias`` [C] or None) and its cache: decoding (``lengths`` None) a step reads the
    ``cached`` last K - 1 inputs before it; a prefill (``cached`` given) keeps each row's last K - 1
    at its own length (zeros before its first). -> ([B, S, C] in the dtype, the new cache or None)."""
    taps = weight.shape[-1] - 1
    if lengths is None:  # one position a row
        window = jnp.concatenate([cached, mixed], axis=1)                            # [B, K, C]
        return causal_conv(window, weight, bias)[:, -1:], window[:, 1:]
    conv_state = None
    if cached is not None:
        s = mixed.shape[1]
        where = lengths[:, None] - taps + jnp.arange(taps)[None, :]                    # [B, K - 1]
        kept = jnp.take_along_axis(mixed, jnp.clip(where, 0, s - 1)[..., None], axis=1)
        conv_state = jnp.where((where >= 0)[..., None], kept, 0).astype(mixed.dtype)
    return causal_conv(mixed, weight, bias), conv_state


def causal_conv(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """SiLU of a causal depthwise convolution: x [B, S, C], weight [C, K] (plus ``bias`` [C]) ->
    [B, S, C], each position from itself and the K - 1 before it (zeros before the first),
    computed in float32 and rounded once."""
    taps = weight.shape[-1]
    padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (taps - 1, 0), (0, 0)))  # [B, S + K - 1, C]
    w = weight.astype(jnp.float32)
    out = sum(padded[:, j:j + x.shape[1]] * w[:, j] for j in range(taps))
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return jax.nn.silu(out).astype(x.dtype)


def row_lengths(mask: jax.Array, s: int) -> jax.Array:
    """Each row's count of real positions [B], from ``causal_mask``'s [B, S, T] diagonal."""
    return jnp.sum(jnp.diagonal(mask[:, :, :s], axis1=1, axis2=2), axis=-1)


class Mamba2Mixer(nn.Module):
    """A Mamba-2 mixer (``DecoderConfig.mamba``; the recurrence: ``model.mamba2``), as transformers'
    ``GraniteMoeHybridMambaLayer`` computes it. Its cache for decoding is (the convolution's last
    K - 1 inputs [B, K - 1, conv_dim] in the compute dtype, the state [B, H, P, N] in float32),
    kept as ``GatedDeltaNet``'s is. The state itself is no site: [head_dim, state_size] per head
    and token, hundreds of thousands of floats a token (the mixer's output, ``attn.hook_out``, is)."""
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None
    chunk_size: int = 64

    @nn.compact
    def __call__(self, x, mask, cache=None, cache_index=None):
        """x: [B, S, H] in ``dtype``; ``mask``, ``cache``, ``cache_index`` as ``GatedDeltaNet``'s
        -> ([B, S, H], the new cache or None)."""
        c, m = self.config, self.config.mamba
        b, s, _ = x.shape
        groups = m.num_groups * m.state_size
        accumulate = accumulation(self.dtype, self.residual_dtype)
        project = lambda n, name: dense(n, m.proj_bias, name, self.dtype, accumulate)
        x = scaled(x, c.multipliers.ssm_in)  # Falcon-H1's input multiplier
        # in_proj's parts apart (split at load time): the gate, the convolution's input, dt.
        z = project(m.inner, "in_proj_z")(x)                                         # [B, S, I]
        mixed = project(m.conv_dim, "in_proj_xbc")(x)                                # [B, S, I + 2 G N]
        dt = project(m.num_heads, "in_proj_dt")(x)                                   # [B, S, H]
        if m.projection_multipliers:  # Falcon-H1's per-part multipliers of in_proj's output (its mup_vector)
            # a buffer of the model's dtype in transformers: each multiplier rounded to it, then multiplied
            zm, xm, bm, cm, dtm = (jnp.asarray(v, self.dtype).astype(jnp.float32) for v in m.projection_multipliers)
            parts = jnp.concatenate([jnp.full((m.inner,), xm), jnp.full((groups,), bm), jnp.full((groups,), cm)])
            z, mixed, dt = scaled(z, zm), scaled(mixed, parts), scaled(dt, dtm)              # parts: [I + 2 G N]
        weight = self.param("conv", nn.initializers.normal(0.02), (m.conv_dim, 1, m.conv_kernel), self.dtype)
        bias = self.param("conv_bias", nn.initializers.zeros, (m.conv_dim,), self.dtype) if m.conv_bias else None
        stepping = cache is not None and jnp.ndim(cache_index) == 1
        lengths = None if stepping else row_lengths(mask, s)
        mixed, conv_state = convolved(mixed, weight[:, 0, :], lengths, None if cache is None else cache[0], bias)
        xs = mixed[..., :m.inner].reshape(b, s, m.num_heads, m.head_dim)            # [B, S, H, P]
        bs = mixed[..., m.inner:m.inner + groups].reshape(b, s, m.num_groups, m.state_size)
        cs = mixed[..., m.inner + groups:].reshape(b, s, m.num_groups, m.state_size)
        a = -jnp.exp(self.param("A_log", nn.initializers.zeros, (m.num_heads,), self.dtype).astype(jnp.float32))
        d = self.param("D", nn.initializers.ones, (m.num_heads,), self.dtype)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (m.num_heads,), self.dtype)
        # transformers' decoding step, as mamba_ssm's, does not clamp dt: only the forward over a sequence does.
        limit = (0.0, jnp.inf) if stepping else m.time_step_limit
        steps = mamba2.time_steps(dt, dt_bias, limit)                               # [B, S, H] float32
        if stepping:
            y, state = mamba2.recurrent(xs, steps, a, bs, cs, d, cache[1])            # [B, 1, H, P] float32
        else:
            steps = mamba2.masked_steps(steps, lengths)  # padding neither decays nor writes the state
            y, state = mamba2.chunked(xs, steps, a, bs, cs, d, chunk_size=self.chunk_size)
        gate = jax.nn.silu(z.astype(jnp.float32)).reshape(b, s, m.num_groups, -1)   # [B, S, G, I/G]
        y = y.reshape(b, s, m.num_groups, -1)
        if m.gated_norm:  # RMS-normed per group of channels (y x SiLU(z), or y gated after), in float32
            norm_weight = self.param("norm", nn.initializers.ones, (m.inner,), self.dtype).astype(jnp.float32)
            normed = rms_normalized(y if m.norm_before_gate else y * gate, c.norm_eps)
            y = norm_weight.reshape(m.num_groups, -1) * normed
            out = y * gate if m.norm_before_gate else y
        else:  # Falcon-H1 without its mamba_rms_norm: gated alone
            out = y * gate
        out = out.reshape(b, s, m.inner).astype(self.dtype)                         # [B, S, I]
        return project(c.hidden_size, "out_proj")(out), None if cache is None else (conv_state, state)


CHUNK_TOKENS = 512  # per device; a chunk's [tokens, F] intermediates then stay in cache


def chunk_tokens_for(mesh: Mesh) -> int | None:
    """Per-token chunking for CPU meshes only: TPU and GPU matmul units want the largest operands,
    and each loop step costs them more than it saves."""
    return CHUNK_TOKENS if mesh.devices.flat[0].platform == "cpu" else None


def token_chunks(seq_len: int, rows: int, target: int = CHUNK_TOKENS) -> int:
    """How many chunks of whole positions to cut [rows, seq_len] tokens into: the fewest that
    divide ``seq_len`` with at most ``target`` tokens each; 1 (no chunking) when it is small
    already, or when such chunks would hold under target/4 tokens (a prime length, say)."""
    n = max(1, -(-seq_len * rows // target))
    while seq_len % n:
        n += 1
    return n if seq_len // n * rows * 4 >= target else 1


def map_over_token_chunks(module: nn.Module, x: jax.Array, mesh: Mesh | None,
                          chunk_tokens: int | None, *args: Any) -> Any:
    """``module(x, *args)`` for a per-token module, computed in chunks of positions one after the
    other (its output: an array [B, S, W], or a pytree of them; ``args``: the same for every chunk).

    On CPU the MLP of 8192 tokens at once reaches ~70% of a plain matmul's FLOP rate, because its
    [B*S, F] intermediates (160 MB each) go to memory; in chunks of ~512 tokens it reaches ~93%.
    The loop runs over positions, never over the (possibly sharded) batch axis. ``chunk_tokens``
    None: one piece.  x: [B, S, H] -> [B, S, W] each.
    """
    b, s, h = x.shape
    if chunk_tokens is None:
        return module(x, *args)
    n = token_chunks(s, b // (mesh.shape["data"] if mesh is not None else 1), chunk_tokens)
    if n == 1:
        return module(x, *args)
    chunks = x.reshape(b, n, s // n, h).transpose(1, 0, 2, 3)  # [n, B, S/n, H]
    step = nn.scan(lambda mdl, carry, chunk: (carry, mdl(chunk, *args)), variable_broadcast="params",
                   split_rngs={"params": False})
    _, out = step(module, None, chunks)  # [n, B, S/n, W] each
    return jax.tree.map(lambda y: y.transpose(1, 0, 2, 3).reshape(b, s, y.shape[-1]), out)


def steered(x: jax.Array, vector: jax.Array | None, tokens: jax.Array | None = None) -> jax.Array:
    """``x`` [B, S, H] plus a steering's ``vector`` [H] (None: none) at the ``tokens`` [B, S]
    (bool; None: every token); elsewhere, and where the vector is zero (a block it does not
    steer), ``x`` bit for bit (-0.0 kept)."""
    if vector is None:
        return x
    vector = vector.astype(x.dtype)
    skip = vector == 0 if tokens is None else (vector == 0) | ~tokens[..., None]  # [H] or [B, S, H]
    return jnp.where(skip, x, x + vector)


def patched(x: jax.Array, values: jax.Array | None, tokens: jax.Array | None, delta: jax.Array | None = None
            ) -> jax.Array:
    """``x`` [B, S, H] with each slot's ``values`` [K, B, S, H] in place at the ``tokens`` [K, B, S]
    (bool) it replaces at this block (``model.interventions.block_arrays``; None: no patch at this
    site), then plus ``delta`` [B, S, H] (None: none): the point at which attribution patching
    differentiates the metric; elsewhere ``x`` bit for bit."""
    for slot in range(0 if values is None else values.shape[0]):
        x = jnp.where(tokens[slot][..., None], values[slot].astype(x.dtype), x)
    return x if delta is None else x + delta.astype(x.dtype)


def _replaced(out: jax.Array, ablation: dict, kind: str) -> jax.Array:
    """A sublayer's output [B, S, H], unless ablated: then zero, or with fill its mean [H]."""
    if not ablation:
        return out
    fill = jnp.where(ablation[f"{kind}_fill"], ablation[f"{kind}_mean"].astype(out.dtype), 0)  # [H]
    return jnp.where(ablation[f"{kind}_keep"], out, jnp.broadcast_to(fill, out.shape))


class DecoderLayer(nn.Module):
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    mesh: Mesh | None = None
    chunk_tokens: int | None = None
    attention: str = "tiled"
    residual_dtype: Any = None  # the dtype of x and of the sums (None: dtype)
    window: Window = None       # this layer's sliding window or chunk
    mlp_sites: tuple[str, ...] = ()  # sow these of the MLP's hidden sites (wider outputs of its chunked loop)
    sparse: bool = False        # the MLP is the config's mixture of experts (model.moe)
    moe_dispatch: str = "auto"  # model.config.MOE_DISPATCHES
    routing_sites: bool = False  # sow the router's logits and choice (and the shared expert's output)
    deltanet: bool = False      # the mixer is Gated DeltaNet (config.deltanet), not attention
    mamba: bool = False         # the mixer is Mamba-2 (config.mamba), not attention
    patterns: bool = False      # attention sows its scores and pattern (Attention.patterns)
    has_mixer: bool = True      # off: a block of its MLP alone (DecoderConfig.sublayers: Nemotron-H's)
    has_mlp: bool = True        # off: a block of its mixer alone
    parallel_mamba: bool = False  # a Mamba-2 mixer beside attention (config.mamba.parallel: Falcon-H1's)
    layer: int | None = None    # the block's number (where blocks differ by a list: DeepSeek-V4's attention
                                # kinds and hash routers)

    @nn.compact
    def __call__(self, x, cos, sin, mask, positions, cache: KVCache | None = None, cache_index=None,
                 ablation=None, kv_from: KVCache | None = None, per_layer_input: jax.Array | None = None,
                 index_from: tuple[jax.Array, jax.Array] | None = None, token_ids: jax.Array | None = None):
        """``ablation``: this block's slice of ``model.interventions.ablation_arrays`` (None: none);
        ``kv_from``: the keys and values it attends to instead of its own (``Attention``);
        ``per_layer_input`` [B, S, P]: its slice of the per-layer embeddings (Gemma 4); ``index_from``:
        the keys an earlier block's indexer chose (``LatentAttention``); ``token_ids`` [B, S]: what a hash
        router reads (``MoE.hash_layers``). -> (the block's output, its
        new cache, the keys its sparse attention attended to or None)."""
        c, wide = self.config, self.residual_dtype
        a = ablation or {}
        norm = (a["norm_keep"], a["norm_fill"]) if ablation is not None else None

        def steered_at(value, site):  # a steering's addition, then a patch's replacement
            value = steered(value, a.get(steer_key(site)), a.get(STEER_TOKENS))
            return patched(value, *(a.get(name) for name in patch_key(site)[:2]), a.get(delta_key(site)))
        x = steered_at(x, RESID_PRE)
        block_in = x
        new_cache, added, picked = None, None, None
        ngram_cache = None
        if c.ngram is not None and self.layer in c.ngram.layers:  # Qwen4-Exp's: before the attention collapse
            cache, ngram_cache = (None, None) if cache is None else cache
            ngram_out, ngram_cache = self.ngram_addition(x, mask, token_ids, ngram_cache, cache_index)
            x = x + ngram_out
        attn_module, mlp_module = hyper.modules(c.hyper) if c.hyper else (None, None)
        if self.has_mixer:  # (Nemotron-H's MLP-only blocks have none)
            read, mixing = self.collapsed(x, attn_module, HC_ATTN, steered_at) if c.hyper else (x, None)
            added, new_cache, picked = self.mixer_addition(read, cos, sin, mask, positions, cache, cache_index,
                                                           kv_from, a, norm, steered_at, index_from)
            if not c.parallel_residual:  # the MLP reads the stream after the mixer's addition
                x = x + added if mixing is None else hyper.written(x, added, *mixing)
                if self.has_mlp:
                    x = steered_at(x, RESID_MID)
                    self.sow("sites", RESID_MID, x)
        if self.has_mlp:
            read, mixing = self.collapsed(x, mlp_module, HC_MLP, steered_at) if c.hyper else (x, None)
            mlp_in = read
            if c.pre_norms:
                mlp_in = norm_for(c, "pre_mlp_norm", self.dtype, wide, normalized_site=LN2_NORMALIZED)(read, norm)
            self.sow("sites", MLP_IN, mlp_in)
            if self.sparse and c.moe.beside_dense:
                mlp_out = self.dense_and_experts(read, mlp_in, a, norm)
            elif self.sparse:
                hashed = self.layer in c.moe.hash_layers
                moe = MoEMLP(c, self.dtype, wide, self.mesh, self.moe_dispatch, self.routing_sites, hashed, name="mlp")
                # The grouped dispatch computes tiles of rows already: whole batches (model.moe); a hash
                # router reads each token's id, not only its chunk's values.
                chunks = self.chunk_tokens if dispatch_for(c, self.moe_dispatch) == "dense" and not hashed else None
                mlp_out = map_over_token_chunks(moe, mlp_in, self.mesh, chunks, a.get("expert_keep"),
                                                a.get("route_to"), *((None, token_ids) if hashed else ()))
                if self.routing_sites:
                    mlp_out, routing = mlp_out
                    for site, value in routing.items():
                        self.sow("sites", site, value)
            else:
                mlp_out = self.dense_mlp(mlp_in)
            self.sow("sites", MLP_MODULE_OUT, mlp_out)
            if c.sandwich_norms:
                mlp_out = norm_for(c, "post_mlp_norm", self.dtype, wide, keep_wide=True)(mlp_out, norm)
            mlp_out = steered_at(_replaced(scaled(mlp_out, c.residual_multiplier), a, "mlp"), MLP_OUT)
            self.sow("stats", "mlp_output", mlp_out)
            self.sow("sites", MLP_OUT, mlp_out)
            # Added in transformers' order: (mlp + attn) + x for a parallel block.
            if mixing is not None:
                x = hyper.written(x, mlp_out, *mixing)
            else:
                x = mlp_out + added + x if c.parallel_residual else x + mlp_out
        if per_layer_input is not None:
            x = x + self.per_layer_addition(x, per_layer_input, norm)
        if c.layer_scalar:  # the whole output scaled (Gemma 4)
            scalar = self.param("layer_scalar", nn.initializers.ones, (1,), self.dtype)
            x = x * scalar.astype(x.dtype)
        self.sow("stats", "contribution", x - block_in)
        if ablation is not None:  # a skipped block passes its input on, plus its mean contribution
            x = jnp.where(a["block_keep"], x, block_in + jnp.where(a["block_fill"], a["block_mean"].astype(x.dtype),
                                                                   jnp.zeros_like(x)))
        if ngram_cache is not None:
            new_cache = (new_cache, ngram_cache)
        return steered_at(x, RESID_POST), new_cache, picked

    def ngram_addition(self, x: jax.Array, mask, token_ids: jax.Array, cache, cache_index):
        """What Qwen4-Exp's hashed n-gram embedding adds to the streams x [B, S, N*H] (``model.ngram``),
        sowing it; and its new cache (a prefill's at each row's length, a step's advanced) or None."""
        c = self.config
        stepping = cache is not None and jnp.ndim(cache_index) == 1
        lengths = None if stepping else row_lengths(mask, x.shape[1])
        out, new_cache = NGramInjection(c.ngram, c.ngram.rank(self.layer), c.hidden_size, c.hyper.streams,
                                        c.vocab_size, c.norm_eps, self.dtype, name="ple")(
            x.astype(self.dtype), token_ids, lengths, cache)
        self.sow("sites", NGRAM_OUT, out)
        return out.astype(x.dtype), new_cache

    def collapsed(self, x: jax.Array, name: str, sites: tuple[str, str, str], steered_at
                  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array | None]]:
        """What a sublayer reads from the hyper-connection streams x [B, S, N*H]: their collapse
        [B, S, H] (steered and patched as its site), and (post, comb) to write its output back with
        (``model.hyper``; the gated kind's comb None); sows ``sites`` (collapse, write, mix)."""
        if self.config.hyper.kind == "gated":
            read, post = hyper.GatedResidual(self.config, self.dtype, self.residual_dtype, name=name)(x)
            comb = None
        else:
            read, post, comb = hyper.HyperConnection(self.config, self.dtype, name=name)(x)
        read = steered_at(read, sites[0])
        values = (read, post) if comb is None else (read, post, comb.reshape(*comb.shape[:2], -1))
        for site, value in zip(sites, values):
            self.sow("sites", site, value)
        return read, (post, comb)

    def mixer_addition(self, x, cos, sin, mask, positions, cache, cache_index, kv_from, ablation: dict, norm,
                       steered_at, index_from=None):
        """What the block's mixer adds to the stream x [B, S, H] (attention, a latent attention, Gated
        DeltaNet or Mamba-2; Falcon-H1's attention plus its parallel Mamba-2), sowing its sites, its
        new cache (a parallel block's: (attention's, Mamba-2's)) and the keys a sparse attention chose
        (or None). ``ablation``: the block's slice of the ablation arrays ({} for none), ``norm`` its
        norms' (or None); ``steered_at``: the block's steering and patching."""
        c, wide, a = self.config, self.residual_dtype, ablation
        heads = (a["head_keep"], a["head_fill"], a["head_mean"], *(a.get(k) for k in patch_key(ATTN_Z)[:2]),
                 a.get(delta_key(ATTN_Z))) if a else None
        attn_in = x
        if c.pre_norms:
            attn_in = norm_for(c, "pre_attention_norm", self.dtype, wide, normalized_site=LN1_NORMALIZED)(x, norm)
        multipliers = c.multipliers  # Falcon-H1's
        mixer_in = scaled(attn_in, multipliers.attention_in)
        self.sow("sites", ATTN_IN, mixer_in)
        attn_cache, ssm_cache = cache if self.parallel_mamba and cache is not None else (cache, None)
        picked = None
        if self.deltanet:
            out, new_cache = GatedDeltaNet(c, self.dtype, wide, name="linear_attn")(mixer_in, mask, cache, cache_index)
        elif self.mamba:
            out, new_cache = Mamba2Mixer(c, self.dtype, wide, name="mamba")(mixer_in, mask, cache, cache_index)
        elif c.compressed is not None:  # DeepSeek-V4's
            attention = CompressedAttention(c, c.compressed.kind(self.layer), self.dtype, wide, self.window,
                                            name="self_attn")
            out, new_cache = attention(mixer_in, cos, sin, mask, positions, cache, cache_index, heads, norm)
        elif c.mla is not None:
            out, new_cache, picked = LatentAttention(c, self.dtype, self.mesh, self.attention, wide, name="self_attn")(
                mixer_in, cos, sin, mask, positions, cache, cache_index, heads, norm, index_from)
        else:
            attention = Attention(c, self.dtype, self.mesh, self.attention, wide, self.window, self.patterns,
                                  name="self_attn")
            out, new_cache = attention(mixer_in, cos, sin, mask, positions, attn_cache, cache_index, heads, norm,
                                       kv_from)
        self.sow("sites", ATTN_MODULE_OUT, out)
        if c.sandwich_norms:  # what is added to the stream keeps its width
            out = norm_for(c, "post_attention_norm", self.dtype, wide, keep_wide=True)(out, norm)
        out = scaled(out, multipliers.attention_out)
        out = steered_at(_replaced(scaled(out, c.residual_multiplier), a, "attn"), ATTN_OUT)
        self.sow("stats", "attn_output", out)
        self.sow("sites", ATTN_OUT, out)
        if not self.parallel_mamba:
            return out, new_cache, picked
        # Falcon-H1: the Mamba-2 mixer beside attention, on the same normed input, added first.
        ssm_out, ssm_new = Mamba2Mixer(c, self.dtype, wide, name="mamba")(attn_in, mask, ssm_cache, cache_index)
        self.sow("sites", SSM_MODULE_OUT, ssm_out)
        ssm_out = steered_at(scaled(ssm_out, multipliers.ssm_out), SSM_OUT)
        self.sow("sites", SSM_OUT, ssm_out)
        return ssm_out + out, None if cache is None else (new_cache, ssm_new), None

    def dense_and_experts(self, x: jax.Array, mlp_in: jax.Array, ablation: dict, norm) -> jax.Array:
        """Gemma 4's mixture of experts beside its dense MLP: the MLP of ``mlp_in`` (its normed
        input) through ``post_mlp_norm_1``, plus the experts of ``pre_moe_norm(x)``, routed from the
        stream x itself, through ``post_moe_norm`` -> [B, S, H] (the post-MLP norm follows)."""
        c, wide = self.config, self.residual_dtype
        dense_out = self.dense_mlp(mlp_in)
        dense_out = norm_for(c, "post_mlp_norm_1", self.dtype, wide, keep_wide=True)(dense_out, norm)
        experts_in = norm_for(c, "pre_moe_norm", self.dtype, wide)(x, norm)
        # Not in chunks of tokens: the router reads other values (x) than the experts.
        routed = MoEMLP(c, self.dtype, wide, self.mesh, self.moe_dispatch, self.routing_sites, name="moe")(
            experts_in, ablation.get("expert_keep"), ablation.get("route_to"), x)
        if self.routing_sites:
            routed, routing = routed
            for site, value in routing.items():
                self.sow("sites", site, value)
        return dense_out + norm_for(c, "post_moe_norm", self.dtype, wide, keep_wide=True)(routed, norm)

    def dense_mlp(self, mlp_in: jax.Array) -> jax.Array:
        """The dense MLP of its normed input [B, S, H], in chunks of tokens, sowing the hidden
        sites it returns (``mlp_sites``) -> [B, S, H]."""
        mlp = MLP(self.config, self.dtype, self.residual_dtype, self.mlp_sites, name="mlp")
        out = map_over_token_chunks(mlp, mlp_in, self.mesh, self.chunk_tokens)
        if not self.mlp_sites:
            return out
        out, hidden = out
        for site, value in hidden.items():
            self.sow("sites", site, value)
        return out

    def per_layer_addition(self, x: jax.Array, per_layer_input: jax.Array, norm=None) -> jax.Array:
        """What Gemma 4's per-layer embedding adds after the MLP: the stream x [B, S, H] gated
        down to P by act(per_layer_input_gate(x)) * per_layer_input [B, S, P], projected back up
        and normed (``norm``: the block's norm ablation) -> [B, S, H] (float32 with a wider stream)."""
        c, wide = self.config, self.residual_dtype
        accumulate = accumulation(self.dtype, wide)
        gate = dense(c.per_layer_input_size, False, "per_layer_input_gate", self.dtype, accumulate)(
            x.astype(self.dtype))  # [B, S, P]
        gated = ACTIVATIONS[c.hidden_act](gate) * per_layer_input.astype(gate.dtype)  # [B, S, P]
        up = dense(c.hidden_size, False, "per_layer_projection", self.dtype, accumulate)(gated.astype(self.dtype))
        return norm_for(c, "post_per_layer_input_norm", self.dtype, wide, keep_wide=True)(up, norm)  # [B, S, H]


class PerLayerInputs(nn.Module):
    """Gemma 4's per-layer embeddings: for each token, a table row of [L, P] (x sqrt(P)) and a
    projection of its embedding (/ sqrt(H), RMS-normed per block), summed and scaled by 1/sqrt(2);
    block i reads its [P] slice. The table and projection hold the blocks computed only (loaded so)."""
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None

    @nn.compact
    def __call__(self, input_ids: jax.Array, embeddings: jax.Array, num_layers: int) -> jax.Array:
        """input_ids [B, S], embeddings [B, S, H] (scaled, in dtype) -> [B, S, L, P]."""
        c = self.config
        p = c.per_layer_input_size
        accumulate = accumulation(self.dtype, self.residual_dtype)
        width = num_layers * p
        table = nn.Embed(c.per_layer_vocab_size, width, dtype=self.dtype, param_dtype=self.dtype,
                         name="embed_tokens_per_layer")
        scale = jnp.asarray(p ** 0.5, self.dtype)  # rounded to the dtype, as Hugging Face's embed_scale
        tokens = table(input_ids) * scale  # [B, S, L*P]
        # torch multiplies by a Python float in float32 and rounds once: so do these scalings.
        projected = dense(width, False, "per_layer_model_projection", self.dtype, accumulate)(embeddings)
        projected = scaled(projected, c.hidden_size ** -0.5).reshape(*input_ids.shape, num_layers, p)
        normed = norm_for(c, "per_layer_projection_norm", self.dtype, self.residual_dtype, keep_wide=True)(projected)
        tokens = tokens.reshape(*input_ids.shape, num_layers, p).astype(normed.dtype)
        return scaled(normed + tokens, 2.0 ** -0.5)  # [B, S, L, P]


class Decoder(nn.Module):
    """Embedding + decoder blocks (+ final norm and LM head, used by ``logits`` only)."""
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    mesh: Mesh | None = None  # the mesh the batch is sharded over, if any (see causal_attention)
    chunk_tokens: int | None = None  # MLP tokens per device at a time (map_over_token_chunks)
    attention: str = "tiled"         # tiled | fused | cudnn: see model.attention.attention_for; dense: ``attended``
    residual_dtype: Any = None       # the residual stream's (None: dtype); see the module docstring
    mlp_sites: tuple[str, ...] = ()  # the blocks sow these MLP hidden sites too (``sites``; model.layers.MLP)
    moe_dispatch: str = "auto"       # how a mixture of experts dispatches tokens (model.config.MOE_DISPATCHES)
    routing_sites: bool = False      # the blocks sow their routing too (``sites``)
    pattern_layers: tuple[int, ...] = ()  # the blocks whose attention sows its scores and pattern (``sites``)

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype,
                                     param_dtype=self.dtype)
        if c.positions == "learned":
            self.embed_positions = nn.Embed(c.max_position_embeddings, c.hidden_size, dtype=self.dtype,
                                            param_dtype=self.dtype)
        self.layers = [DecoderLayer(c.layer_config(i), self.dtype, self.mesh, self.chunk_tokens, self.attention,
                                    self.residual_dtype, c.window(i), self.mlp_sites, c.is_sparse(i),
                                    self.moe_dispatch, self.routing_sites, deltanet=c.is_deltanet(i),
                                    mamba=c.is_mamba(i), patterns=i in self.pattern_layers, has_mixer=c.has_mixer(i),
                                    has_mlp=c.has_mlp(i), parallel_mamba=c.has_parallel_mamba(i), layer=i,
                                    name=f"layers_{i}")
                       for i in range(c.num_hidden_layers)]
        if c.final_norm:
            self.norm = norm_for(c, "norm", self.dtype, self.residual_dtype, normalized_site=FINAL_NORMALIZED)
        if c.hyper is not None and c.hyper.head == "gated":
            self.hc_head = hyper.GatedResidual(c, self.dtype, self.residual_dtype, inject=False)
        elif c.hyper is not None:
            self.hc_head = hyper.HyperHead(c)
        if c.per_layer_input_size:
            self.per_layer_inputs = PerLayerInputs(c, self.dtype, self.residual_dtype)
        if not c.tie_word_embeddings:
            self.lm_head = dense(c.vocab_size, False, "lm_head", self.dtype,
                                 accumulation(self.dtype, self.residual_dtype))

    def embed(self, input_ids: jax.Array, positions: jax.Array, dtype: Any = None) -> jax.Array:
        """The residual stream's start [B, S, H]: embeddings (x sqrt(H) where ``scale_embeddings``,
        the factor rounded to the compute dtype as Hugging Face does; x ``embedding_multiplier``
        where it is set, in float32; plus the learned position
        embeddings where ``positions`` is learned), in the residual dtype (or ``dtype``)."""
        x = self.embed_tokens(input_ids)  # [B, S, H]
        if self.config.positions == "learned":
            # Clipped: padding past the table (a bucket longer than the sequence) must not read
            # NaN, which an out-of-range gather gives; real positions are within it (checked).
            table = self.embed_positions(jnp.minimum(positions, self.config.max_position_embeddings - 1))
            self.sow("sites", EMBED, x)  # the tokens' part: hook_embed
            if self.residual_dtype is not None:
                return x.astype(self.residual_dtype) + table.astype(self.residual_dtype)
            return x + table
        scale = jnp.asarray(self.config.hidden_size ** 0.5, self.dtype) if self.config.scale_embeddings else None
        wide = self.residual_dtype if dtype is None else dtype
        if self.config.embedding_multiplier != 1.0:  # Granite's: multiplied in float32, rounded once
            return (x.astype(jnp.float32) * self.config.embedding_multiplier).astype(wide or x.dtype)
        if wide is not None:
            x = x.astype(wide)
            return x if scale is None else x * scale.astype(wide)
        return x if scale is None else x * scale

    def __call__(self, input_ids, positions, mask, num_layers: int,
                 caches: Sequence[KVCache] | None = None, cache_index=None, ablation=None):
        """Runs blocks ``0..num_layers-1`` only.

        input_ids, positions: [B, S]; mask: [B, S, T] (True = may attend; without caches it must
        be causal, e.g. ``model.attention.causal_mask``; sliding windows are applied per layer);
        ``caches``: each block's keys and values [B, T, K, D] (slot = position), written from slot
        ``cache_index`` (a scalar, or [B]: each row's own); a Gated DeltaNet block's states; None for
        a block that attends to another's (``DecoderConfig.kv_source``);
        ``ablation``: ``model.interventions.ablation_arrays`` (each array's first axis the block),
        or None. Returns (outputs of each block computed: list of [B, S, H] in the residual
        dtype, new caches).
        """
        c = self.config
        x = self.embed(input_ids, positions)
        if c.hyper:  # the embeddings (hook_embed) copied into every stream
            self.sow("sites", EMBED, x)
            x = hyper.expanded(x, c.hyper.streams)
        self.sow("sites", "embeddings", x)  # block 0's input
        rotations = [(c.rope_of(i), c.layer_config(i).rope_dim) for i in range(num_layers)]
        tables = {(rope, dim): rope_cos_sin(positions, dim, rope) if rope is not None else (None, None)
                  for rope, dim in dict.fromkeys(rotations)}  # cos, sin [B, S, rope_dim]
        per_layer = None
        if c.per_layer_input_size:  # from the embeddings as the compute dtype has them
            per_layer = self.per_layer_inputs(input_ids, self.embed(input_ids, positions, self.dtype),
                                              num_layers)  # [B, S, L, P]
        outputs, new_caches = [], []
        indexer = c.mla.indexer if c.mla is not None else None
        chosen = None  # the keys the last block with an indexer chose (GLM-5's shared blocks attend to them)
        for i in range(num_layers):
            block = None if ablation is None else block_arrays(ablation, i)
            source = c.kv_source(i)  # a kv-sharing block attends to an earlier block's keys and values
            reuses = indexer is not None and not indexer.owns(i)
            if reuses and chosen is None:
                raise ValueError(f"block {i} reuses an earlier block's choice of keys, but no block before it has "
                                 "an indexer")
            x, cache, picked = self.layers[i](x, *tables[rotations[i]], mask, positions,
                                              None if caches is None or source is not None else caches[i],
                                              cache_index, block, None if source is None else new_caches[source],
                                              None if per_layer is None else per_layer[:, :, i],
                                              chosen if reuses else None, input_ids)
            chosen = chosen if picked is None else picked
            outputs.append(x)
            new_caches.append(cache)
        return outputs, new_caches

    def logits(self, x):
        """Next-token logits [..., V] from the last block's output [..., H] (hyper-connections' [..., N*H])."""
        return self.unembed(self.final_norm(x))

    def final_norm(self, x):
        """The last block's output [..., H] through the final norm (hyper-connections' streams [..., N*H]
        first collapsed into one: ``model.hyper.HyperHead``, or the gated kind's collapse with no norm after)."""
        hc = self.config.hyper
        if hc is not None and hc.head == "gated":
            x = self.hc_head(x)[0]
        elif hc is not None:
            x = self.hc_head(x)
        return self.norm(x) if self.config.final_norm else x

    def unembed(self, h):
        """Logits [..., V] of a final-normed hidden state [..., H]: linear in it (no bias), divided by
        ``logits_scaling`` (Granite) or times Falcon-H1's ``lm_head`` multiplier, soft-capped where
        ``final_logit_softcap`` (Gemma 2)."""
        accumulate = accumulation(self.dtype, self.residual_dtype)
        if self.config.tie_word_embeddings and accumulate is not None:
            logits = jnp.einsum("...h,vh->...v", h.astype(self.dtype), self.embed_tokens.embedding,
                                precision=precision_for(self.dtype), preferred_element_type=accumulate)
        elif self.config.tie_word_embeddings:
            logits = self.embed_tokens.attend(h)
        else:
            logits = self.lm_head(h)
        if self.config.logits_scaling != 1.0:  # Granite's
            logits = (logits.astype(jnp.float32) / self.config.logits_scaling).astype(logits.dtype)
        logits = scaled(logits, self.config.multipliers.lm_head)  # Falcon-H1's
        cap = self.config.final_logit_softcap
        return logits if cap is None else jnp.tanh(logits / cap) * cap
