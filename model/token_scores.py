"""The model-level sites of the unembedding (``model.sites.HEAD_OUTPUTS``): per token, the logits,
their top k, and the next token's loss, the distribution's entropy and the next token's rank.

Token t's row is what position t predicts, so its "next token" is the sample's token t + 1: the
loss and the rank of a sample's last token have none (NaN and -1). Everything is float32, from
the logits as the model gives them (soft-capped where the family caps: Gemma 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.sites import ENTROPY, LOGITS, LOSS, RANK, TOP_K_IDS, TOP_K_LOGPROBS


def next_tokens(input_ids: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each position's next token and whether it has one: input_ids [B, S], lengths [B] ->
    ([B, S] int32, [B, S] bool)."""
    following = jnp.concatenate([input_ids[:, 1:], jnp.zeros_like(input_ids[:, :1])], axis=1)  # [B, S]
    has_next = jnp.arange(input_ids.shape[1])[None, :] + 1 < lengths[:, None]
    return following, has_next


def token_scores(logits: jax.Array, following: jax.Array, has_next: jax.Array, sites: tuple[str, ...],
                 top_k: int | None = None) -> dict[str, jax.Array]:
    """The ``sites`` (of ``HEAD_OUTPUTS``) of ``logits`` [B, R, V] at rows whose next tokens are
    ``following`` [B, R] (where ``has_next`` [B, R]) -> {site: [B, R, width]}."""
    logits = logits.astype(jnp.float32)
    # One pass of exp over the vocabulary serves every site (the log-softmax is never formed):
    # log p = logits - lse, and the entropy is lse - E_p[logits].
    peak = jnp.max(logits, axis=-1, keepdims=True)  # [B, R, 1]
    weights = jnp.exp(logits - peak)  # [B, R, V]
    total = jnp.sum(weights, axis=-1, keepdims=True)
    lse = peak + jnp.log(total)  # [B, R, 1]
    out = {}
    if LOGITS in sites:
        out[LOGITS] = logits
    if TOP_K_IDS in sites or TOP_K_LOGPROBS in sites:
        best, ids = jax.lax.top_k(logits, top_k)  # [B, R, K] each, most probable first
        out[TOP_K_IDS], out[TOP_K_LOGPROBS] = ids.astype(jnp.int32), best - lse
    target = jnp.take_along_axis(logits, following[..., None], axis=-1)  # [B, R, 1]
    if LOSS in sites:
        out[LOSS] = jnp.where(has_next[..., None], lse - target, jnp.nan)
    if ENTROPY in sites:
        out[ENTROPY] = lse - jnp.sum(weights * logits, axis=-1, keepdims=True) / total
    if RANK in sites:
        rank = jnp.sum(logits > target, axis=-1, keepdims=True, dtype=jnp.int32)
        out[RANK] = jnp.where(has_next[..., None], rank, -1)
    return {site: out[site] for site in sites if site in out}
