"""A fixed-capacity buffer of tokens whose rows leave in random order (a shuffle buffer) or in
arrival order.

Each token is one row across several aligned columns (an activation per layer, its token id,
sample id and position). The storage is allocated once, ``capacity`` rows per column, so the
buffer cannot hold more than that. Drawing ``k`` random rows costs O(k): the rows left at the
end of the live region move into the holes the draw leaves. Taking the oldest ``k`` moves the
rest to the front (nothing, when a batch empties the buffer, as the loader's does).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

Columns = dict[str, np.ndarray]


class TokenBuffer:
    """At most ``capacity`` tokens; ``rng`` draws them at random, ``None`` keeps arrival order."""

    def __init__(self, capacity: int, layout: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                 rng: np.random.Generator | None):
        if capacity < 1:
            raise ValueError(f"a token buffer needs a capacity of at least 1, got {capacity}")
        # {column: [capacity, *row_shape]}
        self._rows = {name: np.empty((capacity, *shape), dtype) for name, (shape, dtype) in layout.items()}
        self.capacity, self.rng = capacity, rng
        self.size = 0     # live rows: the first ``size`` of every column
        self.peak = 0     # the most rows ever held

    @property
    def free(self) -> int:
        return self.capacity - self.size

    def put(self, rows: Mapping[str, np.ndarray]) -> None:
        """Appends rows (every column the same length, at most ``free``)."""
        count = len(next(iter(rows.values())))
        if count > self.free:
            raise ValueError(f"{count} rows do not fit in {self.free} free")
        for name, column in self._rows.items():
            column[self.size:self.size + count] = rows[name]
        self.size += count
        self.peak = max(self.peak, self.size)

    def take(self, count: int) -> Columns:
        """Removes ``count`` rows (at most ``size``): random ones, or the oldest."""
        if count > self.size:
            raise ValueError(f"cannot take {count} of {self.size} rows")
        if self.rng is None:
            out = {name: column[:count].copy() for name, column in self._rows.items()}
            for column in self._rows.values():
                column[:self.size - count] = column[count:self.size]  # numpy copies overlaps safely
            self.size -= count
            return out
        picked = self.rng.choice(self.size, size=count, replace=False)
        out = {name: column[picked] for name, column in self._rows.items()}
        keep = self.size - count
        holes = picked[picked < keep]
        # The live rows past ``keep`` that were not drawn: exactly as many as the holes.
        tail = np.setdiff1d(np.arange(keep, self.size), picked, assume_unique=True)
        for column in self._rows.values():
            column[holes] = column[tail]
        self.size = keep
        return out
