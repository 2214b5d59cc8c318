"""The host's store path alone, fed at unlimited rate, against the disk it writes to.

A synthetic producer (no model) hands samples of float32 arrays, fresh memory each, to the
runner's own ``ShardWriter`` (``host/writer.py``): shards encoded, compressed or raw, written with
fsync, indexed, committed, and with ``gcs`` uploaded to a local GCS API server and verified. Each
configuration runs in a process of its own (peak RSS from wait4). Printed, in one run:

1. the disk's durable write speed (8 MiB writes, then fdatasync: the baseline; and with writeback
   started every 32 MiB, as the shard writer does);
2. per configuration (disk | memory (/dev/shm, the path without the disk's limit) | gcs; raw |
   compressed; compression threads): activation GB/s overall and per stage (a stage's bytes over
   its busy seconds per thread), the share of the time the producer (the forward) waited, and the
   store path's peak memory against its budget;
3. the output rates of Qwen2.5 0.5B / 1.5B / 7B shapes on TPU v4-8 and v5e-8 at 40% of peak bf16,
   and the host cores the measured store path needs for each.

Targets (issue 24): raw to disk >= 50% of the disk's durable speed; compressed 2 threads >= 1.7x
1 thread (printed for the whole path, and for compression alone beside the machine's own scaling:
threads compressing buffers of their own); a run of 4x the memory budget stays within the budget
(peak RSS over the process's own).

A sample holds ``--layers`` arrays of each of ``--sites`` (``model.sites``; all of the default's
are [512, 896]: the 0.5B shape, whose attn.hook_z is 896 wide too) and, as the extraction's
forward hands them over, their statistics measured on the device (``model.statistics``: here
measured once per template array, outside the timed producer); the ``stats`` stage is their
float64 merge per shard. Issue 33's figures: four sites at every layer of the 0.5B shape
(``--sites hook_resid_mid,attn.hook_z,hook_mlp_out,hook_resid_post --layers 24``).

Every configuration also runs, in the same run and alternating with this tree's, the store path
of ``--base`` (a commit, checked out in a temporary git worktree; ``none``: skipped; by default
the commit before issue 69, whose raw writes went through a buffered file, or ``f410578``, before
issue 56, which computed each array's float64 statistics on the host, in the store threads).
Printed per configuration: host CPU-seconds per stored GB of both (target: raw <= 0.4, gzip <=
2.0). The floor under raw shards, measured in the same run: a plain write loop (``PlainWrites``:
the producer's arrays, each written from its own memory into a file a shard, fsync'd), run
alternately with this tree's raw store path to memory; the target: raw within 1.25x of it.

    python benchmarks/store_path.py [--total_gb 2] [--shard_size_gb 0.25] [--threads 1,2]
        [--budget_gb 1] [--gcs_gb 0.5] [--work_dir DIR] [--sites S,S] [--layers 4] [--base 9de6d22]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HIDDEN, TOKENS = 896, 512   # an array: [512, 896] float32 = 1.8 MB
BASE = "9de6d22"  # the commit before issue 69's raw writes (each shard's segments in one writev)
FLOOR_REPEATS = 3  # raw to memory, this tree and a plain write loop alternating: medians compared
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 8 * 2**20
# (name, hidden, blocks, non-embedding parameters) of the Qwen2.5 shapes.
MODELS = (("Qwen2.5-0.5B", 896, 24, 0.36e9), ("Qwen2.5-1.5B", 1536, 28, 1.31e9), ("Qwen2.5-7B", 3584, 28, 6.53e9))
# (name, chips, peak bf16 FLOP/s per chip) (../shared/notes/platform-facts.md).
TPUS = (("v4-8", 4, 275e12), ("v5e-8", 8, 197e12))
UTILISATION, CONTEXT = 0.4, 1024  # of peak; mean attended positions (2,048-token sequences)


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def durable_write_gbps(directory: str, total_gb: float, streamed: bool) -> float:
    """GB/s writing ``total_gb`` in 8 MiB writes then fdatasync; ``streamed``: starting each
    32 MiB's writeback as it is written, as the shard writer does (``host.writer.WRITEBACK_BYTES``)."""
    from host.writer import WRITEBACK_BYTES, start_writeback
    block = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()
    path = os.path.join(directory, "durable_write.bin")
    count = int(total_gb * 1e9) // CHUNK
    start = time.perf_counter()
    with open(path, "wb") as f:
        sent = 0
        for k in range(1, count + 1):
            f.write(block)
            if streamed and k * CHUNK - sent >= WRITEBACK_BYTES:
                f.flush()
                start_writeback(f.fileno(), sent, k * CHUNK - sent)
                sent = k * CHUNK
        os.fdatasync(f.fileno())
    seconds = time.perf_counter() - start
    os.remove(path)
    return count * CHUNK / seconds / 1e9


def child(spec: dict) -> None:
    """One configuration through the ShardWriter, or with ``plain`` the producer's arrays through
    plain ``write`` calls (``plain_writes``); prints ``RESULT {json}``."""
    from host.allocator import one_malloc_arena
    one_malloc_arena()  # as the runner does
    from host.checkpoint import Checkpoint
    from host.rejected import RejectedLog
    from host.storage import GcsStore
    from host.store_stats import StoreStats
    from host.writer import ShardSettings, ShardWriter
    out = spec["out"]
    os.makedirs(os.path.join(out, "index"), exist_ok=True)
    rng = np.random.default_rng(0)
    layers, sites = tuple(range(spec["layers"])), tuple(spec["sites"])
    templates = [rng.standard_normal((TOKENS, HIDDEN), dtype=np.float32) * 4 for _ in range(min(len(layers), 4))]
    measured = template_statistics(templates)
    warm_up()
    baseline = rss_gb()
    store = GcsStore("bench", spec["prefix"]) if spec["gcs"] else None
    settings = ShardSettings(0, out, int(spec["shard_size_gb"] * 1e9), spec["compress"], layers,
                             HIDDEN, "float32", False, 1, {}, memory_budget_bytes=int(spec["budget_gb"] * 1e9),
                             compression_threads=spec["threads"], upload_threads=4, sites=sites)
    keys = settings.keys
    stats = StoreStats()
    writer = PlainWrites(settings) if spec.get("plain") else ShardWriter(
        settings, Checkpoint(), store, RejectedLog(out, store), stats=stats)
    sample_bytes = len(keys) * TOKENS * HIDDEN * 4
    producing = 0.0  # the producer's own CPU time: copying templates into fresh arrays
    cpu0, start = time.process_time(), time.perf_counter()
    for i in range(int(spec["total_gb"] * 1e9) // sample_bytes):
        t = time.thread_time()
        sample = {"sample_id": i, "source": "synthetic", "text_preview": "", "num_tokens": TOKENS,
                  "truncated": False, "original_num_tokens": TOKENS,
                  "activations": {key: templates[k % len(templates)].copy() for k, key in enumerate(keys)}}
        if measured is not None:  # what the forward measured of each array on the device
            sample["statistics"] = {key: measured[k % len(templates)] for k, key in enumerate(keys)}
        producing += time.thread_time() - t
        writer.add(sample)
        del sample  # released outside the producer's time: a plain write loop frees its arrays here
    writer.finalize()
    writer.close()
    wall = time.perf_counter() - start
    store_cpu = time.process_time() - cpu0 - producing
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    snapshot = writer.snapshot() if spec.get("plain") else stats.snapshot()
    print("RESULT " + json.dumps({"wall_s": wall, "store_cpu_s": store_cpu, "baseline_gb": baseline,
                                  "peak_gb": peak, "store": snapshot}))


class PlainWrites:
    """The floor under the raw store path, fed like a ``ShardWriter``: each array written with a
    plain ``write`` from its own memory, into one file a shard, fsync'd; nothing else (no pickle,
    index, statistics or checkpoint), in the calling thread."""

    def __init__(self, settings):
        self.settings, self.shard, self.size, self.stored = settings, 0, 0, 0
        self.file = None

    def add(self, sample: dict) -> None:
        if self.file is None:
            self.shard += 1
            self.file = open(os.path.join(self.settings.machine_dir, f"plain_{self.shard:04d}.bin"), "wb")
        for array in sample["activations"].values():
            self.file.write(memoryview(array).cast("B"))
            self.size += array.nbytes
        if self.size >= self.settings.shard_size_bytes:
            self.finalize()

    def finalize(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.file, self.stored, self.size = None, self.stored + self.size, 0

    def close(self) -> None:
        self.finalize()

    def snapshot(self) -> dict:
        return {"activations_gb": self.stored / 1e9, "written_gb": self.stored / 1e9, "uploaded_gb": 0.0,
                "forward_waited_s": 0.0, "stage_s": {}}


def warm_up() -> None:
    """What the store path does once per process, done before the clock: its first index table
    makes pyarrow import pandas (1.4 CPU-seconds where bytecode is not cached), which on a
    benchmark of a GB or two would read as a cost per GB."""
    import pyarrow as pa
    from activations.index import parquet_bytes
    parquet_bytes(pa.table({"warm": [0]}))


def template_statistics(templates: list[np.ndarray]) -> list | None:
    """Each template's statistics as the device measures them (``model.statistics``), or None for
    a tree whose store path computes its own (before issue 56)."""
    try:
        from model.statistics import sample_statistics
    except ImportError:
        return None
    measured = sample_statistics(dict(enumerate(templates)))
    return [measured[k] for k in range(len(templates))]


def run(spec: dict, tree: str | None = None) -> dict:
    """One configuration in a process of its own, by this tree or by the ``tree`` checked out."""
    # The same producer either way; the base's modules first on the path (before this tree's
    # editable install), so that the store path is the base's.
    env = os.environ if tree is None else {**os.environ, "PYTHONPATH": tree}
    text = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                          text=True, env=env)
    match = re.search(r"^RESULT (.*)$", text.stdout, re.M)
    if match is None:
        raise SystemExit(f"configuration {spec} failed:\n{text.stdout[-2000:]}{text.stderr[-3000:]}")
    shutil.rmtree(spec["out"], ignore_errors=True)
    return json.loads(match.group(1))


def stage_rates(result: dict, threads: int) -> str:
    """``stage GB/s`` for the busy stages: bytes over busy seconds per thread of the stage."""
    s = result["store"]
    busy = s["stage_s"]
    stages = {"stats": (s["activations_gb"], max(threads, 1)), "encode": (s["activations_gb"], 1),
              "compress": (s["activations_gb"], max(threads, 1)),
              "write": (s["written_gb"], 1), "fsync": (s["written_gb"], 1), "upload": (s["uploaded_gb"], 4),
              "verify": (s["written_gb"], 1)}
    return "  ".join(f"{name} {gb / (busy[name] / n):.2f}" for name, (gb, n) in stages.items()
                     if busy[name] > 1e-3 and gb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total_gb", type=float, default=2.0, help="activations per configuration")
    parser.add_argument("--shard_size_gb", type=float, default=0.25)
    parser.add_argument("--threads", default=",".join(map(str, range(1, min(4, os.cpu_count() or 1) + 1))),
                        help="compression threads to try, e.g. 1,2,4")
    parser.add_argument("--budget_gb", type=float, default=1.0, help="--store_memory_gb of every run")
    parser.add_argument("--gcs_gb", type=float, default=0.5, help="activations of the GCS runs (0: none)")
    parser.add_argument("--work_dir", default=None, help="a directory on the disk to measure (default: tmp)")
    parser.add_argument("--sites", default="hook_resid_post", help="sites of a sample (model.sites), e.g. "
                        "hook_resid_mid,attn.hook_z,hook_mlp_out,hook_resid_post")
    parser.add_argument("--layers", type=int, default=4, help="layers of a sample (each site at each)")
    parser.add_argument("--base", default=BASE, help="a commit whose store path runs beside this tree's "
                        "(none: skipped)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    work = tempfile.mkdtemp(prefix="store_path.", dir=args.work_dir)
    base_tree = None if args.base == "none" else checkout(args.base, work)
    threads = [int(t) for t in args.threads.split(",")]
    durable, streamed = (durable_write_gbps(work, args.total_gb, streamed) for streamed in (False, True))
    print(f"disk under {work}: durable write (8 MiB writes, then fdatasync) {durable:.3f} GB/s (the baseline); "
          f"{streamed:.3f} GB/s with writeback started every 32 MiB as the shard writer does (on a virtual "
          f"disk this one varies with the host's cache); {os.cpu_count()} cores")
    from model.sites import parse_sites
    sites = parse_sites(args.sites)
    print(f"a sample: {len(sites)} site(s) ({', '.join(sites)}) x {args.layers} layers of [{TOKENS}, {HIDDEN}] "
          f"float32 = {len(sites) * args.layers * TOKENS * HIDDEN * 4 / 1e6:.1f} MB")
    base = {"shard_size_gb": args.shard_size_gb, "budget_gb": args.budget_gb, "gcs": False, "prefix": "",
            "sites": sites, "layers": args.layers}
    # Raw runs too take the threads: the base computed its statistics in them.
    runs = [("disk", compress, t, args.total_gb) for compress in (False, True) for t in threads]
    runs += [("memory", compress, t, args.total_gb) for compress in (False, True) for t in threads]
    if args.gcs_gb:
        runs += [("gcs", False, max(threads), args.gcs_gb), ("gcs", True, max(threads), args.gcs_gb)]
    results, base_results = {}, {}
    emulator = None
    print(f"{'to':7} {'mode':10} {'threads':>7} {'tree':6} {'GB/s':>6} {'of disk':>7} {'waited':>6} "
          f"{'CPU s/GB':>8} {'peak-base GB':>12}  stages (GB/s)")
    for where, compress, t, total in runs:
        if where == "gcs" and emulator is None:
            from fixtures.gcs_emulator import GcsEmulator
            emulator = GcsEmulator(None).__enter__()
            emulator.client().create_bucket("bench")
        root = "/dev/shm" if where == "memory" else work
        for tree, into in ((None, results), (base_tree, base_results)) if base_tree else ((None, results),):
            spec = {**base, "out": tempfile.mkdtemp(dir=root), "compress": compress, "threads": max(t, 1),
                    "total_gb": total, "gcs": where == "gcs", "prefix": f"run{len(results) + len(base_results)}"}
            r = into[(where, compress, t)] = run(spec, tree)
            gb = r["store"]["activations_gb"]
            print(f"{where:7} {'compressed' if compress else 'raw':10} {t:>7} {'base' if tree else 'this':6} "
                  f"{gb / r['wall_s']:6.3f} {gb / r['wall_s'] / durable:6.0%} "
                  f"{r['store']['forward_waited_s'] / r['wall_s']:6.0%} {r['store_cpu_s'] / gb:8.2f} "
                  f"{r['peak_gb'] - r['baseline_gb']:12.2f}  {stage_rates(r, t)}")
    if emulator is not None:
        emulator.__exit__()

    raw = results[("disk", False, max(threads))]
    raw_gbps = raw["store"]["activations_gb"] / raw["wall_s"]
    print(f"\nraw to disk: {raw_gbps:.3f} GB/s = {raw_gbps / durable:.0%} of the durable write speed (target >= 50%)")
    if 1 in threads and 2 in threads:
        for where in ("disk", "memory"):
            one, two = (results[(where, True, t)] for t in (1, 2))
            overall = (two["store"]["activations_gb"] / two["wall_s"]) / (one["store"]["activations_gb"]
                                                                         / one["wall_s"])
            print(f"compressed to {where}: 2 threads / 1 thread = {overall:.2f}x overall (with the producer and "
                  "the writing thread on the same cores)")
        alone = {t: compression_alone_gbps(t) for t in (1, 2)}
        ceiling = {t: independent_compression_gbps(t) for t in (1, 2)}
        print(f"compression alone (encode_shard of a 0.25 GB shard in memory, best of 3): 1 thread "
              f"{alone[1]:.2f} GB/s, 2 threads {alone[2]:.2f} GB/s = {alone[2] / alone[1]:.2f}x (target >= 1.7x); "
              f"this machine's own scaling, threads each compressing a buffer of their own: "
              f"{ceiling[1]:.2f} vs {ceiling[2]:.2f} GB/s = {ceiling[2] / ceiling[1]:.2f}x")
    memory_check(args, work, durable)
    floor = plain_write_floor({**base, "compress": False, "threads": 1, "total_gb": args.total_gb},
                              results[("memory", False, 1)])
    cpu_per_gb(results, base_results, args.base, floor)
    rate_table(results, threads)
    if base_tree:
        subprocess.run(["git", "worktree", "remove", "--force", base_tree], cwd=REPO, capture_output=True)
    shutil.rmtree(work, ignore_errors=True)


def checkout(commit: str, work: str) -> str:
    """``commit`` checked out in a temporary git worktree under ``work``; its path."""
    tree = os.path.join(work, "base")
    done = subprocess.run(["git", "worktree", "add", "--detach", tree, commit], cwd=REPO, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"--base {commit}: cannot check it out: {done.stderr.strip()}")
    return tree


def plain_write_floor(spec: dict, first: dict) -> tuple[float, float]:
    """Host CPU-seconds per GB of raw shards to memory by this tree's store path and by a plain
    write loop (``PlainWrites``: the same producer's arrays, each written from its own memory),
    run alternately ``FLOOR_REPEATS`` times in processes of their own (``first``: this tree's run
    of the table): the medians of both."""
    ours, plain = [per_gb(first)], []
    for k in range(FLOOR_REPEATS):
        plain.append(per_gb(run({**spec, "out": tempfile.mkdtemp(dir="/dev/shm"), "plain": True})))
        if k + 1 < FLOOR_REPEATS:
            ours.append(per_gb(run({**spec, "out": tempfile.mkdtemp(dir="/dev/shm")})))
    print(f"raw to memory, CPU s per GB, this tree {' '.join(f'{x:.2f}' for x in ours)}; a plain write loop "
          f"{' '.join(f'{x:.2f}' for x in plain)}")
    return float(np.median(ours)), float(np.median(plain))


def per_gb(result: dict) -> float:
    return result["store_cpu_s"] / result["store"]["activations_gb"]


def cpu_per_gb(results: dict, base_results: dict, base: str, floor: tuple[float, float]) -> None:
    """Host CPU-seconds per stored GB, raw and gzip, of this tree against the base (to memory, one
    compression thread: no disk in the way), raw against the plain write loop, and the targets."""
    line = []
    for mode, compress, target in (("raw", False, 0.4), ("gzip", True, 2.0)):
        figure = f"{mode} {per_gb(results[('memory', compress, 1)]):.2f}"
        if base_results:
            figure += f" (base {base}: {per_gb(base_results[('memory', compress, 1)]):.2f})"
        line.append(f"{figure}, target <= {target}")
    print("host CPU-seconds per stored GB, to memory, 1 thread: " + "; ".join(line))
    ours, plain = floor
    print(f"raw against a plain write loop in this run (medians of {FLOOR_REPEATS}): {ours:.2f} vs {plain:.2f} "
          f"CPU s per GB = {ours / plain:.2f}x (target <= 1.25x)")


def compression_alone_gbps(threads: int) -> float:
    """The compression stage with nothing else running: one shard's members in ``threads``."""
    from activations.shards import encode_shard, shard_dict
    rng = np.random.default_rng(0)
    samples = [{"sample_id": i, "source": "", "text_preview": "",
                "activations": {layer: rng.standard_normal((TOKENS, HIDDEN), dtype=np.float32) * 4
                                for layer in range(4)}} for i in range(34)]  # 0.25 GB
    document = shard_dict(samples, range(4))
    size = sum(e["activation"].nbytes for items in document.values() for e in items)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        encode_shard(document, compress=True, threads=threads)
        best = min(best, time.perf_counter() - start)
    return size / best / 1e9


def independent_compression_gbps(threads: int) -> float:
    """The ceiling: ``threads`` threads each compressing 64 MB of its own, no pool, best of 3."""
    import threading
    from isal import igzip
    data = memoryview(np.random.default_rng(1).standard_normal(2**24, dtype=np.float32) * 4).cast("B")

    def work() -> None:
        for _ in range(3):
            igzip.compress(data, 1, mtime=0)
    best = float("inf")
    for _ in range(3):
        workers = [threading.Thread(target=work) for _ in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return threads * 3 * len(data) / best / 1e9


def memory_check(args, work: str, durable: float) -> None:
    """4x the budget of activations through a compressed store path: its peak stays in budget."""
    spec = {"shard_size_gb": args.budget_gb / 4, "budget_gb": args.budget_gb, "gcs": False, "prefix": "",
            "out": tempfile.mkdtemp(dir=work), "compress": True, "threads": 2, "total_gb": 4 * args.budget_gb,
            "sites": ["hook_resid_post"], "layers": 4}
    r = run(spec)
    over = r["peak_gb"] - r["baseline_gb"]
    print(f"memory: {spec['total_gb']:.1f} GB stored with a {args.budget_gb:.1f} GB budget "
          f"({spec['shard_size_gb']:.2f} GB shards): peak RSS {r['peak_gb']:.2f} GB = process before storing "
          f"{r['baseline_gb']:.2f} + {over:.2f} GB ({'within' if over <= args.budget_gb else 'OVER'} the budget)")


def rate_table(results: dict, threads: list[int]) -> None:
    """Output rates on TPU hosts and the cores the measured store path needs for them: its CPU
    seconds per GB (to memory, so no disk limit; 1 compression thread) times the rate."""
    cpu = {mode: results[("memory", mode == "compressed", 1)]
           for mode in ("raw", "compressed")}
    per_gb = {mode: r["store_cpu_s"] / r["store"]["activations_gb"] for mode, r in cpu.items()}
    print(f"\nstore path CPU per GB of activations (measured above, to memory): raw {per_gb['raw']:.2f} s, "
          f"compressed {per_gb['compressed']:.2f} s. TPU output at {UTILISATION:.0%} of peak bf16, "
          f"FLOP/token = 2 x non-embedding params + 4 x blocks x {CONTEXT} x hidden:")
    print(f"{'model':13} {'TPU':6} {'tokens/s':>9} {'layers':>6} {'dtype':9} {'GB/s':>6} "
          f"{'cores raw':>9} {'cores gzip':>10}")
    for name, hidden, blocks, params in MODELS:
        flops = 2 * params + 4 * blocks * CONTEXT * hidden
        for tpu, chips, peak in TPUS:
            tokens = UTILISATION * chips * peak / flops
            for layers in (4, blocks):
                for dtype, size in (("float32", 4), ("bfloat16", 2)):
                    gbps = tokens * layers * hidden * size / 1e9
                    print(f"{name:13} {tpu:6} {tokens:9.0f} {layers:6} {dtype:9} {gbps:6.2f} "
                          f"{gbps * per_gb['raw']:9.1f} {gbps * per_gb['compressed']:10.1f}")


if __name__ == "__main__":
    main()
