"""What a store's tokens are, for reading with a token selection: each stored sample's roles,
special tokens and which tokens its rows are, from ``index_tokens.parquet`` beside the merged
index (``activations.index.TOKENS_SCHEMA``), and the rows a selection keeps (``kept_rows``).

A store made with a selection (``runners.tpu_host --tokens``) holds some rows of each sample
(``positions``); a pooled one a single row, the mean of its selected tokens (the table's
``selection`` says which). Reading with a selection applies it to the stored tokens: reading an
every-token store with a selection gives exactly the rows a store made with it holds, and on a
selected store ``first`` and ``last`` are the first and last stored tokens. A pooled store is read
as it is, without another selection.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from activations.index import TOKENS_SCHEMA, read_index_file, read_parquet, tokens_path
from activations.selection import Selection, parse_selection
from common.cli import UserError
from common.roles import ROLES

NO_POSITION = -1  # the position of a pooled row (the mean of several tokens)


@dataclasses.dataclass
class Ragged:
    """One list per sample, flattened: sample ``i``'s is ``values[offsets[i]:offsets[i + 1]]``, or
    None where ``present[i]`` is false (a null list)."""
    values: np.ndarray    # [total]
    offsets: np.ndarray   # [samples + 1] int64
    present: np.ndarray   # [samples] bool

    @classmethod
    def of(cls, column: pa.ChunkedArray, values=lambda flat: flat.to_numpy(zero_copy_only=False)) -> "Ragged":
        lists = column.combine_chunks()
        flat = lists.flatten()  # the values of the non-null lists, in order
        counts = pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False)
        return cls(values(flat), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                   lists.is_valid().to_numpy(zero_copy_only=False))

    def __getitem__(self, i: int) -> np.ndarray | None:
        return self.values[self.offsets[i]:self.offsets[i + 1]] if self.present[i] else None


@dataclasses.dataclass
class StoredTokens:
    """The tokens table of some samples as flat arrays (a few bytes a token-run, special token
    and stored position, whatever the number of samples), looked up by sample id."""
    ids: np.ndarray          # [samples] int64, sorted
    num_tokens: np.ndarray   # [samples] int64: the sample's tokens
    rows: np.ndarray         # [samples] int64: rows stored of each sample
    run_roles: Ragged        # each sample's runs: role codes (common.roles.ROLE_CODES) ...
    run_counts: Ragged       # ... and their lengths
    special: Ragged          # positions of special tokens
    positions: Ragged        # the stored rows' positions (None: every token)
    selection: Selection | None = None  # the selection they were stored with (None: every token)

    def find(self, sample_id: int) -> int:
        i = int(np.searchsorted(self.ids, sample_id))
        if i == len(self.ids) or self.ids[i] != sample_id:
            raise UserError(f"sample {sample_id} is not in the index's tokens table: merge the index again "
                            "with pipeline.index")
        return i

    def role_codes(self, i: int) -> np.ndarray | None:
        """[tokens] uint8: sample ``i``'s role codes (None for a stream from before roles)."""
        roles = self.run_roles[i]
        return None if roles is None else np.repeat(roles, self.run_counts[i])


def read_stored_tokens(index: str, sample_ids: Sequence[int] | None = None) -> StoredTokens:
    """The tokens table beside the merged ``index`` (of ``sample_ids``, else every sample)."""
    path = tokens_path(index)
    try:
        table = read_index_file(path, TOKENS_SCHEMA)
    except FileNotFoundError:
        raise UserError(f"no {path!r}: the store was written before token roles were stored, or its index was "
                        "merged before; merge it again with pipeline.index (a store from before roles can be "
                        "read without --tokens)") from None
    if sample_ids is not None:
        table = table.filter(pc.is_in(table["sample_id"], value_set=pa.array(np.asarray(sample_ids, np.int64))))
    table = table.sort_by("sample_id")
    codes = pa.array(ROLES)
    return StoredTokens(
        table["sample_id"].to_numpy().astype(np.int64), table["num_tokens"].to_numpy().astype(np.int64),
        table["rows"].to_numpy().astype(np.int64),
        Ragged.of(table["roles"], lambda flat: pc.index_in(flat.field("role"), value_set=codes)
                  .to_numpy(zero_copy_only=False).astype(np.uint8)),
        Ragged.of(table["roles"], lambda flat: flat.field("count").to_numpy(zero_copy_only=False).astype(np.int64)),
        Ragged.of(table["special"]), Ragged.of(table["positions"]), _one_selection(table["selection"]))


def store_selection(index: str) -> Selection | None:
    """The token selection a store was made with (``runners.tpu_host --tokens``), from the tokens
    table beside the merged ``index`` (its one column read; None: every token, or a store from
    before the table); ``UserError`` if its samples were stored with different ones."""
    try:
        return _one_selection(read_parquet(tokens_path(index), columns=["selection"])["selection"])
    except FileNotFoundError:
        return None


def _one_selection(column: pa.ChunkedArray) -> Selection | None:
    made = pc.unique(column).to_pylist()
    if len(made) > 1:
        raise UserError(f"the store's machines stored different token selections "
                        f"({', '.join(str(m) if m else 'every token' for m in made)}): read them one machine at a time")
    return parse_selection(made[0]) if made else None


def kept_rows(selection: Selection | None, stored: StoredTokens, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(which of a sample's stored rows a read ``selection`` keeps, their token positions);
    pooled rows have position ``NO_POSITION``."""
    i = stored.find(sample_id)
    rows, num_tokens = int(stored.rows[i]), int(stored.num_tokens[i])
    if stored.selection is not None and stored.selection.pooled:
        if selection is not None:
            raise UserError(f"--tokens {selection}: this store holds one pooled row a sample; read it without a "
                            "selection")
        return np.arange(rows), np.full(rows, NO_POSITION, np.int64)
    positions = stored.positions[i]
    positions = np.arange(num_tokens) if positions is None else positions.astype(np.int64)
    if selection is None:
        return np.arange(rows), positions
    wanted = selection.positions_of(stored.role_codes(i), stored.special[i], num_tokens, among=positions)
    keep = np.flatnonzero(np.isin(positions, wanted))
    return keep, positions[keep]
