"""A feature's dashboard from what the passes over a store found: its top activations and spread
(``features.top_activations``, ``features.spread``), the contexts of the tokens chosen, and its
logit effects, assembled into ``features.neuronpedia.DashboardFeature`` as SAEDashboard's
Neuronpedia runner would have it.

Units: as SAEDashboard, activations are those of the SAE with its decoder rows folded to unit norm
(``folded``: SAELens's ``fold_W_dec_norm``), and the logit effects are a unit decoder row through
the model's folded, centred unembedding (``model.unembedding``), SAEDashboard's ``W_dec @ W_U``.

Contexts: an example is a run of a sample's tokens around the chosen one, ``context`` tokens on
each side (clipped to the sample), or with ``context`` None the whole sample but its first token,
as SAEDashboard's Neuronpedia runner shows its 128-token prompts. A token of the run with no
stored activation (outside the store's token selection) shows 0.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from features.encoders import FeatureSet
from features.neuronpedia import ActivationExample, DashboardFeature, interval_bounds, top_group_bounds
from features.spread import BINS, INTERVALS, Spread, histc_bins, histogram_centres, interval_bounds as bounds_of
from features.top_activations import TopActivations

TOP_EXAMPLES = 20  # SAEDashboard's top group (top_acts_group_size)
LOGIT_ROWS = 10    # its logit tables' rows
LOGIT_BATCH = 128  # features whose logits [batch, vocab] are computed at once


def folded(features: FeatureSet) -> FeatureSet:
    """The same features with unit decoder rows and activations scaled by the rows' old norms
    (SAELens's ``fold_W_dec_norm``): SAEs only. A TopK SAE without decoder-norm rescaling is
    left as it is (folding would change which features it selects; SAELens refuses to)."""
    if features.activation == "linear" or (features.activation == "topk" and not features.decoder_scaled):
        return features
    norm = np.linalg.norm(features.decoder, axis=1).astype(np.float32)  # [F]
    safe = np.where(norm > 0, norm, 1).astype(np.float32)
    if features.decoder_scaled:  # TopK rescaling by the (now unit) norms: the same selection and values
        return dataclasses.replace(features, encoder=features.encoder * norm, encoder_bias=features.encoder_bias * norm,
                                   decoder=features.decoder / safe[:, None])
    threshold = None if features.threshold is None else features.threshold * norm
    return dataclasses.replace(features, encoder=features.encoder * norm, encoder_bias=features.encoder_bias * norm,
                               threshold=threshold, decoder=features.decoder / safe[:, None])


@dataclasses.dataclass
class LogitEffects:
    """Per feature, what its unit direction does to the logits [F, vocab]: the most promoted and
    most suppressed tokens and the histogram of every token's change."""
    top_ids: np.ndarray        # [F, LOGIT_ROWS] int64, the largest first
    top_values: np.ndarray     # [F, LOGIT_ROWS] float32
    bottom_ids: np.ndarray     # [F, LOGIT_ROWS] int64, the most negative first
    bottom_values: np.ndarray  # [F, LOGIT_ROWS] float32
    histogram: np.ndarray      # [F, BINS] int64 over [min, max] of each feature's logits
    low: np.ndarray            # [F] float32: those minima
    high: np.ndarray           # [F] float32: and maxima


def logit_vectors(directions: np.ndarray, unembedding: np.ndarray) -> Iterator[jax.Array]:
    """Each ``LOGIT_BATCH`` of ``directions`` [F, hidden] (unit rows) through ``unembedding``
    [hidden, vocab]: the change of every logit [batch, vocab], on the device."""
    weights = jnp.asarray(unembedding, jnp.float32)
    for i in range(0, len(directions), LOGIT_BATCH):
        yield _logits(jnp.asarray(directions[i:i + LOGIT_BATCH], jnp.float32), weights)


def logit_effects(directions: np.ndarray, unembedding: np.ndarray) -> LogitEffects:
    """What ``directions`` [F, hidden] (unit rows) do through ``unembedding`` [hidden, vocab]."""
    parts = [_logit_effects(logits) for logits in logit_vectors(directions, unembedding)]
    fields = [np.concatenate([np.asarray(part[j]) for part in parts]) for j in range(7)]
    return LogitEffects(fields[0].astype(np.int64), fields[1], fields[2].astype(np.int64), fields[3],
                        fields[4].astype(np.int64), fields[5], fields[6])


@jax.jit
def _logits(directions: jax.Array, unembedding: jax.Array) -> jax.Array:
    with jax.default_matmul_precision("highest"):
        return directions @ unembedding  # [batch, vocab]


@jax.jit
def _logit_effects(logits: jax.Array):
    top_values, top_ids = jax.lax.top_k(logits, LOGIT_ROWS)
    bottom_values, bottom_ids = jax.lax.top_k(-logits, LOGIT_ROWS)
    low, high = jnp.min(logits, axis=1), jnp.max(logits, axis=1)
    alone = low == high  # torch.histc widens a single value to [x - 1, x + 1]
    lo, hi = jnp.where(alone, low - 1, low)[:, None], jnp.where(alone, high + 1, high)[:, None]
    bins = histc_bins(logits, lo, hi)
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], bins.shape)
    histogram = jnp.zeros((logits.shape[0], BINS), jnp.int32).at[rows, bins].add(1)
    return top_ids, top_values, bottom_ids, -bottom_values, histogram, low, high


def context_span(position: int, length: int, context: int | None) -> tuple[int, int, int]:
    """(first, stop, the chosen token's index in the run) of an example around ``position`` of a
    sample of ``length`` tokens: ``context`` tokens each side, or None: positions 1..length-1
    (the chosen token's index -1 where it is position 0, as SAEDashboard writes it)."""
    if context is None:
        return 1, length, position - 1
    first = max(0, position - context)
    return first, min(length, position + context + 1), position - first


@dataclasses.dataclass(frozen=True)
class Chosen:
    """A token chosen for a feature's dashboard: its group (-1: the top activations; else an
    interval, 0 the highest) and rank within the group."""
    feature: int  # the feature's row in the summaries
    group: int
    rank: int
    sample_id: int
    position: int


def chosen_tokens(top: TopActivations, spread: Spread, rows: Sequence[int]) -> np.ndarray:
    """[tokens, 5] int64: every token the dashboards of the features at ``rows`` show, as (row,
    group, rank, sample id, position) (``Chosen``'s fields)."""
    rows = np.asarray(rows, np.int64)
    k = min(TOP_EXAMPLES, top.k)
    top_ids, top_positions = top.sample_ids[rows, :k], top.positions[rows, :k]  # [R, k]
    grid = np.broadcast_to
    top_part = np.stack([grid(rows[:, None], top_ids.shape), np.full(top_ids.shape, -1),
                         grid(np.arange(k), top_ids.shape), top_ids, top_positions], axis=-1).reshape(-1, 5)
    drawn_ids, drawn_positions = spread.sample_ids[rows], spread.positions[rows]  # [R, INTERVALS, 5]
    shape = drawn_ids.shape
    drawn_part = np.stack([grid(rows[:, None, None], shape), grid(np.arange(INTERVALS)[None, :, None], shape),
                           grid(np.arange(shape[2]), shape), drawn_ids, drawn_positions], axis=-1).reshape(-1, 5)
    out = np.concatenate([top_part, drawn_part]).astype(np.int64)
    return out[out[:, 3] >= 0]


@dataclasses.dataclass(frozen=True)
class Context:
    """A chosen token's run: its tokens' ids and the feature's activation at each."""
    chosen: Chosen
    token_ids: tuple[int, ...]
    values: tuple[float, ...]
    qualifying: int  # the chosen token's index in the run


def dashboard_feature(index: int, row: int, top: TopActivations, spread: Spread, contexts: Sequence[Context],
                      strings: Sequence[str], logits: LogitEffects | None, prompts: tuple[int, int] = (0, 0)
                      ) -> DashboardFeature:
    """Feature ``index``'s dashboard from the summaries' row ``row``, the contexts of its chosen
    tokens, the token strings by id (``features.neuronpedia.token_strings``), its logit effects
    (None: a feature writing no residual-stream direction) and (samples read, their most tokens):
    SAEDashboard's n_prompts_total and n_tokens_in_prompt, its prompts being all one length."""
    f = row
    by_group = collections.defaultdict(list)
    for context in sorted(contexts, key=lambda c: (c.chosen.group, c.chosen.rank)):
        by_group[context.chosen.group].append(context)

    def examples(group: int, bounds: tuple) -> list[ActivationExample]:
        return [ActivationExample(*bounds, [strings[t] for t in c.token_ids], list(c.values), c.qualifying)
                for c in by_group[group]]

    maximum = float(top.maximum[f])
    activations = examples(-1, top_group_bounds(maximum))
    # Intervals keyed by their title as SAEDashboard's dict is: equal titles (a dead feature's) are one group,
    # in the first's place with the last's examples.
    intervals: dict[tuple, list[ActivationExample]] = {}
    edges = bounds_of(top.maximum[f:f + 1])[0]
    for group in range(INTERVALS):
        i = INTERVALS - 1 - group
        bounds = interval_bounds(float(edges[i]), float(edges[i + 1]), spread.contains[f, group] / max(top.tokens, 1))
        intervals[bounds] = examples(group, bounds)
    for group_examples in intervals.values():
        activations.extend(group_examples)
    positive = top.positive[f] > 0
    return DashboardFeature(
        feature_index=index,
        neg_str=[] if logits is None else [strings[i] for i in logits.bottom_ids[f]],
        neg_values=[] if logits is None else logits.bottom_values[f].tolist(),
        pos_str=[] if logits is None else [strings[i] for i in logits.top_ids[f]],
        pos_values=[] if logits is None else logits.top_values[f].tolist(),
        density=float(top.density[f]),
        histogram_values=histogram_centres(top.smallest[f], top.maximum[f]) if positive else [],
        histogram_heights=spread.histogram[f].tolist() if positive else [],
        logits_histogram_heights=[] if logits is None else logits.histogram[f].tolist(),
        logits_histogram_values=[] if logits is None else histogram_centres(logits.low[f], logits.high[f]),
        activations=activations, n_prompts_total=prompts[0], n_tokens_in_prompt=prompts[1])

