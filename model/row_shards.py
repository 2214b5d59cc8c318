"""One tensor saved as several checkpoint tensors concatenated along axis 0 (Qwen4-Exp's n-gram
tables, saved in ``split_ngram_parts`` row shards), seen as one array and read lazily: a slice
reads only the rows it covers, from the shards that hold them (``model.checkpoint.Checkpoint``'s
row reads), so that a process whose devices hold a row range of the table (``model.sharding``
splits it over a 2d mesh's model axis) never holds the rest of it in host memory."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from common.cli import UserError
from model.checkpoint import Checkpoint


class RowShards:
    """Tensors ``names`` of ``checkpoint``, each [rows_k, ...] with the same trailing shape,
    concatenated in order along axis 0 -> an array-like [sum rows_k, ...] that ``__getitem__``
    reads lazily (each row range once; the ranges asked are kept, for the other devices placing
    the same rows)."""

    def __init__(self, checkpoint: Checkpoint, names: Sequence[str]):
        self.checkpoint, self.names = checkpoint, list(names)
        shapes = [checkpoint.shape(name) for name in self.names]
        if any(s[1:] != shapes[0][1:] for s in shapes):
            raise UserError(f"checkpoint tensors {self.names[0]!r}... differ in shape past their rows "
                            f"({[list(s) for s in shapes]}): they are no row shards of one tensor")
        self.starts = np.cumsum([0] + [s[0] for s in shapes])  # shard k holds rows [starts[k], starts[k + 1])
        self.shape = (int(self.starts[-1]), *shapes[0][1:])
        self.dtype = checkpoint.dtype(self.names[0])
        self._read: dict[tuple[int, int], np.ndarray] = {}

    def rows(self, first: int, last: int) -> np.ndarray:
        """Rows [first, last) of the concatenation -> [last - first, ...], read from the shards
        overlapping them only."""
        if (first, last) not in self._read:
            pieces = []
            for k, name in enumerate(self.names):
                lo, hi = max(first, self.starts[k]), min(last, self.starts[k + 1])
                if lo < hi:
                    pieces.append(self.checkpoint.tensor(name, (int(lo - self.starts[k]), int(hi - self.starts[k]))))
            self._read[first, last] = (np.concatenate(pieces) if pieces
                                       else np.zeros((0, *self.shape[1:]), self.dtype))
        return self._read[first, last]

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        first, last, step = index[0].indices(self.shape[0])
        if step != 1:
            raise ValueError("row shards are read in contiguous row ranges only")
        return self.rows(first, last)[(slice(None), *index[1:])]
