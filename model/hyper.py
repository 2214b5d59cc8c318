"""Hyper-connections (``model.config.HyperConnections``): the residual as N streams per token,
collapsed into the one vector a sublayer reads and written back into every stream. The
manifold-constrained kind (GLM-5-next's, DeepSeek-V4's) writes back with a learned mix of the
streams; the gated kind (Qwen4-Exp's) reads a gated mean of the normed streams and adds the output
to each stream with its own weight.

The stream is held flat, [B, S, N x H] stream-major, so that every site, steering and statistic
of the residual sees one array per token (``hook_resid_post`` is transformers' [B, S, N, H]
block output flattened). The coefficients are computed in float32 from the float32 streams, as
transformers' module does; the mixing is in the stream's dtype, as transformers' decoder layer
mixes.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import DecoderConfig
from model.layers import RMSNorm, accumulation, dense, rms_normalized

HIGHEST = jax.lax.Precision.HIGHEST
# Each sublayer's hyper-connection module, named as transformers names them (parameters and sites are found by them).
ATTN_MODULE, MLP_MODULE = "attn_hc", "ffn_hc"
GATED_ATTN_MODULE, GATED_MLP_MODULE = "attn_hyper_connection", "mlp_hyper_connection"  # the gated kind's
GATED_HEAD = "hyper_connection_mixer"  # the gated kind's final collapse


def modules(hyper) -> tuple[str, str]:
    """The attention and MLP hyper-connection modules' names for ``hyper``'s kind."""
    return (GATED_ATTN_MODULE, GATED_MLP_MODULE) if hyper.kind == "gated" else (ATTN_MODULE, MLP_MODULE)


class HyperConnection(nn.Module):
    """One sublayer's hyper-connection (transformers' ``attn_hc`` / ``ffn_hc``: ``fn``, ``base``,
    ``scale``)."""
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """streams [B, S, N*H] -> (pre-collapse: what the sublayer reads [B, S, H] in the streams'
        dtype, post [B, S, N] and comb [B, S, N, N] in float32)."""
        hc, h = self.config.hyper, self.config.hidden_size
        n = hc.streams
        b, s, _ = streams.shape
        width = (2 + n) * n  # pre (N), post (N), comb (N x N)
        fn = self.param("fn", nn.initializers.normal(0.02), (width, n * h), self.dtype)  # transformers' [out, in]
        base = self.param("base", nn.initializers.zeros, (width,), jnp.float32)
        scale = self.param("scale", nn.initializers.ones, (3,), jnp.float32)
        normed = rms_normalized(streams, hc.norm_eps)                                   # [B, S, N*H] float32
        mixes = jnp.einsum("bsi,oi->bso", normed, fn.astype(jnp.float32), precision=HIGHEST)  # [B, S, (2+N)N]
        pre = jax.nn.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + hc.eps                # [B, S, N]
        post = 2 * jax.nn.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])           # [B, S, N]
        comb = mixes[..., 2 * n:].reshape(b, s, n, n) * scale[2] + base[2 * n:].reshape(n, n)
        comb = sinkhorn(jax.nn.softmax(comb, axis=-1) + hc.eps, hc.sinkhorn_iters, hc.eps)  # [B, S, N, N]
        split = streams.reshape(b, s, n, h)
        collapsed = jnp.sum(pre[..., None] * split.astype(jnp.float32), axis=2).astype(streams.dtype)  # [B, S, H]
        return collapsed, post, comb


class GatedResidual(nn.Module):
    """Qwen4-Exp's gated residual around one sublayer (transformers' ``Qwen4ExpTextGatedResidual``:
    ``hc_norm``, ``input_mix_weight_down``, ``input_mix_weight_up``, with ``inject``
    ``block_inject_weight``; the final collapse has none). Computed in the compute dtype, the norm
    in float32 and rounded, as transformers' module does."""
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    residual_dtype: object = None
    inject: bool = True

    @nn.compact
    def __call__(self, streams: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """streams [B, S, N*H] -> (what the sublayer reads [B, S, H]: mean_k gate_k * normed_k in
        ``dtype``, the write weights inj [B, S, N] = 2 sigmoid(inject(normed) / N), or None without
        ``inject``)."""
        hc, h = self.config.hyper, self.config.hidden_size
        n = hc.streams
        accumulate = accumulation(self.dtype, self.residual_dtype)
        project = lambda width, name: dense(width, False, name, self.dtype, accumulate)
        normed = RMSNorm(self.config.norm_eps, self.dtype, unit_offset=True, groups=n, name="hc_norm")(streams)
        down = project(hc.rank, "input_mix_weight_down")(normed).astype(self.dtype)      # [B, S, rank]
        # Each step rounded to the compute dtype, as transformers computes it there.
        low = jax.nn.silu((down / n).astype(self.dtype))
        gate = jax.nn.sigmoid(project(n * h, "input_mix_weight_up")(low).astype(self.dtype))  # [B, S, N*H]
        gated = (gate * normed).reshape(*streams.shape[:-1], n, h)                          # [B, S, N, H]
        read = jnp.mean(gated.astype(jnp.float32), axis=-2).astype(self.dtype)            # [B, S, H]
        if not self.inject:
            return read, None
        inject = project(n, "block_inject_weight")(normed).astype(self.dtype)               # [B, S, N]
        return read, 2 * jax.nn.sigmoid((inject / n).astype(self.dtype))


def sinkhorn(comb: jax.Array, iterations: int, eps: float) -> jax.Array:
    """Sinkhorn-Knopp as transformers runs it: columns normalised, then ``iterations - 1`` times
    rows then columns (each sum plus ``eps``); comb [..., N, N] -> nearly doubly stochastic (its
    columns to within eps, as the last step normalises them)."""
    comb = comb / (comb.sum(-2, keepdims=True) + eps)

    def step(_, c):
        c = c / (c.sum(-1, keepdims=True) + eps)
        return c / (c.sum(-2, keepdims=True) + eps)
    return jax.lax.fori_loop(0, iterations - 1, step, comb)


def expanded(embeddings: jax.Array, streams: int) -> jax.Array:
    """The first block's input: the embeddings [B, S, H] copied into each stream -> [B, S, N*H]."""
    return jnp.tile(embeddings, (1, 1, streams))


def written(streams: jax.Array, out: jax.Array, post: jax.Array, comb: jax.Array | None) -> jax.Array:
    """The streams after a sublayer: post_k out + sum_j comb_jk x_j for each stream k (the gated
    kind, ``comb`` None: post_k out + x_k), in the streams' dtype (transformers rounds post and comb
    to it). streams [B, S, N*H], out [B, S, H], post [B, S, N], comb [B, S, N, N] -> [B, S, N*H]."""
    b, s, n = post.shape
    dtype = streams.dtype
    split = streams.reshape(b, s, n, -1)                                                   # [B, S, N, H]
    mixed = split if comb is None else jnp.einsum("bsjk,bsjh->bskh", comb.astype(dtype), split,
                                                  precision=HIGHEST)                       # [B, S, N, H]
    return (post.astype(dtype)[..., None] * out.astype(dtype)[:, :, None] + mixed).reshape(b, s, -1)


class HyperHead(nn.Module):
    """The last block's streams [..., N*H] as one [..., H] before the final norm (``HyperConnections.head``):
    their mean (GLM-5-next's), or weighted per token (DeepSeek-V4's ``hc_head``: ``hc_fn`` [N, N H],
    ``hc_base`` [N], ``hc_scale`` [1], all float32 as transformers keeps them): sum_j (sigmoid(scale
    (fn @ rms(streams)) + base_j) + eps) x_j."""
    config: DecoderConfig

    @nn.compact
    def __call__(self, streams: jax.Array) -> jax.Array:
        hc, h = self.config.hyper, self.config.hidden_size
        n = hc.streams
        split = streams.reshape(*streams.shape[:-1], n, h)                               # [..., N, H]
        if hc.head == "mean":
            return jnp.mean(split, axis=-2)
        fn = self.param("hc_fn", nn.initializers.normal(0.02), (n, n * h), jnp.float32)
        base = self.param("hc_base", nn.initializers.zeros, (n,), jnp.float32)
        scale = self.param("hc_scale", nn.initializers.ones, (1,), jnp.float32)
        mixes = jnp.einsum("...i,oi->...o", rms_normalized(streams, hc.norm_eps), fn, precision=HIGHEST)  # [..., N]
        pre = jax.nn.sigmoid(mixes * scale + base) + hc.eps
        return jnp.sum(pre[..., None] * split.astype(jnp.float32), axis=-2).astype(streams.dtype)
