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
  random; here a token's place in a feature's draw is a hash of (the feature's number, the token's
  sample id and position) (``draw_keys``), so each feature's draw is uniform over its interval's
  tokens, independent of other features', and the same however the store is split among workers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


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


def _mix32(x):
    """A 32-bit integer finaliser (wrapping), the same on numpy's and JAX's uint32 (the constants as
    uint32 arrays of the same library: JAX refuses a Python int past int32)."""
    xp = np if isinstance(x, np.ndarray) else jnp
    x = x ^ (x >> xp.uint32(16))
    x = x * xp.uint32(0x7FEB352D)
    x = x ^ (x >> xp.uint32(15))
    x = x * xp.uint32(0x846CA68B)
    return x ^ (x >> xp.uint32(16))


def _draw_key(numbers, low, high, positions):
    """[F, n] uint32 (numpy's or JAX's, as given): the hash of (feature number [F], sample id's low
    and high words [n], position [n]) that orders each feature's draws."""
    h = _mix32(numbers[:, None])
    h = _mix32(h ^ low[None, :])
    h = _mix32(h ^ high[None, :])
    return _mix32(h ^ positions[None, :])


def draw_keys(numbers: np.ndarray, sample_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[F, n] int64: the place of each token (``sample_ids``, ``positions`` [n]) in the draws of
    each feature (``numbers`` [F]), smaller first: a hash, so each feature's draw is uniform over its
    interval's tokens, independent of other features' and of how the tokens are split. 24 bits: exact
    in float32, as the device ranks them (~25x faster than integers on a CPU)."""
    sample = np.asarray(sample_ids, np.int64)
    with np.errstate(over="ignore"):
        h = _draw_key(np.asarray(numbers).astype(np.uint32), (sample & 0xFFFFFFFF).astype(np.uint32),
                      (sample >> 32).astype(np.uint32), np.asarray(positions).astype(np.uint32))
    return (h >> np.uint32(8)).astype(np.int64)


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
                 maximum: np.ndarray, numbers: np.ndarray) -> Spread:
    """The spread of one block's ``activations`` [n, F] (rows past len(sample_ids): padding), of
    features numbered ``numbers`` [F] whose least positive value and maximum over the whole store
    are ``smallest``, ``maximum`` [F]."""
    m, n = len(sample_ids), activations.shape[0]
    order = np.lexsort((positions, sample_ids))  # ties of the draw: by sample id, then position
    padded = np.concatenate([order, np.arange(m, n)])
    ordered_ids = np.concatenate([np.asarray(sample_ids, np.int64)[order], np.zeros(n - m, np.int64)])
    ordered_positions = np.concatenate([np.asarray(positions, np.int64)[order], np.zeros(n - m, np.int64)])
    lo, hi = histogram_range(smallest, maximum)
    histogram, contains, rows, keys = _block_spread(
        jnp.asarray(activations)[jnp.asarray(padded)], jnp.int32(m), jnp.asarray(lo), jnp.asarray(hi),
        jnp.asarray(interval_bounds(maximum)), jnp.asarray(numbers, jnp.uint32),
        jnp.asarray(ordered_ids & 0xFFFFFFFF, jnp.uint32), jnp.asarray(ordered_ids >> 32, jnp.uint32),
        jnp.asarray(ordered_positions, jnp.uint32), min(INTERVAL_EXAMPLES, n))
    rows = np.asarray(rows)  # [F, INTERVALS, k] into the ordered block; >= m: none
    filled = rows < m
    chosen = order[np.minimum(rows, max(m - 1, 0))] if m else np.zeros_like(rows)
    spread = Spread.empty(activations.shape[1])
    k = rows.shape[2]
    spread.histogram, spread.contains = np.asarray(histogram, np.int64), np.asarray(contains, np.int64)
    spread.keys[:, :, :k] = np.where(filled, np.asarray(keys, np.int64), UNDRAWN)
    for name, source in (("sample_ids", sample_ids), ("positions", positions)):
        getattr(spread, name)[:, :, :k] = np.where(filled, np.asarray(source)[chosen] if m else -1, -1)
    return spread


@functools.partial(jax.jit, static_argnums=9)
def _block_spread(activations, tokens, lo, hi, bounds, numbers, low, high, positions, k: int):
    n, features = activations.shape
    real = (jnp.arange(n) < tokens)[None, :]  # [1, n]
    x = activations.T  # [F, n]
    counted = real & (x > 0)
    bins = histc_bins(x, lo[:, None], hi[:, None])
    feature = jnp.broadcast_to(jnp.arange(features)[:, None], (features, n))
    histogram = jnp.zeros((features, BINS), jnp.int32).at[feature, bins].add(counted.astype(jnp.int32))
    # Each (feature, token)'s draw key; the smallest first (as -key: top_k keeps the largest, and of
    # equal keys the lower row, the lower (sample id, position)).
    keys = (_draw_key(numbers, low, high, positions) >> jnp.uint32(8)).astype(jnp.int32)  # [F, n], as draw_keys
    draw = -keys.astype(jnp.float32)
    contains, rows, drawn = [], [], []
    for i in range(INTERVALS - 1, -1, -1):  # highest interval first
        inside = real & (x >= bounds[:, i:i + 1]) & (x <= bounds[:, i + 1:i + 2])  # [F, n]
        contains.append(jnp.sum(inside, axis=1))
        _, first = jax.lax.top_k(jnp.where(inside, draw, -jnp.inf), k)  # [F, k]
        picked = jnp.take_along_axis(inside, first, axis=1)
        rows.append(jnp.where(picked, first, n))
        drawn.append(jnp.take_along_axis(keys, first, axis=1))
    return histogram, jnp.stack(contains, axis=1), jnp.stack(rows, axis=1), jnp.stack(drawn, axis=1)


def merged_spread(a: Spread, b: Spread) -> Spread:
    """The spread of ``a``'s tokens and ``b``'s together (no token in both)."""
    keys = np.concatenate([a.keys, b.keys], axis=2)  # [F, INTERVALS, 2k]
    sample_ids = np.concatenate([a.sample_ids, b.sample_ids], axis=2)
    positions = np.concatenate([a.positions, b.positions], axis=2)
    first = np.lexsort((positions, sample_ids, keys), axis=2)[..., :INTERVAL_EXAMPLES]
    return Spread(a.histogram + b.histogram, a.contains + b.contains, np.take_along_axis(keys, first, 2),
                  np.take_along_axis(sample_ids, first, 2), np.take_along_axis(positions, first, 2))
