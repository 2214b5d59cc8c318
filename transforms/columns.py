"""Columns of the dataset kept beside each sample (``--keep_columns label,topic``): labels and
metadata that probes, steering and statistics group by.

A kept column holds scalars: ``bool``, ``int64``, ``float64`` or ``string``. Its type is decided
once, at launch (``column_types``): from a parquet file's schema, else from the first record
that has a value in it (JSON has no schema). Each record's value is checked against it
(``kept_values``): null or missing is null; an integer in a float column is that float; any other
value of another type rejects the record (``column_type``), so every value of a column, in every
stream, has the column's type. A column that no record has is one error line before any work.
"""

from __future__ import annotations

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
            "source", "text_preview", "roles", "special", "columns", "machine_id", "shard_id", "shard_path",
            "position", "layers", "hidden_size", "dtype", "ablation", ROLE_GROUPING)


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
    found: dict[str, str] = {}
    for source in files:
        if len(found) == len(names):
            break
        if source.path.endswith(".parquet"):
            found.update(_parquet_types(source, [n for n in names if n not in found]))
            continue
        for item in read_source_file(source):
            record = item.record
            for name in names:
                if name not in found and isinstance(record, dict) and record.get(name) is not None:
                    try:
                        found[name] = value_type(record[name])
                    except ValueError as e:
                        raise UserError(f"--keep_columns {name}: {item.origin} holds a {e} there, not a "
                                        f"scalar ({', '.join(COLUMN_TYPES)})") from None
            if len(found) == len(names):
                break
    missing = [name for name in names if name not in found]
    if missing:
        raise UserError(f"--keep_columns {missing[0]}: no record of the dataset has a value in that column")
    return {name: found[name] for name in names}


def _parquet_types(source: SourceFile, names: Sequence[str]) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from common.files import open_read
    with open_read(source.path) as f:
        schema = pq.ParquetFile(f).schema_arrow  # the footer only
    out = {}
    for name in names:
        if name in schema.names and not pa.types.is_null(schema.field(name).type):  # null: no value here
            kind = _arrow_type_name(schema.field(name).type)
            if kind is None:
                raise UserError(f"--keep_columns {name}: {source.path} has it as {schema.field(name).type}, not a "
                                f"scalar ({', '.join(COLUMN_TYPES)})")
            out[name] = kind
    return out


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
