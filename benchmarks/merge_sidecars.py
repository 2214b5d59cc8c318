"""``runners.fleet merge`` with the streams' id sidecars vs the full read of the streams (the baseline:
what streams from a prepare without sidecars get), same fleet, same run.

The fleet: ``--machines`` streams of ``--records`` synthetic records each, written by prepare's own
``write_stream`` (100..500 random token ids a record, a 200-character preview; sample ids as
FineWeb's), and each machine completed with a one-shard Parquet index of all its records, as a
runner leaves it (no model runs). Timed: ``fleet.merge.merge`` whole (collect the index, check,
write the merged index) and its check alone (``verdict``, the index already collected), each the
best of ``--repeats`` alternating runs with the streams in the page cache: on GCS the full read
downloads every stream too, so there the gap is wider.

    python benchmarks/merge_sidecars.py [--machines 4] [--records 200000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

from activations.index import (ARRAYS_SCHEMA, arrays_index_filename, collect_index, index_filename,
                               parquet_bytes, shard_index)
from common.files import write_bytes
from common.stream_format import json_line
from fleet.config import FleetConfig
from fleet.machines import read_fleet
from fleet.merge import merge, verdict
from common.states import COMPLETED
from transforms.streams import manifest, write_stream

ROWS_PER_FILE = 100_000  # source rows per file, for FineWeb-like ids (file << 40 | row << 8)
PREVIEW = "The quick brown fox jumps over the lazy dog. " * 5  # 225 characters, cut to 200


def write_streams(streams_dir: str, machines: int, records: int) -> tuple[dict, list[list[dict]]]:
    """The streams and their manifest; returns (manifest, each machine's records for its index)."""
    rng = np.random.default_rng(0)
    counts, stored = [], []
    for m in range(machines):
        ids = [((i // ROWS_PER_FILE) << 40) | ((i % ROWS_PER_FILE) << 8)
               for i in range(m, machines * records, machines)]
        lengths = rng.integers(100, 501, size=records)
        entries = []
        for sample_id, n in zip(ids, lengths):
            tokens = rng.integers(0, 151_000, size=n).tolist()
            line = json_line({"sample_id": sample_id, "input_ids": tokens, "num_tokens": int(n),
                              "truncated": False, "source": f"<urn:uuid:{sample_id:032x}>",
                              "text_preview": PREVIEW[:200]})
            entries.append((sample_id, int(n), False, line))
        counts.append(write_stream(streams_dir, m, entries))
        stored.append([{"sample_id": i, "num_tokens": int(n), "source": f"<urn:uuid:{i:032x}>",
                        "text_preview": PREVIEW[:200], "truncated": False, "original_num_tokens": None}
                       for i, n in zip(ids, lengths)])
    doc = manifest({"num_machines": machines}, counts, 0)
    write_bytes(os.path.join(streams_dir, "manifest.json"), json.dumps(doc).encode())
    return doc, stored


def write_completed_machine(output: str, machine: int, samples: list[dict]) -> None:
    """What a runner that stored ``samples`` in one shard leaves in machine_NNN/."""
    base = os.path.join(output, f"machine_{machine:03d}")
    shard = os.path.join(base, "shard_0001.pkl.gz")
    checkpoint = {"status": COMPLETED, "total_shards": 1, "total_samples_processed": len(samples),
                  "shards": [{"shard_id": 1, "total_samples_in_shard": len(samples)}]}
    metadata = {"machine_id": machine, "status": COMPLETED, "total_shards": 1, "total_samples": len(samples)}
    status = {"machine_id": machine, "state": COMPLETED, "samples_done": len(samples)}
    files = {index_filename(1): parquet_bytes(shard_index(samples, machine, 1, shard, [6], 896, "float32")),
             arrays_index_filename(1): parquet_bytes(ARRAYS_SCHEMA.empty_table()),
             "checkpoint.json": json.dumps(checkpoint).encode(), "metadata.json": json.dumps(metadata).encode(),
             "status.json": json.dumps(status).encode()}
    for name, data in files.items():
        write_bytes(os.path.join(base, name), data)


def without_sidecars(doc: dict) -> dict:
    """The manifest as a prepare without sidecars wrote it."""
    return {**doc, "machines": [{k: v for k, v in e.items() if k != "ids"} for e in doc["machines"]]}


def best_of(repeats: int, runs: dict) -> dict[str, tuple[float, object]]:
    """Each run's fastest time (and its result) over ``repeats`` alternating rounds."""
    best: dict[str, tuple[float, object]] = {}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            result = run()
            elapsed = time.perf_counter() - start
            if name not in best or elapsed < best[name][0]:
                best[name] = (elapsed, result)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=4)
    parser.add_argument("--records", type=int, default=200_000, help="records per machine")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="merge_sidecars.")
    try:
        streams, output = os.path.join(work, "streams"), os.path.join(work, "out")
        start = time.perf_counter()
        doc, stored = write_streams(streams, args.machines, args.records)
        for m, samples in enumerate(stored):
            write_completed_machine(output, m, samples)
        del stored
        stream_gb = sum(e["stream_bytes"] for e in doc["machines"]) / 1e9
        sidecar_mb = sum(os.path.getsize(os.path.join(streams, e["ids"]["file"])) for e in doc["machines"]) / 1e6
        print(f"fleet: {args.machines} machines x {args.records:,} records, {doc['total_tokens']:,} tokens; "
              f"streams {stream_gb:.2f} GB, sidecars {sidecar_mb:.1f} MB (written in "
              f"{time.perf_counter() - start:.0f} s)")

        config = FleetConfig(name="bench", num_machines=args.machines, streams_dir=streams, output=output)
        older = without_sidecars(doc)
        whole = best_of(args.repeats, {"full read": lambda: merge(config, older, None, None)[1],
                                       "sidecars": lambda: merge(config, doc, None, None)[1]})
        collected, files = collect_index(output), read_fleet(config)
        check = best_of(args.repeats, {"full read": lambda: verdict(config, older, collected, files, None),
                                       "sidecars": lambda: verdict(config, doc, collected, files, None)})
        assert whole["full read"][1] == whole["sidecars"][1], (whole["full read"][1], whole["sidecars"][1])
        print(f"verdict (both): {whole['sidecars'][1]}")
        for what, times in (("merge", whole), ("its check alone", check)):
            base, ours = times["full read"][0], times["sidecars"][0]
            print(f"{what}: full read {base:.2f} s vs sidecars {ours:.2f} s ({base / ours:.1f}x), "
                  f"best of {args.repeats}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
