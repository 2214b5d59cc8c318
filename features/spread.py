"""How each feature's activations spread, given its range from a first pass (``TopActivations``'s
maximum and least positive value): its activation histogram and its activation intervals with a
few examples drawn from each, as SAEDashboard lays them out, summarized per block of tokens and
merged like ``features.top_activations`` (associative, commutative, the same for any split).

- The histogram: ``BINS`` equal bins over [least, maximum] of the values above 0, counted as
  ``torch.histc`` counts (bin ``int((x - lo) * BINS / (hi - lo))`` in float32, the maximum in the
  last; one value alone: the middle bin of [x - 1, x + 1]).
- The intervals: ``INTERVALS`` equal-width intervals over [0, maximum] (``torch.linspace``'s
  bounds in float32, both ends inclusive, so the lowest holds every token at 0), highest first,
  each with its token count and ``INTERVAL_EXAMPLES`` tokens drawn from it. SAEDashboard draws at
  random; here a token's place in the draw is a hash of its (sample id, position)
  (``draw_keys``), so a feature's draw is uniform over its interval's tokens yet the same however
  the store is split among workers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from activations.export_plan import splitmix64

BINS = 50             # SAEDashboard's histograms' bins
INTERVALS = 5         # its activation intervals (n_quantiles)
INTERVAL_EXAMPLES = 5  # tokens drawn from each (quantile_group_size)
UNDRAWN = np.iinfo(np.int64).max  # the draw key of an empty slot


def float32_linspace(start: np.ndarray, stop: np.ndarray, steps: int) -> np.ndarray:
    """[..., steps] float32, as ``torch.linspace`` computes it: the first half from ``start`` up,
    the second from ``stop`` down, by the float32 step."""
    start, stop = np.asarray(start, np.float32)[..., None], np.asarray(stop, np.float32)[..., None]
    step = (stop - start) / np.float32(steps - 1)
    i = np.arange(steps, dtype=np.float32)
    return np.where(i < steps // 2, start + step * i, stop - step * (np.float32(steps - 1) - i)).astype(np.float32)


def interval_bounds(maximum: np.ndarray) -> np.ndarray:
    """[F, INTERVALS + 1] float32: the intervals' bounds over [0, maximum] (a feature never above 0: all 0)."""
    return float32_linspace(np.zeros_like(maximum), np.maximum(maximum, 0), INTERVALS + 1)


def histogram_range(smallest: np.ndarray, maximum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) [F] float32 of each histogram: [least, maximum] of the values above 0, widened to
    [x - 1, x + 1] where they are one value (as ``torch.histc``)."""
    lo, hi = np.asarray(smallest, np.float32), np.asarray(maximum, np.float32)
    alone = lo == hi
    return np.where(alone, lo - 1, lo).astype(np.float32), np.where(alone, hi + 1, hi).astype(np.float32)


def histogram_centres(smallest: float, maximum: float) -> list[float]:
    """The bins' centres as SAEDashboard writes them (of the unwidened range, rounded to 5 places)."""
    edges = float32_linspace(np.float32(smallest), np.float32(maximum), BINS + 1)
    width = (float(maximum) - float(smallest)) / BINS
    return [round(x, 5) for x in (edges[:-1] + np.float32(width / 2)).astype(np.float32).tolist()]


def histc_bins(x: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """[..., n] int32: each value's bin of ``BINS`` over [lo, hi] ([..., 1]) as ``torch.histc``
    computes it in float32, ``int((x - lo) * BINS / (hi - lo))``, the maximum in the last bin. The
    divisor is kept a full array (an optimization barrier): XLA would divide by a broadcast as a
    product with its reciprocal, which rounds differently and moves values at a bin's edge."""
    span = jax.lax.optimization_barrier(jnp.broadcast_to(hi - lo, x.shape))
    return jnp.clip(((x - lo) * BINS / span).astype(jnp.int32), 0, BINS - 1)


def draw_keys(sample_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[n] int64 >= 0: each token's place in every interval's draw (smaller first)."""
    token = (np.asarray(sample_ids).astype(np.uint64) << np.uint64(24)) ^ np.asarray(positions).astype(np.uint64)
    return (splitmix64(token) >> np.uint64(1)).astype(np.int64)


@dataclasses.dataclass
class Spread:
    """Per feature: its histogram, its intervals' token counts and the tokens drawn from each."""
    histogram: np.ndarray   # [F, BINS] int64
    contains: np.ndarray    # [F, INTERVALS] int64: tokens within each interval, highest interval first
    keys: np.ndarray        # [F, INTERVALS, INTERVAL_EXAMPLES] int64: the drawn tokens' draw keys (UNDRAWN: none)
    sample_ids: np.ndarray  # [F, INTERVALS, INTERVAL_EXAMPLES] int64 (-1: none)
    positions: np.ndarray   # [F, INTERVALS, INTERVAL_EXAMPLES] int64 (-1: none)

    @classmethod
    def empty(cls, features: int) -> "Spread":
        shape = (features, INTERVALS, INTERVAL_EXAMPLES)
        return cls(np.zeros((features, BINS), np.int64), np.zeros((features, INTERVALS), np.int64),
                   np.full(shape, UNDRAWN, np.int64), np.full(shape, -1, np.int64), np.full(shape, -1, np.int64))


def block_spread(activations: jax.Array, sample_ids: np.ndarray, positions: np.ndarray, smallest: np.ndarray,
                 maximum: np.ndarray) -> Spread:
    """The spread of one block's ``activations`` [n, F] (rows past len(sample_ids): padding), of
    features whose least positive value and maximum over the whole store are ``smallest``, ``maximum`` [F]."""
    m, n = len(sample_ids), activations.shape[0]
    keys = draw_keys(sample_ids, positions)
    order = np.lexsort((positions, sample_ids, keys))  # the draw order (ties: by sample id, then position)
    padded = np.concatenate([order, np.arange(m, n)])
    lo, hi = histogram_range(smallest, maximum)
    histogram, contains, rows = _block_spread(jnp.asarray(activations)[jnp.asarray(padded)], jnp.int32(m),
                                              jnp.asarray(lo), jnp.asarray(hi), jnp.asarray(interval_bounds(maximum)),
                                              min(INTERVAL_EXAMPLES, n))
    rows = np.asarray(rows)  # [F, INTERVALS, k] into the ordered block; >= m: none
    filled = rows < m
    chosen = order[np.minimum(rows, max(m - 1, 0))] if m else np.zeros_like(rows)
    spread = Spread.empty(activations.shape[1])
    k = rows.shape[2]
    spread.histogram, spread.contains = np.asarray(histogram, np.int64), np.asarray(contains, np.int64)
    for name, source, none in (("keys", keys, UNDRAWN), ("sample_ids", sample_ids, -1), ("positions", positions, -1)):
        getattr(spread, name)[:, :, :k] = np.where(filled, np.asarray(source)[chosen] if m else none, none)
    return spread


@functools.partial(jax.jit, static_argnums=5)
def _block_spread(activations, tokens, lo, hi, bounds, k: int):
    n, features = activations.shape
    real = (jnp.arange(n) < tokens)[None, :]  # [1, n]
    x = activations.T  # [F, n]
    # The histogram, as torch.histc bins (in float32): the maximum in the last bin.
    counted = real & (x > 0)
    bins = histc_bins(x, lo[:, None], hi[:, None])
    feature = jnp.broadcast_to(jnp.arange(features)[:, None], (features, n))
    histogram = jnp.zeros((features, BINS), jnp.int32).at[feature, bins].add(counted.astype(jnp.int32))
    contains, rows = [], []
    for i in range(INTERVALS - 1, -1, -1):  # highest interval first
        inside = real & (x >= bounds[:, i:i + 1]) & (x <= bounds[:, i + 1:i + 2])  # [F, n]
        contains.append(jnp.sum(inside, axis=1))
        # The first rows inside in the draw order: the largest of -row (as float32, exact below 2^24 rows:
        # XLA's top_k on the CPU is ~25x slower on integers).
        _, first = jax.lax.top_k(jnp.where(inside, -jnp.arange(n, dtype=jnp.float32), -jnp.inf), k)  # [F, k]
        picked = jnp.take_along_axis(inside, first, axis=1)
        rows.append(jnp.where(picked, first, n))
    return histogram, jnp.stack(contains, axis=1), jnp.stack(rows, axis=1)


def merged_spread(a: Spread, b: Spread) -> Spread:
    """The spread of ``a``'s tokens and ``b``'s together (no token in both)."""
    keys = np.concatenate([a.keys, b.keys], axis=2)  # [F, INTERVALS, 2k]
    sample_ids = np.concatenate([a.sample_ids, b.sample_ids], axis=2)
    positions = np.concatenate([a.positions, b.positions], axis=2)
    first = np.lexsort((positions, sample_ids, keys), axis=2)[..., :INTERVAL_EXAMPLES]
    return Spread(a.histogram + b.histogram, a.contains + b.contains, np.take_along_axis(keys, first, 2),
                  np.take_along_axis(sample_ids, first, 2), np.take_along_axis(positions, first, 2))
