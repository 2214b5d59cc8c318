"""Attention's per-head output as its output projection reads it, with a block's head interventions
applied (``model.interventions``: heads zeroed or set to their mean, patched, or a delta added), and
sown as ``attn.hook_z``: one function for every attention module of ``model.decoder`` and
``model.compressed``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.sites import ATTN_Z


def heads_output(module: nn.Module, out: jax.Array, heads) -> jax.Array:
    """Attention's per-head output [B, S, N, D] as o_proj reads it, [B, S, N*D] (``attn.hook_z``,
    sown by ``module``): heads not kept (``heads``: keep [N], fill [N], mean [N, D'], then a
    patch's slots of values [K, B, S, N*D'] and (token, head)s [K, B, S, N], and a delta
    [B, S, N*D'] added, or None) replaced by zero or their mean, patched ones by the patch's values.
    D' >= D: the means, values and delta of every block are padded to the widest head
    (``model.interventions.padded_heads``); this block reads each head's first D."""
    b, s, n, d = out.shape
    module.sow("stats", "heads", out)
    if heads is not None:
        keep, fill, mean, values, tokens, delta = heads
        mean = mean[:, :d]  # [N, D]
        replaced = jnp.where(fill[:, None], mean.astype(out.dtype), jnp.zeros_like(mean, out.dtype))
        out = jnp.where(keep[:, None], out, replaced)
        for slot in range(0 if values is None else values.shape[0]):  # a patch's values at its (token, head)s
            value = values[slot].reshape(b, s, n, -1)[..., :d]  # [B, S, N, D]
            out = jnp.where(tokens[slot][..., None], value.astype(out.dtype), out)
        if delta is not None:  # attribution patching's point of differentiation, [B, S, N*D']
            out = out + delta.reshape(b, s, n, -1)[..., :d].astype(out.dtype)
    out = out.reshape(b, s, n * d)  # [B, S, N*D]
    module.sow("sites", ATTN_Z, out)
    return out
