"""The fleet's end: the merged index (``pipeline.index``'s code) and a completeness check against
the prepare manifest and the streams, with one verdict line.

Complete means: every machine completed; each machine stored exactly the records of its stream
(its first ``--max_samples`` where set) except those its runner skipped, which are listed in its
``rejected.jsonl``; no sample id twice; none missing.

A stream's ids come from its sidecar ``stream_NNN.ids.npy`` (written by ``pipeline.prepare``
beside it, described under ``ids`` in the manifest), so the streams themselves are not read.
Where the manifest names no sidecar (an older prepare), or the sidecar or the stream is not what
the manifest describes (its sha256, the size of each of the stream's parts), the stream is read in
full instead (``common/stream_reader.py``: one file or its parts) and a log line says so: the
stream is the truth, the sidecar only a faster way to its ids, so the verdict is the same either
way.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import json
import logging
import re
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from activations.index import CollectedIndex, collect_index, write_merged
from common.files import join, read_optional
from common.stream_format import sidecar_ids
from common.stream_reader import Stream, StreamNotFound, machine_stream
from fleet.config import FleetConfig, manifest_samples
from fleet.machines import MachineFiles, read_fleet
from host.rejected import REJECTED_FILE
from common.states import COMPLETED

log = logging.getLogger("runners.fleet")
SAMPLE_ID = re.compile(rb'"sample_id"\s*:\s*(-?\d+)')


def stream_ids(stream: Stream, limit: int | None) -> np.ndarray:
    """The sample ids of a stream's first ``limit`` records (all if None), in order."""
    ids = array.array("q")  # int64: a fifth of a list's memory at millions of ids
    for _, line, _, _ in stream.raw_lines():
        if limit is not None and len(ids) >= limit:
            break
        if line.strip():
            found = SAMPLE_ID.search(line)  # the first key: no need to parse the token lists
            ids.append(int(found.group(1)) if found else json.loads(line)["sample_id"])
    return np.frombuffer(ids, dtype=np.int64)


def size_mismatch(stream: Stream, entry: dict[str, Any]) -> str | None:
    """How the stream's parts differ in size from what the manifest says (None: they do not).
    One metadata request a part; raises ``StreamNotFound`` for a missing part."""
    sizes = stream.sizes()
    for part, size in zip(stream.parts, sizes):
        if part.bytes is not None and size != part.bytes:
            return f"{part.path} is {size} bytes, the manifest says {part.bytes}"
    if sum(sizes) != entry["stream_bytes"]:
        return f"{stream.name} is {sum(sizes)} bytes, the manifest says {entry['stream_bytes']}"
    return None


def ids_from_sidecar(stream: Stream, streams_dir: str, entry: dict[str, Any], limit: int | None) -> np.ndarray | None:
    """The ids of a stream's first ``limit`` records (all if None) from its sidecar, or None (with
    a warning where the manifest names one) when there is none to trust. Raises
    ``StreamNotFound`` without a stream, as reading it would."""
    sidecar = entry.get("ids")
    if sidecar is None:
        return None
    m, mismatch = entry["machine"], size_mismatch(stream, entry)
    data = read_optional(join(streams_dir, sidecar["file"]))
    if mismatch is not None:
        reason = mismatch
    elif data is None:
        reason = f"no {sidecar['file']}"
    elif hashlib.sha256(data).hexdigest() != sidecar["sha256"]:
        reason = f"{sidecar['file']} is not the one the manifest describes (sha256)"
    else:
        # In stream order, so its first ``limit`` are the records a runner with --max_samples takes.
        return sidecar_ids(data)[:limit]
    log.warning("machine %03d: %s; reading its stream in full", m, reason)
    return None


def expected_ids(streams_dir: str, entry: dict[str, Any], limit: int | None) -> np.ndarray:
    """The ids of a stream's first ``limit`` records (all if None), in order: from the sidecar
    where it can be trusted, else read from the stream (its parts as the manifest lists them).
    Raises ``StreamNotFound`` without a stream."""
    stream = machine_stream(streams_dir, entry["machine"], entry)
    ids = ids_from_sidecar(stream, streams_dir, entry, limit)
    return ids if ids is not None else stream_ids(stream, limit)


def rejected_ids(dirs: Sequence[str]) -> list[int]:
    """The records a machine's runner skipped, from its ``rejected.jsonl`` (one per process)."""
    lines = [line for d in dirs for line in (read_optional(join(d, REJECTED_FILE)) or b"").splitlines()]
    return [json.loads(line)["sample_id"] for line in lines if line.strip()]


def _ids(values: np.ndarray, most: int = 5) -> str:
    shown = ", ".join(str(v) for v in np.sort(values)[:most])
    return shown + (f", ... ({len(values)} in all)" if len(values) > most else "")


@dataclasses.dataclass
class Verdict:
    complete: bool
    problems: list[str]
    skipped: dict[int, int]   # machine -> records its runner skipped


def check_machine(config: FleetConfig, files: MachineFiles, expected_count: int, entry: dict[str, Any],
                  stored: np.ndarray, limit: int | None) -> tuple[list[str], int]:
    """(problems, skipped records) of one machine; ``entry`` is its manifest entry, ``stored`` the
    unique ids its index holds."""
    m, problems = files.machine_id, []
    state = (files.status or {}).get("state") or "missing"
    if files.checkpoint_status() == COMPLETED and not files.completed(limit):
        problems.append(f"machine {m:03d} completed under a smaller --max_samples than the runner flags ask for")
    elif files.checkpoint_status() != COMPLETED:
        problems.append(f"machine {m:03d} not completed ({state})")
    skipped = np.unique(np.array(rejected_ids(files.dirs or (config.machine_dir(m),)), dtype=np.int64))
    try:
        ids = expected_ids(config.streams_dir, entry, limit)
    except StreamNotFound as e:
        return problems + [f"machine {m:03d}: no stream {e.path}"], len(skipped)
    if limit is None and len(ids) != expected_count:
        problems.append(f"machine {m:03d}: its stream has {len(ids)} records, the manifest says {expected_count}")
    expected = np.setdiff1d(ids, skipped)  # unique and sorted
    missing = np.setdiff1d(expected, stored, assume_unique=True)
    unexpected = np.setdiff1d(stored, expected, assume_unique=True)
    if len(missing):
        problems.append(f"machine {m:03d}: {len(missing)} sample(s) missing: {_ids(missing)}")
    if len(unexpected):
        problems.append(f"machine {m:03d}: {len(unexpected)} sample(s) not in its stream: {_ids(unexpected)}")
    return problems, len(skipped)


def stored_ids(table: pa.Table | None, machines: int) -> list[np.ndarray]:
    """Per machine, the unique sample ids its rows in the index table hold (sorted)."""
    if table is None:
        return [np.empty(0, np.int64) for _ in range(machines)]
    machine, ids = table["machine_id"].to_numpy(), table["sample_id"].to_numpy()
    order = np.argsort(machine, kind="stable")
    bounds = np.searchsorted(machine[order], np.arange(machines + 1))
    return [np.unique(ids[order[a:b]]) for a, b in zip(bounds[:-1], bounds[1:])]


def verdict(config: FleetConfig, manifest: dict[str, Any], collected: CollectedIndex | None,
            files: Sequence[MachineFiles], limit: int | None) -> Verdict:
    problems: list[str] = []
    if collected is not None and collected.duplicates:
        repeats = pc.value_counts(collected.table["sample_id"])
        twice = pc.filter(repeats.field("values"), pc.greater(repeats.field("counts"), 1))
        problems.append(f"{len(twice)} sample id(s) stored more than once: {_ids(twice.to_numpy())}")
    counts = manifest_samples(manifest)
    entries = {e["machine"]: e for e in manifest["machines"]}
    without = [m for m in counts if "ids" not in entries.get(m, {})]
    if without:
        log.info("%d of %d streams in %s have no id sidecar (an older pipeline.prepare): reading them in full",
                 len(without), len(counts), config.streams_dir)
    stored = stored_ids(collected.table if collected is not None else None, len(counts))
    skipped = {}
    for f in files:
        m = f.machine_id
        machine_problems, skipped[m] = check_machine(config, f, counts[m], entries.get(m, {"machine": m}),
                                                     stored[m], limit)
        problems += machine_problems
    return Verdict(not problems, problems, skipped)


def merge(config: FleetConfig, manifest: dict[str, Any], index_path: str | None,
          limit: int | None) -> tuple[Verdict, str]:
    """Merges the index (unless ids repeat) and checks completeness; (verdict, its one line)."""
    files = read_fleet(config)
    have_index = any(f.checkpoint and f.checkpoint.get("total_shards") for f in files)
    collected = collect_index(config.output) if have_index else None
    result = verdict(config, manifest, collected, files, limit)
    index_path = index_path or join(config.output, "index.parquet")
    written = collected is not None and not collected.duplicates
    summary = write_merged(collected, index_path) if written else None
    total_skipped = sum(result.skipped.values())
    listed = (f" ({total_skipped} skipped, listed in machine_NNN/{REJECTED_FILE})" if total_skipped else "")
    if result.complete:
        summary = summary or {"total_samples": 0, "total_tokens": 0, "total_shards": 0}  # all skipped
        line = (f"fleet {config.name} complete: {config.num_machines} machines, "
                f"{summary['total_samples']:,} samples{listed}, {summary['total_tokens']:,} tokens, "
                f"{summary['total_shards']} shards" + (f"; index {index_path}" if written else ""))
    else:
        where = f"; partial index {index_path}" if written else "; no index written"
        line = f"fleet {config.name} INCOMPLETE: {'; '.join(result.problems)}{where}"
    return result, line
