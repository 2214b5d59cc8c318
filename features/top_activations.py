"""Each feature's top activating tokens, its maximum and how often it fires, over any number of
blocks of tokens: a summary per block, and a merge of two summaries that is associative and
commutative, so a combiner over a store of any size keeps ``k`` tokens a feature and gives the
same result however the tokens are split among workers.

Ties are broken by (sample id, position), ascending: of two tokens with the same value, the one of
the lower sample id (then position) ranks first. Within a block this is the device's own order:
the block's rows are put in (sample id, position) order first, and ``jax.lax.top_k`` keeps the
lower index of equal values first.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

EMPTY = np.float32(-np.inf)  # the value of a slot no token fills (fewer than k tokens seen)


@dataclasses.dataclass
class TopActivations:
    """Per feature, over the tokens seen: the ``k`` highest activations (ranked by value, then
    sample id, then position) and where they are, the token count, how many were above 0, the
    maximum and the least value above 0 (the activation histogram's range)."""
    values: np.ndarray      # [F, k] float32, ranked; EMPTY where unfilled
    sample_ids: np.ndarray  # [F, k] int64 (-1 where unfilled)
    positions: np.ndarray   # [F, k] int64 (-1 where unfilled)
    tokens: int             # tokens seen (every feature sees every token)
    positive: np.ndarray    # [F] int64: tokens whose activation is > 0
    maximum: np.ndarray     # [F] float32 (EMPTY before any token)
    smallest: np.ndarray    # [F] float32: the least activation above 0 (inf where none)

    @property
    def k(self) -> int:
        return self.values.shape[1]

    @property
    def density(self) -> np.ndarray:
        """[F] float64: the share of tokens each feature fires on (> 0)."""
        return self.positive / max(self.tokens, 1)

    @classmethod
    def empty(cls, features: int, k: int) -> "TopActivations":
        return cls(np.full((features, k), EMPTY, np.float32), np.full((features, k), -1, np.int64),
                   np.full((features, k), -1, np.int64), 0, np.zeros(features, np.int64),
                   np.full(features, EMPTY, np.float32), np.full(features, np.inf, np.float32))


def block_top(activations: jax.Array, sample_ids: np.ndarray, positions: np.ndarray, k: int) -> TopActivations:
    """The summary of one block: ``activations`` [n, F] (on the device, as the encoder gave them) of
    tokens ``sample_ids``, ``positions`` [m]; rows past ``m`` are padding (a fixed block shape: one
    compiled program for every block) and count for nothing."""
    m, n = len(sample_ids), activations.shape[0]
    order = np.lexsort((positions, sample_ids))  # the tie order: by sample id, then position
    padded = np.concatenate([order, np.arange(m, n)])
    values, rows, positive, maximum, smallest = _block_top(jnp.asarray(activations)[jnp.asarray(padded)],
                                                           jnp.int32(m), min(k, n))
    rows = np.asarray(rows)  # [F, min(k, n)] into the ordered block
    filled = rows < m
    chosen = order[np.minimum(rows, m - 1)] if m else rows
    top = TopActivations.empty(activations.shape[1], k)
    top.values[:, :rows.shape[1]] = np.where(filled, np.asarray(values), EMPTY)
    top.sample_ids[:, :rows.shape[1]] = np.where(filled, np.asarray(sample_ids)[chosen] if m else -1, -1)
    top.positions[:, :rows.shape[1]] = np.where(filled, np.asarray(positions)[chosen] if m else -1, -1)
    top.tokens, top.positive = m, np.asarray(positive, np.int64)
    top.maximum, top.smallest = np.asarray(maximum, np.float32), np.asarray(smallest, np.float32)
    return top


@functools.partial(jax.jit, static_argnums=2)
def _block_top(activations: jax.Array, tokens: jax.Array, k: int):
    real = (jnp.arange(activations.shape[0]) < tokens)[None, :]
    by_feature = jnp.where(real, activations.T, -jnp.inf)  # [F, n]
    values, rows = jax.lax.top_k(by_feature, k)  # [F, k] each: equal values, the lower row first
    return (values, rows, jnp.sum(by_feature > 0, axis=1), jnp.max(by_feature, axis=1),
            jnp.min(jnp.where(by_feature > 0, by_feature, jnp.inf), axis=1))


def merged(a: TopActivations, b: TopActivations) -> TopActivations:
    """The summary of ``a``'s tokens and ``b``'s together (no token in both)."""
    values = np.concatenate([a.values, b.values], axis=1)  # [F, 2k]
    sample_ids = np.concatenate([a.sample_ids, b.sample_ids], axis=1)
    positions = np.concatenate([a.positions, b.positions], axis=1)
    # Rank by value (descending), then sample id, then position; unfilled slots (-inf) last.
    ranked = np.lexsort((positions, sample_ids, -values.astype(np.float64)), axis=1)[:, :a.k]  # [F, k]
    return TopActivations(np.take_along_axis(values, ranked, 1), np.take_along_axis(sample_ids, ranked, 1),
                          np.take_along_axis(positions, ranked, 1), a.tokens + b.tokens, a.positive + b.positive,
                          np.maximum(a.maximum, b.maximum), np.minimum(a.smallest, b.smallest))
