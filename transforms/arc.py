"""ARC tasks: parsing both schemas in use, validating grids, and rendering the chat prompt.

Schemas: ARC-AGI (``{"train": [{"input", "output"}...], "test": [{"input"}...]}``) and BARC-style
(``{"examples": [[input, output], ...]}``, where the last pair is the test). A grid is rendered as
a fenced block opening with ```` ```grid ````, one row of digits per line. A test's expected output,
when the task has it, is the answer (``pipeline.prepare --include_answers``): its grid block, and
it travels in the stream record (``expected_output``) either way, so that a continuation the model
writes (``runners.tpu_host --generate``) is scored against it (``scored_answer``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from common.grids import grid_problem
from transforms.rejections import RejectedRecord

SYSTEM_PROMPT = ("You are an expert at solving ARC (Abstraction and Reasoning Corpus) puzzles. "
                 "Each puzzle shows input/output grid pairs that follow one hidden rule; "
                 "apply the rule to the test input.")

Grid = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class ArcTask:
    task_id: str
    train: tuple[tuple[Grid, Grid], ...]  # (input, output) pairs
    test_inputs: tuple[Grid, ...]
    test_outputs: tuple[Grid | None, ...] = ()  # per test input: its expected output, if given


def is_arc_record(record: Any) -> bool:
    return isinstance(record, dict) and (("train" in record and "test" in record)
                                         or "examples" in record)


def parse_grid(grid: Any, where: str) -> Grid:
    """A validated grid (``common.grids``): a non-empty rectangular list of rows of integers 0..9;
    ``RejectedRecord`` naming what is wrong otherwise."""
    if problem := grid_problem(grid, where):
        raise RejectedRecord(*problem)
    return tuple(tuple(row) for row in grid)


def _field(record: dict, key: str, where: str) -> Any:
    if key not in record:
        raise RejectedRecord("missing_field", f"{where} has no {key!r}")
    return record[key]


def _pair(pair: Any, where: str) -> tuple[Grid, Grid]:
    if isinstance(pair, dict):
        return (parse_grid(_field(pair, "input", where), f"{where} input"),
                parse_grid(_field(pair, "output", where), f"{where} output"))
    if isinstance(pair, (list, tuple)) and len(pair) == 2:
        return parse_grid(pair[0], f"{where} input"), parse_grid(pair[1], f"{where} output")
    raise RejectedRecord("missing_field", f"{where} is not an input/output pair")


def _nonempty_list(value: Any, where: str) -> list:
    if not isinstance(value, (list, tuple)) or not value:
        raise RejectedRecord("missing_field", f"{where} is not a non-empty list")
    return list(value)


def parse_arc_task(record: dict, default_id: str, with_outputs: bool = False) -> ArcTask:
    """An ``ArcTask`` from either schema; raises ``RejectedRecord`` naming what is wrong. Test
    outputs are read (and validated) only ``with_outputs``: without, a task is read as before."""
    task_id = str(record.get("id") or record.get("task_id") or record.get("uid") or default_id)
    if "examples" in record and "train" not in record:
        pairs = [_pair(p, f"example {i}")
                 for i, p in enumerate(_nonempty_list(record["examples"], "examples"))]
        if len(pairs) < 2:
            raise RejectedRecord("missing_field", "examples needs at least one train and one test pair")
        return ArcTask(task_id, tuple(pairs[:-1]), (pairs[-1][0],), (pairs[-1][1],) if with_outputs else ())
    train = [_pair(p, f"train {i}")
             for i, p in enumerate(_nonempty_list(_field(record, "train", "task"), "train"))]
    tests, outputs = [], []
    for i, test in enumerate(_nonempty_list(_field(record, "test", "task"), "test")):
        grid = test.get("input") if isinstance(test, dict) else None
        if grid is None:
            raise RejectedRecord("missing_field", f"test {i} has no 'input'")
        tests.append(parse_grid(grid, f"test {i} input"))
        output = test.get("output") if with_outputs else None
        outputs.append(None if output is None else parse_grid(output, f"test {i} output"))
    return ArcTask(task_id, tuple(train), tuple(tests), tuple(outputs))


def grid_block(grid: Grid) -> str:
    """A grid as a fenced ```` ```grid ```` block, one row of digits per line."""
    return "```grid\n" + "\n".join("".join(map(str, row)) for row in grid) + "\n```"


def arc_answer(task: ArcTask, test_index: int) -> str | None:
    """The expected answer to test input ``test_index``: its output's grid block (None if the
    task does not give it)."""
    outputs = task.test_outputs
    output = outputs[test_index] if test_index < len(outputs) else None
    return None if output is None else grid_block(output)


def arc_messages(task: ArcTask, test_index: int) -> list[dict[str, str]]:
    """The chat (system, user) asking for the output of test input ``test_index``."""
    parts = ["Here are the training examples of an ARC task. Each grid is a block of digits "
             "0-9, one row per line."]
    for i, (grid_in, grid_out) in enumerate(task.train, start=1):
        parts.append(f"Example {i}\nInput:\n{grid_block(grid_in)}\nOutput:\n{grid_block(grid_out)}")
    parts.append(f"Test input:\n{grid_block(task.test_inputs[test_index])}\n"
                 "What is the output grid for the test input? Answer with a ```grid block.")
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "\n\n".join(parts)}]


# A fenced block: an opening fence at a line's start (any info string: ```grid, or none), its body,
# a closing fence at a line's start. Backticks inside a sentence ("answer with a ```grid block")
# open nothing.
_FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


def first_grid(text: str) -> Grid | None:
    """The grid of the first fenced block of ``text`` (rows of digits, one per line; spaces or
    tabs between digits allowed), or None where the first block is not a rectangular grid, or
    where no block is closed."""
    match = _FENCED.search(text)
    if match is None:
        return None
    rows = ["".join(line.split()) for line in match.group(1).strip().splitlines()]
    if not rows or not all(row.isascii() and row.isdigit() for row in rows) or len({len(r) for r in rows}) != 1:
        return None
    return tuple(tuple(int(cell) for cell in row) for row in rows)


def scored_answer(text: str, expected: Any) -> dict[str, Any]:
    """A continuation's ``text`` scored against a task's ``expected`` output grid: whether its
    first grid block (``first_grid``) is that grid, and the block's rows and columns (None where
    there is none)."""
    grid = first_grid(text)
    return {"answer_correct": grid is not None and grid == parse_grid(expected, "the expected output"),
            "answer_rows": None if grid is None else len(grid),
            "answer_cols": None if grid is None else len(grid[0])}


def arc_same_shape(task: dict) -> bool | None:
    """Whether every test output grid of an ARC task has its input's shape (None where an output
    is not given): whether the model must keep the grid's size or find a new one."""
    tests = task.get("test") or []
    if not tests or any("output" not in t for t in tests):
        return None
    return all(_grid_shape(t["input"]) == _grid_shape(t["output"]) for t in tests)


def _grid_shape(grid: list) -> tuple[int, int]:
    return len(grid), len(grid[0]) if grid else 0
