"""Per-site statistics of stored activations: for each (site, layer), the count of tokens, the mean
vector, the per-dimension variance and the mean L2 norm, in float64; for a mixture of experts'
``mlp.hook_expert_indices``, also the tokens routed to each expert (its load).

What normalising trainers need (CLT and crosscoder training scale each site by ``sqrt(d) /
mean_norm``, or by mean and std). Each shard's statistics are computed from its arrays as they
are stored (``index/shard_NNNN_stats.parquet``, beside its two index files) and merged with
Chan et al.'s parallel formula, which is exact up to float64 rounding whatever the grouping: a
machine's, or the fleet's (``index_stats.parquet`` beside the merged index), is the merge of its
shards' in path order. A resumed run stores the same shards as an uninterrupted one, and so the
same statistics. Grouped (``runners.tpu_host --stats_by role,label``), the same statistics are kept
per role of the tokens and per value of a kept column (``GroupKey``), merged alike.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np
import pyarrow as pa

from common.roles import ROLES
from model.sites import ArrayKey, array_key, key_parts

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
    def of(cls, array: np.ndarray, experts: int = 0) -> "Moments":
        """The moments of ``array`` [tokens, width] (any float dtype, bfloat16 included);
        ``experts`` > 0: ``array`` holds expert ids [tokens, k], counted per expert."""
        counts = np.bincount(array.reshape(-1), minlength=experts).astype(np.int64) if experts else None
        x = array.astype(np.float64)  # a copy: centred in place below
        if not len(x):
            return cls(0, np.zeros(x.shape[-1]), np.zeros(x.shape[-1]), 0.0, counts)
        mean = x.mean(axis=0)
        norms = np.sqrt(np.einsum("td,td->t", x, x))
        x -= mean  # x is a fresh float64 copy unless the array was float64 already
        return cls(len(x), mean, np.einsum("td,td->d", x, x), float(norms.mean()), counts)

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


def grouped_moments(array: np.ndarray, key: ArrayKey, experts: int = 0, row_roles: np.ndarray | None = None,
                    labels: Sequence[tuple[str, Any]] = ()) -> dict[StatsKey, Moments]:
    """The moments of one stored array (``Moments.of``) under its key, and, grouped, under a
    ``GroupKey`` per role of its rows (``row_roles`` [rows]: codes of ``common.roles.ROLES``) and
    per kept column's value (``labels``: (column, the sample's value))."""
    overall = Moments.of(array, experts)
    out: dict[StatsKey, Moments] = {key: overall}
    if row_roles is not None:
        for code in np.unique(row_roles).tolist():
            out[GroupKey(key, ROLE_GROUPING, ROLES[code])] = Moments.of(array[row_roles == code], experts)
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


def merge_stats_files(paths: Sequence[str]) -> pa.Table:
    """The statistics of every listed shard statistics file together, merged in path order."""
    from activations.index import read_index_file
    return stats_table(merged_moments(table_moments(read_index_file(p, STATS_SCHEMA)) for p in sorted(paths)))
