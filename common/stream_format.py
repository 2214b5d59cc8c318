"""The stream file format shared by ``pipeline.prepare`` (which writes it) and every reader (the
runner, the fleet's merge, the SAELens export, ``runners.ablate``): one JSON object per line;
beside each stream, its sample ids (the sidecar ``stream_NNN.ids.npy``), which the fleet's merge
reads instead of the stream. Needs neither Beam nor JAX, so the commands that only read streams
start fast."""

from __future__ import annotations

import hashlib
import io
import json
from typing import Any, Sequence

import numpy as np

from common.cli import UserError
from common.grids import grid_problem
from common.roles import runs_problem, special_problem

STREAM_FIELDS = ("sample_id", "input_ids", "num_tokens", "source", "text_preview")


def stream_filename(machine: int) -> str:
    return f"stream_{machine:03d}.jsonl"


def stream_dirname(machine: int) -> str:
    """The directory holding a machine's stream when it is written in several parts."""
    return f"stream_{machine:03d}"


def part_filename(machine: int, part: int) -> str:
    """One part of a parted stream, relative to the streams dir: parts are numbered in stream
    order, so sorting their names gives the stream."""
    return f"{stream_dirname(machine)}/part-{part:05d}.jsonl"


def ids_filename(machine: int) -> str:
    return f"stream_{machine:03d}.ids.npy"


def ids_sidecar(ids: Sequence[int]) -> bytes:
    """A stream's sample ids as an int64 ``.npy`` file, in stream order (prepare's streams are
    sorted by id, so it is sorted too): ``runners.fleet merge`` checks completeness against it
    without reading the stream."""
    out = io.BytesIO()
    np.save(out, np.asarray(ids, dtype=np.int64), allow_pickle=False)
    return out.getvalue()


def sidecar_record(machine: int, sidecar: bytes, count: int) -> dict[str, Any]:
    """The manifest's description of a stream's id sidecar (under ``ids`` in its machine entry):
    the digest ties the file to this manifest."""
    return {"file": ids_filename(machine), "count": count, "sha256": hashlib.sha256(sidecar).hexdigest()}


def sidecar_ids(data: bytes) -> np.ndarray:
    """The int64 ids of an ``ids_sidecar`` file's bytes."""
    return np.load(io.BytesIO(data), allow_pickle=False)


def json_line(obj: Any) -> str:
    """One line of a JSON-lines file (compact, UTF-8 kept: byte-stable output)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


class StreamFormatError(UserError):
    """A malformed line in a stream file; the message names the file and line number."""


def parse_stream_line(line: str, where: str) -> dict[str, Any]:
    """One stream record, validated; ``where`` is ``path:line`` for the error message."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise StreamFormatError(f"{where}: malformed JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise StreamFormatError(f"{where}: a stream line must be a JSON object")
    missing = [f for f in STREAM_FIELDS if f not in record]
    if missing:
        raise StreamFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    ids = record["input_ids"]
    if (not isinstance(ids, list) or not ids
            or not all(type(t) is int and t >= 0 for t in ids)):
        raise StreamFormatError(f"{where}: input_ids must be a non-empty list of token ids")
    if record["num_tokens"] != len(ids):
        raise StreamFormatError(f"{where}: num_tokens {record['num_tokens']} != {len(ids)} input_ids")
    if type(record["sample_id"]) is not int:
        raise StreamFormatError(f"{where}: sample_id must be an integer")
    if type(record.get("truncated", False)) is not bool:
        raise StreamFormatError(f"{where}: truncated must be true or false")
    original = record.get("original_num_tokens", len(ids))
    if type(original) is not int or original < len(ids):
        raise StreamFormatError(f"{where}: original_num_tokens must be an integer >= num_tokens")
    answer_start = record.get("answer_start", 0)
    if type(answer_start) is not int or answer_start < 0:
        raise StreamFormatError(f"{where}: answer_start must be an integer >= 0")
    # Written by prepare since roles existed; a stream from before has neither.
    problem = (runs_problem(record["roles"], len(ids)) if "roles" in record else None) or (
        special_problem(record["special"], len(ids)) if "special" in record else None)
    if problem:
        raise StreamFormatError(f"{where}: {problem}")
    columns = record.get("columns", {})
    if not isinstance(columns, dict) or not all(v is None or isinstance(v, (bool, int, float, str))
                                                for v in columns.values()):
        raise StreamFormatError(f"{where}: columns must be an object of scalar values")
    if "expected_output" in record and (problem := grid_problem(record["expected_output"], "expected_output")):
        raise StreamFormatError(f"{where}: {problem[1]}")
    return record
