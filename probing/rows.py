"""The rows a probe reads: each kept token's (or pooled row's) arrays at every (site, layer) asked
for, read once through the token loader, beside its sample's label and group.

The rows are sorted by (sample id, position) and a cap on their number keeps a draw decided by
each token alone (a hash of its sample id and position with the seed), so the rows, and what is
fit on them, do not depend on how the store is laid out: a fleet's store gives what one machine's
does. Memory: the rows kept (rows x the widths x 4 bytes) and, while one key's rows are sorted,
another copy of that key's.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import pyarrow as pa

from activations.export_plan import splitmix64
from activations.index import SCHEMA
from activations.token_loader import LoaderConfig, TokenLoader
from activations.token_plan import read_index_table
from common.cli import UserError
from model.sites import ArrayKey

BATCH_TOKENS = 16_384


@dataclasses.dataclass
class ProbeRows:
    """Rows ``i`` of every array are one token (or a sample's pooled row)."""
    features: dict[ArrayKey, np.ndarray]  # key -> [rows, width] float32
    labels: np.ndarray                    # [rows] object: the label column's values
    groups: np.ndarray                    # [rows] object: the group column's values (the split's unit)
    sample_ids: np.ndarray                # [rows] int64
    positions: np.ndarray                 # [rows] int64
    label_type: pa.DataType
    null_labels: int                      # rows left out: their sample's label is null
    loader: TokenLoader                   # what read them (its store's metadata)


def sample_columns(index: str, label: str, group: str) -> pa.Table:
    """``sample_id``, the label and the group column of every stored sample; one line naming the
    index's kept columns when one is missing or not a scalar."""
    table = read_index_table(index, "index")
    schema = table.schema
    kept = [name for name in schema.names if name not in SCHEMA.names]
    for name, flag in ((label, "--label"), (group, "--group_column")):
        if name not in schema.names:
            raise UserError(f"{flag} {name}: {index} has no such column (its kept columns: "
                            f"{', '.join(kept) or 'none, prepare with --keep_columns'})")
        kind = schema.field(name).type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
                or pa.types.is_string(kind)):
            raise UserError(f"{flag} {name}: a column of {kind}, not of scalars")
    return table.select(list(dict.fromkeys(["sample_id", label, group])))


def read_rows(index: str, keys: Sequence[ArrayKey], label: str, group: str, tokens: str | None,
              max_rows: int | None, seed: int) -> ProbeRows:
    """The probe's rows of ``keys`` under the token selection ``tokens`` (None: every stored
    token), at most about ``max_rows`` of them (a draw by token). A null group is its sample's own."""
    table = sample_columns(index, label, group)
    ids = table["sample_id"].to_numpy()
    order = np.argsort(ids)
    ids = ids[order]
    labels = np.array(table[label].to_pylist(), dtype=object)[order]  # ints stay ints, null None
    groups = np.array([g if g is not None and g == g else ("sample", s) for g, s in
                       zip(table[group].to_pylist(), table["sample_id"].to_pylist())], dtype=object)[order]
    valid = np.array([value is not None and value == value for value in labels], bool)  # not null, not NaN
    loader = TokenLoader(LoaderConfig(index=index, layers=tuple(keys), seed=None, tokens=tokens,
                                      batch_tokens=BATCH_TOKENS))
    share = 1.0 if max_rows is None else max_rows / max(1, loader.total_tokens)
    parts: dict[ArrayKey, list[np.ndarray]] = {key: [] for key in keys}
    sample_ids, positions, null_labels = [], [], 0
    for batch in loader:
        keep = valid[np.searchsorted(ids, batch.sample_ids)]
        null_labels += int((~keep).sum())
        keep &= drawn(batch.sample_ids, batch.positions, seed, share)
        for key in keys:
            parts[key].append(batch.activations[key][keep].astype(np.float32, copy=False))
        sample_ids.append(batch.sample_ids[keep])
        positions.append(batch.positions[keep])
    if not sum(len(s) for s in sample_ids):
        raise UserError(f"no row to probe: {loader.total_tokens} rows of --tokens {tokens or 'every token'}, "
                        f"{null_labels} of them of a null --label {label}")
    sample_ids, positions = np.concatenate(sample_ids), np.concatenate(positions)
    order = np.lexsort((positions, sample_ids))  # by sample id, then position: no layout shows
    features = {}
    for key in keys:
        features[key] = np.concatenate(parts.pop(key))[order]
    sample_ids, positions = sample_ids[order], positions[order]
    where = np.searchsorted(ids, sample_ids)
    return ProbeRows(features, labels[where], groups[where], sample_ids, positions, table.schema.field(label).type,
                     null_labels, loader)


def drawn(sample_ids: np.ndarray, positions: np.ndarray, seed: int, share: float) -> np.ndarray:
    """[n] bool: whether each token is in a draw of about ``share`` of all, decided by its own
    (sample id, position) and the seed."""
    if share >= 1:
        return np.ones(len(sample_ids), bool)
    salt = splitmix64(np.full(len(sample_ids), seed, np.uint64))
    hashed = splitmix64(splitmix64(sample_ids.astype(np.uint64) ^ salt) ^ (positions + 1).astype(np.uint64))
    return hashed < np.uint64(share * 2.0**64)
