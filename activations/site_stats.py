"""Per-site statistics of stored activations: for each (site, layer), the count of tokens, the mean
vector, the per-dimension variance and the mean L2 norm, in float64; for a mixture of experts'
``mlp.hook_expert_indices``, also the tokens routed to each expert (its load).

What normalising trainers need (CLT and crosscoder training scale each site by ``sqrt(d) /
mean_norm``, or by mean and std). Each sample's statistics are measured on the devices, in
float32, of its rows as stored (``model.statistics``: count, mean, centred sum of squares, sum of
norms); here they become float64 ``Moments`` and are merged with Chan et al.'s parallel formula,
which is exact up to float64 rounding whatever the grouping: a shard's
(``index/shard_NNNN_stats.parquet``, beside its index files) is the merge of its samples' in
sample order, a machine's or the fleet's (``index_stats.parquet`` beside the merged index) the
merge of its shards' in path order. A resumed run stores the same shards as an uninterrupted one,
and so the same statistics. Grouped (``runners.tpu_host --stats_by role,label``), the same
statistics are kept per role of the tokens (measured per role on the devices) and per value of a
kept column (a sample's every row: ``GroupKey``), merged alike.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np
import pyarrow as pa

from common.roles import ROLES
from model.sites import ArrayKey, array_key, key_parts
from model.statistics import KeyStatistics

STATS_SCHEMA = pa.schema([
    ("site", pa.string()), ("layer", pa.int32()), ("count", pa.int64()),
    ("mean", pa.list_(pa.float64())), ("variance", pa.list_(pa.float64())),  # per dimension (population)
    ("mean_norm", pa.float64()),  # mean over tokens of each token's L2 norm
    # Tokens routed to each expert 0..E-1 (mlp.hook_expert_indices only, else null): a token counts
    # once for each of its k experts. Null too in files written before it existed.
    ("expert_counts", pa.list_(pa.int64())),
])
# With a grouping (runners.tpu_host --stats_by): each (site, layer)'s statistics also per group,
# in rows whose ``group_by`` names the grouping (``role``, or a kept column's name) and ``group``
# the group (a role, or the column's value as text: ``label_text``); the overall rows have both null.
GROUPED_STATS_SCHEMA = STATS_SCHEMA.append(pa.field("group_by", pa.string())).append(pa.field("group", pa.string()))
ROLE_GROUPING = "role"


class GroupKey(NamedTuple):
    """The statistics of one group of a key's tokens (``GROUPED_STATS_SCHEMA``)."""
    key: ArrayKey
    group_by: str          # ROLE_GROUPING or a kept column's name
    group: str | None      # the role, or the column's value as text (None: null)


StatsKey = ArrayKey | GroupKey


def label_text(value: Any) -> str | None:
    """A kept column's value as a group name: a string as it is, a number or bool as JSON writes
    it (``1``, ``0.5``, ``true``), null as None."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)


@dataclasses.dataclass
class Moments:
    """The statistics of a set of token vectors: count, mean, sum of squared deviations ``m2``
    (variance = m2 / count) and mean L2 norm."""
    count: int
    mean: np.ndarray   # [width] float64
    m2: np.ndarray     # [width] float64
    mean_norm: float
    expert_counts: np.ndarray | None = None  # [E] int64: tokens routed to each expert (expert ids only)

    @classmethod
    def measured(cls, statistics: KeyStatistics, group: int = 0) -> "Moments":
        """The moments of one group of a sample's rows as the device measured them (float32
        sums, here in float64)."""
        count = int(statistics.count[group])
        experts = statistics.experts
        return cls(count, statistics.mean[group].astype(np.float64), statistics.m2[group].astype(np.float64),
                   float(statistics.norm_sum[group]) / count if count else 0.0,
                   None if experts is None else experts[group].astype(np.int64))

    def merged(self, other: "Moments") -> "Moments":
        """The moments of both sets together (Chan, Golub and LeVeque's pairwise update)."""
        n = self.count + other.count
        if not other.count or not self.count:
            return other if not self.count else self
        share = other.count / n
        delta = other.mean - self.mean
        counts = None if self.expert_counts is None else self.expert_counts + other.expert_counts
        return Moments(n, self.mean + delta * share, self.m2 + other.m2 + delta * delta * (self.count * share),
                       self.mean_norm + (other.mean_norm - self.mean_norm) * share, counts)

    @property
    def variance(self) -> np.ndarray:
        return self.m2 / self.count if self.count else np.zeros_like(self.m2)


def sample_moments(statistics: KeyStatistics, key: ArrayKey,
                   labels: Sequence[tuple[str, Any]] = ()) -> dict[StatsKey, Moments]:
    """One sample's moments of one stored array under its key and, grouped, under a ``GroupKey``
    per role its rows have (the device's groups ``1 + code``, where measured) and per kept
    column's value (``labels``: (column, the sample's value): every row of the sample)."""
    overall = Moments.measured(statistics)
    out: dict[StatsKey, Moments] = {key: overall}
    for code, count in enumerate(statistics.count[1:].tolist()):
        if count:
            out[GroupKey(key, ROLE_GROUPING, ROLES[code])] = Moments.measured(statistics, 1 + code)
    for name, value in labels:
        out[GroupKey(key, name, label_text(value))] = overall
    return out


def merged_moments(parts: Iterable[dict[StatsKey, Moments]]) -> dict[StatsKey, Moments]:
    """Per key, the merge of every part's moments, in the parts' order."""
    out: dict[StatsKey, Moments] = {}
    for part in parts:
        for key, moments in part.items():
            out[key] = out[key].merged(moments) if key in out else moments
    return out


def _row_key(key: StatsKey) -> tuple:
    """(site, layer, group_by, group) of a statistics key (the groups None for a key's overall row)."""
    if isinstance(key, GroupKey):
        return (*key_parts(key.key), key.group_by, key.group)
    return (*key_parts(key), None, None)


def _order(row: tuple) -> tuple:
    site, layer, group_by, group = row
    return site, layer, group_by is not None, group_by or "", group is not None, group or ""


def stats_table(moments: dict[StatsKey, Moments]) -> pa.Table:
    """One row per (site, layer), sorted by site then layer; with groups (``GroupKey``s), the
    ``group_by`` and ``group`` columns and a row per group after each key's overall row."""
    rows = sorted(((_row_key(key), m) for key, m in moments.items()), key=lambda r: _order(r[0]))
    grouped = any(row[2] is not None for row, _ in rows)
    columns = {
        "site": [row[0] for row, _ in rows], "layer": [row[1] for row, _ in rows],
        "count": [m.count for _, m in rows], "mean": [m.mean.tolist() for _, m in rows],
        "variance": [m.variance.tolist() for _, m in rows], "mean_norm": [m.mean_norm for _, m in rows],
        "expert_counts": [None if m.expert_counts is None else m.expert_counts.tolist() for _, m in rows],
    }
    if not grouped:
        return pa.table(columns, schema=STATS_SCHEMA)
    return pa.table({**columns, "group_by": [row[2] for row, _ in rows], "group": [row[3] for row, _ in rows]},
                    schema=GROUPED_STATS_SCHEMA)


def table_moments(table: pa.Table) -> dict[StatsKey, Moments]:
    """A statistics table back as moments per array key (a ``GroupKey`` for a group's row)."""
    out = {}
    for row in table.to_pylist():
        mean, variance = np.asarray(row["mean"], np.float64), np.asarray(row["variance"], np.float64)
        counts = row.get("expert_counts")
        key = array_key(row["site"], row["layer"])
        if row.get("group_by") is not None:
            key = GroupKey(key, row["group_by"], row["group"])
        out[key] = Moments(row["count"], mean, variance * row["count"], row["mean_norm"],
                           None if counts is None else np.asarray(counts, np.int64))
    return out
