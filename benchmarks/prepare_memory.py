"""Prepare's peak memory as the data grows.

1. Whole runs: an in-process ``pipeline.prepare`` run (one machine) over FineWeb-Edu-like parquet
   files (``fixtures.fineweb_like``) of a small and a large document count, each in a process of
   its own, its peak RSS (``ru_maxrss``: the local runner runs in that one process) against the
   target of at most 1.5x the small run's; and the large run as one part (``--max_part_mb`` larger
   than the stream: the writer without parts) as the baseline. The lines are spilled to files
   where they are made (``transforms.spill``), so what the local FnApiRunner keeps between stages
   (every PCollection, its stand-in for Dataflow's shuffle) is ~100 bytes a sample, not the lines.
2. The writer alone, what a worker holds in the WritePart step: ``write_spilled_part`` reading the
   spilled lines of one part of the large run, then of the whole large stream as one part, each
   in a process of its own: peak RSS over the process's before, per byte written.

    python benchmarks/prepare_memory.py [--small 600] [--large 48000] [--max_part_mb 16] [--num_files 8]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.5
ONE_PART_MB = 1e6  # larger than any stream here: the writer without parts


def measure(dataset: str, output_dir: str, max_part_mb: float, tokenizer: str) -> None:
    """The child: one in-process prepare run; prints its peak RSS and the stream's shape as JSON."""
    from pipeline.prepare import main
    start = time.perf_counter()
    main(["--dataset", dataset, "--tokenizer", tokenizer, "--num_machines", "1",
          "--max_part_mb", str(max_part_mb), "--output_dir", output_dir])
    seconds = time.perf_counter() - start
    peak_kb = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    entry = json.loads((pathlib.Path(output_dir) / "manifest.json").read_text())["machines"][0]
    print(json.dumps({"peak_rss_bytes": peak_kb * 1024, "seconds": seconds, "samples": entry["samples"],
                      "tokens": entry["tokens"], "stream_bytes": entry["stream_bytes"],
                      "parts": len(entry["parts"]), "largest_part": max(p["bytes"] for p in entry["parts"])}))


def memory_status(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def measure_writer(stream_file: str, output_dir: str) -> None:
    """The child: the WritePart step over the lines of ``stream_file``: they are spilled first (as
    the tokenizing step does, in files of ``spill_bytes``), then ``write_spilled_part`` reads them
    back and writes the part; prints the peak RSS that added and the bytes written as JSON."""
    from transforms.spill import StreamEntry, spill_bytes
    from transforms.streams import StreamLayout, write_spilled_part

    limit, sections, batch, size = spill_bytes(os.path.getsize(stream_file)), [], [], 0
    with open(stream_file, "rb") as f:
        for n, line in enumerate(f):
            record = json.loads(line)
            batch.append(StreamEntry(record["sample_id"], record["num_tokens"], record["truncated"], line))
            size += len(line)
            if size >= limit:
                sections += spill(batch, os.path.join(output_dir, f"spill_{n}.bin"))
                batch, size = [], 0
    sections += spill(batch, os.path.join(output_dir, "spill_last.bin"))
    del batch
    # The peak so far is the spilling's; writing 5 to clear_refs resets it to the present RSS.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = memory_status("VmRSS")
    _, part, _ = write_spilled_part(output_dir, StreamLayout(0, (), {}), 0, sections)
    print(json.dumps({"added_bytes": memory_status("VmHWM") - before, "part_bytes": part["bytes"]}))


def spill(entries: list, path: str) -> list:
    """``entries`` written as one spill file (one machine's buckets); its sections."""
    from transforms.partition import VIRTUAL_BUCKETS_PER_MACHINE
    from transforms.spill import SpillSection, encode_spill
    if not entries:
        return []
    data, sections = encode_spill(entries, VIRTUAL_BUCKETS_PER_MACHINE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return [SpillSection(path, *s) for s in sections]


def run_child(*args: str) -> dict:
    result = subprocess.run([sys.executable, __file__, *args], cwd=REPO, capture_output=True, text=True,
                            check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    if result.returncode != 0:
        raise SystemExit(f"{args[0]} {args[1]} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=600, help="documents of the small run")
    parser.add_argument("--large", type=int, default=48_000, help="documents of the large runs")
    parser.add_argument("--max_part_mb", type=float, default=16.0, help="the parted runs' --max_part_mb")
    parser.add_argument("--num_files", type=int, default=8, help="parquet files of each input")
    parser.add_argument("--_run", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--_writer", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._run:
        dataset, output_dir, max_part_mb, tokenizer = args._run
        measure(dataset, output_dir, float(max_part_mb), tokenizer)
        return
    if args._writer:
        measure_writer(*args._writer)
        return
    from fixtures.qwen_tokenizer import cached_tokenizer_dir
    tokenizer = str(cached_tokenizer_dir())
    root = pathlib.Path(tempfile.mkdtemp(prefix="prepare_memory."))
    try:
        report(args, tokenizer, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(args: argparse.Namespace, tokenizer: str, root: pathlib.Path) -> None:
    from fixtures.fineweb_like import write_fineweb_like
    inputs = {n: os.path.dirname(write_fineweb_like(str(root / f"input_{n}"), n, args.num_files)[0]) + "/*.parquet"
              for n in (args.small, args.large)}
    runs = {"small": (args.small, args.max_part_mb), "large": (args.large, args.max_part_mb),
            "large, one part": (args.large, ONE_PART_MB)}
    results = {name: run_child("--_run", inputs[docs], str(root / f"out_{i}"), str(mb), tokenizer)
               for i, (name, (docs, mb)) in enumerate(runs.items())}
    base = results["small"]["peak_rss_bytes"]
    print(f"prepare peak RSS, in-process FnApiRunner, 1 machine, {args.num_files} parquet files, "
          f"{os.cpu_count()} cores")
    for name, r in results.items():
        docs, mb = runs[name]
        limit = "one part" if mb == ONE_PART_MB else f"--max_part_mb {mb:g}"
        print(f"{name:16s} {docs:>7,d} docs {r['tokens']:>12,d} tokens stream {r['stream_bytes'] / 1e6:8.1f} MB "
              f"{limit:18s} {r['parts']:>3d} part(s), largest {r['largest_part'] / 1e6:6.1f} MB  "
              f"peak RSS {r['peak_rss_bytes'] / 1e9:5.2f} GB  x{r['peak_rss_bytes'] / base:.2f} of small  "
              f"{r['seconds']:6.1f} s")
    ratio = results["large"]["peak_rss_bytes"] / base
    print(f"large / small: x{ratio:.2f} (target <= x{TARGET_RATIO}: {'met' if ratio <= TARGET_RATIO else 'MISSED'}); "
          f"one part / parted at {args.large:,} docs: "
          f"x{results['large, one part']['peak_rss_bytes'] / results['large']['peak_rss_bytes']:.2f}")
    writes = {"a part of the large run": root / "out_1" / "stream_000" / "part-00000.jsonl",
              "the large stream as one part": root / "out_2" / "stream_000.jsonl"}
    print("the writer alone (write_spilled_part: the part's lines read back from spill files):")
    for name, stream in writes.items():
        w = run_child("--_writer", str(stream), str(root / "writer"))
        print(f"{name:30s} {w['part_bytes'] / 1e6:8.1f} MB written, peak RSS +{w['added_bytes'] / 1e6:7.1f} MB "
              f"({w['added_bytes'] / w['part_bytes']:.1f} bytes per byte written)")


if __name__ == "__main__":
    main()
