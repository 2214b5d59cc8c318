"""ARC grids: what makes a value one (a non-empty rectangular list of rows of integers 0..9), for
the prepare pipeline that reads tasks and every reader of the streams that carry expected
outputs. Needs neither Beam nor JAX."""

from __future__ import annotations

from typing import Any

_DIGITS = frozenset(range(10))
_INT_ONLY = frozenset([int])  # not bool or float, which compare equal to 0/1


def grid_problem(grid: Any, where: str) -> tuple[str, str] | None:
    """(a reason code, one line naming it) of what makes ``grid`` no grid, or None for a grid.
    Codes: ``empty_grid``, ``cell_out_of_range``, ``non_rectangular_grid``."""
    if not isinstance(grid, (list, tuple)) or not grid:
        return "empty_grid", f"{where} is not a non-empty list of rows"
    for r, row in enumerate(grid):
        if not isinstance(row, (list, tuple)) or not row:
            return "empty_grid", f"{where} row {r} is not a non-empty list"
        # Fast path (whole row at once); the cell-by-cell loop only runs to name the bad cell.
        if not (_INT_ONLY.issuperset(map(type, row)) and _DIGITS.issuperset(row)):
            c, cell = next((c, cell) for c, cell in enumerate(row) if type(cell) is not int or not 0 <= cell <= 9)
            return "cell_out_of_range", f"{where} cell ({r}, {c}) = {cell!r} is not an integer 0..9"
    widths = {len(row) for row in grid}
    if len(widths) != 1:
        return "non_rectangular_grid", f"{where} has rows of different widths {sorted(widths)}"
    return None
