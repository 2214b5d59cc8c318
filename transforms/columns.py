"""Columns of the dataset kept beside each sample (``--keep_columns label,topic``): labels and
metadata that probes, steering and statistics group by.

A kept column holds scalars: ``bool``, ``int64``, ``float64`` or ``string``. Its type is decided
once, at launch (``column_types``): from a parquet file's schema, else from the first record
that has a value in it (JSON has no schema). Each record's value is checked against it
(``kept_values``): null or missing is null; an integer in a float column is that float; any other
value of another type rejects the record (``column_type``), so every value of a column, in every
stream, has the column's type. A column that no record has is one error line before any work,
naming the columns the records do have; so is a column the record format reads
(``require_columns``: ``pipeline.prepare --format chat`` on records without a conversation).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from activations.index import KEPT_COLUMN_TYPES
from activations.site_stats import ROLE_GROUPING
from common.cli import UserError
from transforms.rejections import RejectedRecord
from transforms.sources import SourceFile, read_source_file

COLUMN_TYPES = tuple(KEPT_COLUMN_TYPES)
# Names a kept column cannot take: the stream record's and the per-sample index's own columns.
# ``role`` is the statistics' grouping by token role (runners.tpu_host --stats_by role).
RESERVED = ("sample_id", "input_ids", "num_tokens", "truncated", "original_num_tokens", "answer_start",
            "source", "text_preview", "roles", "special", "columns", "answers", "machine_id", "shard_id", "shard_path",
            "position", "layers", "hidden_size", "dtype", "ablation", ROLE_GROUPING)
MAX_LISTED = 8  # columns a line names, of those the records have


def check_names(names: Sequence[str]) -> None:
    """``UserError`` for a name kept twice or one the index already uses."""
    if len(set(names)) != len(names):
        raise UserError(f"--keep_columns names a column twice: {','.join(names)}")
    taken = [name for name in names if name in RESERVED]
    if taken:
        raise UserError(f"--keep_columns {taken[0]}: the stream record or the index has a column of that name")


def value_type(value: Any) -> str | None:
    """The column type of a scalar value (None for null); ``ValueError`` for a non-scalar."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int64"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, str):
        return "string"
    raise ValueError(type(value).__name__)


def _arrow_type_name(arrow_type) -> str | None:
    import pyarrow as pa
    if pa.types.is_dictionary(arrow_type):  # a categorical column (pandas' category): its values' type
        arrow_type = arrow_type.value_type
    if pa.types.is_boolean(arrow_type):
        return "bool"
    if pa.types.is_integer(arrow_type):
        return "int64"
    if pa.types.is_floating(arrow_type):
        return "float64"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    return None


def column_types(files: Sequence[SourceFile], names: Sequence[str]) -> dict[str, str]:
    """The type of each kept column over the source files; ``UserError`` for a column no record
    has a value in, or one that is not a scalar."""
    found, seen = find_columns(files, [(name,) for name in names])
    types = {name: _scalar_type(name, found[name]) for name in names if name in found}
    missing = [name for name in names if name not in found]
    if missing:
        raise UserError(f"--keep_columns {missing[0]}: {no_value('that column', seen)}")
    return {name: types[name] for name in names}


def require_columns(files: Sequence[SourceFile], required: Sequence[tuple[str, tuple[str, ...], str]]) -> None:
    """``UserError`` for the first (flag, columns, hint) of ``required`` of whose columns no record
    has a value in any (one of them is enough): the columns a format reads, checked as kept
    columns are (``column_types``). ``flag`` begins the line, ``hint`` ends what it lists."""
    found, seen = find_columns(files, [columns for _, columns, _ in required])
    for flag_text, columns, hint in required:
        if not any(name in found for name in columns):
            where = "that column" if len(columns) == 1 else " or ".join(columns)
            raise UserError(f"{flag_text}: {no_value(where, seen, hint)}")


def no_value(where: str, seen: set[str], hint: str = "") -> str:
    """The line's end for columns no record has a value in, with the columns the records have."""
    names = sorted(seen)
    listed = ", ".join(names[:MAX_LISTED]) + (f", ... ({len(names)} in all)" if len(names) > MAX_LISTED else "")
    have = f"the records have: {listed}" if names else "no record of it has any column"
    return f"no record of the dataset has a value in {where} ({have}{hint})"


@dataclasses.dataclass(frozen=True)
class Found:
    """Where a column first has a value: a record (its origin, and the value) or a parquet file
    (its path, and the column's Arrow type)."""
    where: str
    value: Any = None
    arrow_type: Any = None


def find_columns(files: Sequence[SourceFile],
                 groups: Sequence[Sequence[str]]) -> tuple[dict[str, Found], set[str]]:
    """Where each column of ``groups`` first has a value over the source files (a parquet file:
    in its schema, read from the footer), and every column seen on the way. A group is met by any
    one of its columns; the reading stops once every group is, so a column of the first record
    costs one record and a column no record has costs reading the whole dataset."""
    names = list(dict.fromkeys(name for group in groups for name in group))
    found: dict[str, Found] = {}
    seen: set[str] = set()

    def met() -> bool:
        return all(any(name in found for name in group) for group in groups)

    for source in files:
        if met():
            break
        if source.path.endswith(".parquet"):
            schema = _parquet_schema(source)
            seen.update(schema.names)
            for name in names:
                if name not in found and name in schema.names and not _is_null_type(schema.field(name).type):
                    found[name] = Found(source.path, arrow_type=schema.field(name).type)
            continue
        for item in read_source_file(source):
            record = item.record
            if not isinstance(record, dict):
                continue
            seen.update(record)
            for name in names:
                if name not in found and record.get(name) is not None:
                    found[name] = Found(item.origin, value=record[name])
            if met():
                break
    return found, seen


def _scalar_type(name: str, found: Found) -> str:
    """The kept column's type from where it was found; ``UserError`` for one that is not a scalar."""
    if found.arrow_type is not None:
        kind = _arrow_type_name(found.arrow_type)
        if kind is None:
            raise UserError(f"--keep_columns {name}: {found.where} has it as {found.arrow_type}, not a "
                            f"scalar ({', '.join(COLUMN_TYPES)})")
        return kind
    try:
        return value_type(found.value)
    except ValueError as e:
        raise UserError(f"--keep_columns {name}: {found.where} holds a {e} there, not a "
                        f"scalar ({', '.join(COLUMN_TYPES)})") from None


def _is_null_type(arrow_type) -> bool:
    import pyarrow as pa
    return pa.types.is_null(arrow_type)  # a column of nulls only: no value in this file


def _parquet_schema(source: SourceFile):
    import pyarrow.parquet as pq
    from common.files import open_read
    with open_read(source.path) as f:
        return pq.ParquetFile(f).schema_arrow  # the footer only


def kept_values(record: Any, types: dict[str, str]) -> tuple[tuple[str, Any], ...]:
    """(name, value) of each kept column of a record, in the order kept: null where it has none,
    an integer of a float column as a float. ``RejectedRecord`` for a value of another type."""
    out = []
    for name, kind in types.items():
        value = record.get(name) if isinstance(record, dict) else None
        try:
            found = value_type(value)
        except ValueError:
            found = "a " + type(value).__name__
        if found == "int64" and kind == "float64":
            value, found = float(value), kind
        if found not in (None, kind):
            raise RejectedRecord("column_type", f"column {name!r} holds {value!r} ({found}), not {kind}")
        out.append((name, value))
    return tuple(out)
