"""A restarted host with the persistent compilation cache: time from process start to the first
stored shard, cold cache vs warm cache, same command, same machine, one run.

Qwen2.5-0.5B-shaped model (random weights, float32, layers 6, 12, 18, 23), the first ARC-AGI-1
prompts at --max_seq_length 2048, batch 4. The first run compiles into an empty cache directory,
the second (a fresh output directory, as after a preemption that lost the disk) loads from it.
Each run's time to first shard is split, from its status.json, into start-up (process start to
model loaded), compiling (tracing and lowering, which no cache skips, and the backend: XLA's
compile, or its load from the cache) and computing the first window, which the cache does not
touch; the restart overhead is start-up + compiling.

    python benchmarks/restart_compile_cache.py [--num_samples 16] [--max_seq_length 2048]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from host_throughput import LAYERS, arc_stream_and_model


def time_to_first_shard(stream: str, model_dir: str, out: str, cache: str, args) -> tuple[float, float, dict]:
    """(seconds from process start to the first stored shard, seconds from process start to
    model loaded, status.json)."""
    checkpoint = os.path.join(out, "machine_000", "checkpoint.json")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the machine's own devices
    start, wall_start = time.perf_counter(), time.time()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "runners.tpu_host", "--machine_id", "0",
                                 "--dataset_stream", stream, "--model_path", model_dir,
                                 "--layers_to_extract", LAYERS, "--batch_size", str(args.batch_size),
                                 "--max_seq_length", str(args.max_seq_length), "--dtype", "float32",
                                 "--shard_size_gb", str(args.shard_size_gb), "--output_dir", out,
                                 "--compilation_cache_dir", cache], stdout=log, stderr=subprocess.STDOUT,
                                env=env)
        first = None
        while proc.poll() is None:
            if first is None and os.path.exists(checkpoint):  # written once the first shard is stored
                first = time.perf_counter() - start
            time.sleep(0.05)
        end = time.perf_counter() - start
        if proc.returncode != 0:
            log.seek(0)
            raise SystemExit(f"runner failed:\n{log.read()[-3000:]}")
    with open(os.path.join(out, "machine_000", "status.json")) as f:
        status = json.load(f)
    loaded = next(h["at"] for h in status["history"] if h["state"] == "running")
    return first if first is not None else end, datetime.datetime.fromisoformat(loaded).timestamp() - wall_start, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_samples", type=int, default=16)
    parser.add_argument("--max_seq_length", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--shard_size_gb", type=float, default=0.05)
    parser.add_argument("--model_dir", default=os.path.join(tempfile.gettempdir(), "qwen2.5-0.5b-shaped"))
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="cache_bench.")
    stream = arc_stream_and_model(work, args.num_samples, args.max_seq_length, args.model_dir)
    cache = os.path.join(work, "xla_cache")
    runs = {name: time_to_first_shard(stream, args.model_dir, os.path.join(work, name), cache, args)
            for name in ("cold", "warm")}
    cache_mb = sum(os.path.getsize(os.path.join(cache, f)) for f in os.listdir(cache)) / 1e6
    with open(stream) as f:
        tokens = sum(json.loads(line)["num_tokens"] for line in f)
    print(f"{args.num_samples} ARC prompts ({tokens} tokens), max_seq_length {args.max_seq_length}, "
          f"batch {args.batch_size}, layers {LAYERS}, float32; cache {cache_mb:.1f} MB")
    overhead = {}
    for name, (first, startup, status) in runs.items():
        phases, cache_stats = status["compile_phases_s"], status["compilation_cache"]
        overhead[name] = startup + status["compile_s"]
        print(f"{name} cache: first shard after {first:6.1f} s = start-up {startup:5.1f} s + compiling "
              f"{status['compile_s']:5.1f} s (trace {phases['trace']:4.1f}, lower {phases['lower']:4.1f}, "
              f"backend {phases['backend']:5.1f}; {cache_stats['hits']} of {cache_stats['lookups']} shapes "
              f"from the cache) + computing {first - overhead[name]:6.1f} s")
    cold_phases, warm_phases = (runs[n][2]["compile_phases_s"] for n in ("cold", "warm"))
    print(f"time to first shard, warm / cold = {runs['warm'][0] / runs['cold'][0]:.2f}")
    print(f"restart overhead (start-up + compiling), warm / cold = {overhead['warm']:.1f} / "
          f"{overhead['cold']:.1f} s = {overhead['warm'] / overhead['cold']:.2f}")
    print(f"backend (XLA compile vs cache load), warm / cold = {warm_phases['backend']:.1f} / "
          f"{cold_phases['backend']:.1f} s = {warm_phases['backend'] / cold_phases['backend']:.2f}")


if __name__ == "__main__":
    main()
