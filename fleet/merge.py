"""The fleet's end: the merged index (``pipeline.index``'s code) and a completeness check against
the prepare manifest and the streams, with one verdict line.

Complete means: every machine completed; each machine stored exactly the records of its stream
(its first ``--max_samples`` where set) except those its runner skipped, which are listed in its
``rejected.jsonl``; no sample id twice; none missing.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

import pyarrow.compute as pc

from activations.index import CollectedIndex, collect_index, write_merged
from common.files import binary_lines, join, open_read, read_optional
from fleet.config import FleetConfig, manifest_samples
from fleet.machines import MachineFiles, read_fleet
from host.rejected import REJECTED_FILE
from host.states import COMPLETED

SAMPLE_ID = re.compile(rb'"sample_id"\s*:\s*(-?\d+)')


def stream_ids(path: str, limit: int | None) -> list[int]:
    """The sample ids of a stream's first ``limit`` records (all if None), in order."""
    ids: list[int] = []
    with open_read(path) as f:
        for line in binary_lines(f):
            if limit is not None and len(ids) >= limit:
                break
            if line.strip():
                found = SAMPLE_ID.search(line)  # the first key: no need to parse the token lists
                ids.append(int(found.group(1)) if found else json.loads(line)["sample_id"])
    return ids


def rejected_ids(dirs: Sequence[str]) -> list[int]:
    """The records a machine's runner skipped, from its ``rejected.jsonl`` (one per process)."""
    lines = [line for d in dirs for line in (read_optional(join(d, REJECTED_FILE)) or b"").splitlines()]
    return [json.loads(line)["sample_id"] for line in lines if line.strip()]


def _ids(values: Sequence[int], most: int = 5) -> str:
    shown = ", ".join(str(v) for v in sorted(values)[:most])
    return shown + (f", ... ({len(values)} in all)" if len(values) > most else "")


@dataclasses.dataclass
class Verdict:
    complete: bool
    problems: list[str]
    skipped: dict[int, int]   # machine -> records its runner skipped


def check_machine(config: FleetConfig, files: MachineFiles, expected_count: int, stored: set[int],
                  limit: int | None) -> tuple[list[str], int]:
    """(problems, skipped records) of one machine."""
    m, problems = files.machine_id, []
    state = (files.status or {}).get("state") or "missing"
    if files.checkpoint_status() != COMPLETED:
        problems.append(f"machine {m:03d} not completed ({state})")
    skipped = set(rejected_ids(files.dirs or (config.machine_dir(m),)))
    stream = join(config.streams_dir, f"stream_{m:03d}.jsonl")
    try:
        ids = stream_ids(stream, limit)
    except FileNotFoundError:
        return problems + [f"machine {m:03d}: no stream {stream}"], len(skipped)
    if limit is None and len(ids) != expected_count:
        problems.append(f"machine {m:03d}: its stream has {len(ids)} records, the manifest says {expected_count}")
    expected = set(ids) - skipped
    missing, unexpected = expected - stored, stored - expected
    if missing:
        problems.append(f"machine {m:03d}: {len(missing)} sample(s) missing: {_ids(missing)}")
    if unexpected:
        problems.append(f"machine {m:03d}: {len(unexpected)} sample(s) not in its stream: {_ids(unexpected)}")
    return problems, len(skipped)


def verdict(config: FleetConfig, manifest: dict[str, Any], collected: CollectedIndex | None,
            files: Sequence[MachineFiles], limit: int | None) -> Verdict:
    problems: list[str] = []
    if collected is not None and collected.duplicates:
        ids = collected.table["sample_id"]
        counts = pc.value_counts(ids)
        twice = [c["values"].as_py() for c in counts if c["counts"].as_py() > 1]
        problems.append(f"{len(twice)} sample id(s) stored more than once: {_ids(twice)}")
    table = collected.table if collected is not None else None
    expected = manifest_samples(manifest)
    skipped = {}
    for f in files:
        stored = (set(table.filter(pc.equal(table["machine_id"], f.machine_id))["sample_id"].to_pylist())
                  if table is not None else set())
        machine_problems, skipped[f.machine_id] = check_machine(config, f, expected[f.machine_id], stored, limit)
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
