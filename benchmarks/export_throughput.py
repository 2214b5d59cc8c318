"""The flat export's throughput and memory, and how fast its layout reads back, in one run.

For a synthetic 2-machine store (``fixtures.stored_activations``: float16, hidden 256, 2 layers,
64..512 tokens a sample) at 1x and ``--scale`` times the samples:
  * ``pipeline.export --format flat`` on the local FnApiRunner with 2 workers
    (``multi_processing``), in a process of its own: rows/s in all and per worker, and the peak
    RSS (``VmHWM``, polled from outside) of the runner process and of each worker; at the larger
    scale also with ``--shuffle_passes 2`` (its output checked identical);
  * the export read back by ``FlatExport.batches`` (every column, batches of 4096 rows, shard by
    shard, a thread reading ahead) against ``np.fromfile`` of the same files one after the other:
    GB/s of each (the best of 5 rounds, alternated) and the ratio, from the disk (each file's
    pages dropped from the page cache before each round: ``posix_fadvise``) and from the page
    cache (a read of memory, about 1 GB a round: the ratio is the reader's own overhead).

    python benchmarks/export_throughput.py [--scale 8] [--samples_per_machine 32]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from activations.flat_layout import FlatExport  # noqa: E402
from benchmarks.prepare_throughput import measured_run  # noqa: E402
from fixtures.stored_activations import StoredSpec, write_stored  # noqa: E402


def export(index: str, out: str, passes: str = "1") -> dict:
    """One export with 2 local workers, in a process of its own: seconds and peak RSS."""
    command = [sys.executable, "-m", "pipeline.export", "--format", "flat", "--index", index, "--layers", "0,1",
               "--seed", "0", "--shard_mb", "16", "--output_dir", out, "--shuffle_passes", passes,
               "--direct_num_workers", "2", "--direct_running_mode", "multi_processing"]
    return measured_run(command, "the export", REPO)


def files(root: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(pathlib.Path(root).rglob("*")) if p.is_file()}


def evicted(paths: list[str]) -> None:
    """The files' pages dropped from the page cache (clean pages: no root needed), so that the
    next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_rates(out: str, cold: bool, rounds: int = 5) -> tuple[float, float, int]:
    """(GB/s of FlatExport.batches, GB/s of np.fromfile of the same files, bytes): the best of
    ``rounds`` rounds of each, alternated; ``cold``: each read from the disk (the files evicted
    from the page cache first), else from the page cache, the export read over and over for about
    1 GB a round (a read of memory lasts milliseconds: timer and scheduler noise would decide)."""
    flat = FlatExport(out)
    paths = [flat.path(s, c) for s in range(len(flat.shards)) for c in flat.columns]
    size = sum(os.path.getsize(p) for p in paths)
    repeats = 1 if cold else max(1, int(1e9 // size))

    def loader() -> None:
        for _ in range(repeats):
            assert sum(len(next(iter(batch.values()))) for batch in flat.batches(4096)) == flat.rows

    def plain() -> None:
        for _ in range(repeats):
            for p in paths:
                np.fromfile(p, np.uint8)

    best = {loader: float("inf"), plain: float("inf")}
    for _ in range(rounds):
        for read in best:
            if cold:
                evicted(paths)
            start = time.perf_counter()
            read()
            best[read] = min(best[read], time.perf_counter() - start)
    return size * repeats / best[loader] / 1e9, size * repeats / best[plain] / 1e9, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples_per_machine", type=int, default=32)
    parser.add_argument("--scale", type=int, default=8)
    args = parser.parse_args()
    for scale in (1, args.scale):
        with tempfile.TemporaryDirectory() as root:
            spec = StoredSpec(num_machines=2, samples_per_machine=args.samples_per_machine * scale, lengths=(64, 512),
                              hidden_size=256, layers=(0, 1), dtype="float16", shard_size_bytes=4 << 20)
            index = write_stored(root, spec)
            out = os.path.join(root, "export")
            run = export(index, out)
            rows = FlatExport(out).rows
            workers = ", ".join(f"{w / 2**20:.0f}" for w in run["workers"])
            for cold in (True, False):
                loader, plain, size = read_rates(out, cold)
                print(f"{scale}x: flat read from {'the disk' if cold else 'the page cache'}: {loader:.2f} GB/s vs "
                      f"np.fromfile {plain:.2f} GB/s ({loader / plain:.2f}x)")
            print(f"{scale}x: {rows} rows ({size / 1e6:.0f} MB of float32 arrays) in {run['seconds']:.1f} s: "
                  f"{rows / run['seconds']:.0f} rows/s, {rows / run['seconds'] / 2:.0f} per worker; peak RSS runner "
                  f"{run['runner'] / 2**20:.0f} MiB, workers {workers} MiB")
            if scale > 1:
                two = export(index, os.path.join(root, "two_passes"), passes="2")
                same = files(out) == files(os.path.join(root, "two_passes"))
                print(f"{scale}x, two shuffle passes: {rows / two['seconds']:.0f} rows/s, "
                      f"{rows / two['seconds'] / 2:.0f} per worker; peak RSS runner {two['runner'] / 2**20:.0f} MiB, "
                      f"workers {', '.join(f'{w / 2**20:.0f}' for w in two['workers'])} MiB; output "
                      f"{'identical' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
