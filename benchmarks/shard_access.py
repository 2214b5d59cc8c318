"""Random access into a >= 1 GB pickle.gz shard, and the shard writer's speed.

1. The shard writer (``encode_shard``: gzip members compressed with isal level 1 in 4 threads) vs
   the standard ``gzip`` module at its default level on the same shard. (Which compressor, level
   and stored dtype: ``benchmarks/shard_compression.py``, on real activations.)
2. A generated shard of >= 1 GB (float32, 1..4000 tokens, hidden 896): time to read one random
   activation through the index vs loading the whole shard, on local disk and through a local
   GCS API server (gcp-storage-emulator).

    python benchmarks/shard_access.py [--shard_gb 1.0]
"""

from __future__ import annotations

import argparse
import gzip
import os
import pickle
import random
import statistics
import tempfile
import time

import numpy as np

from activations.index import arrays_index
from activations.reader import load_shard, read_activation
from activations.shards import encode_shard, shard_dict
from common.files import read_range
from fixtures.gcs_emulator import GcsEmulator


def generated_shard(gb: float, hidden: int = 896) -> tuple[dict, int]:
    rng = np.random.default_rng(0)
    samples, total, i = [], 0, 0
    while total < gb * 1e9:
        n = int(rng.integers(1, 4001))
        acts = {layer: rng.standard_normal((n, hidden), dtype=np.float32) for layer in (6, 12)}
        samples.append({"sample_id": i, "source": f"s{i}", "text_preview": "x", "num_tokens": n,
                        "activations": acts})
        total += 2 * n * hidden * 4
        i += 1
    return shard_dict(samples, (6, 12)), total


def timed(fn, repeats: int = 1) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard_gb", type=float, default=1.0)
    args = parser.parse_args()

    shard, raw = generated_shard(args.shard_gb)
    start = time.perf_counter()
    result = encode_shard(shard, compress=True)
    encoded, locations = result.data, result.locations
    del result
    writer_s = time.perf_counter() - start
    payload = pickle.dumps(shard, protocol=3)
    start = time.perf_counter()
    gzip.compress(payload[: 256 * 2**20])  # the standard module on the first 256 MiB
    standard_mbs = 256 * 2**20 / (time.perf_counter() - start) / 1e6
    del payload
    writer_mbs = raw / writer_s / 1e6
    print(f"shard writer (encode_shard, isal level 1, 4 threads): {writer_mbs:.1f} MB/s vs gzip module "
          f"default level {standard_mbs:.1f} MB/s = x{writer_mbs / standard_mbs:.1f}; "
          f"{len(encoded) / 1e9:.2f} GB file for {raw / 1e9:.2f} GB of arrays")

    work = tempfile.mkdtemp(prefix="shard_access.")
    path = os.path.join(work, "shard_0001.pkl.gz")
    with open(path, "wb") as f:
        f.write(encoded)
    del encoded
    rows = arrays_index(locations, path).to_pandas().to_dict("records")
    picks = random.Random(0).sample(rows, 20)
    one_local = timed(lambda: [read_activation(r) for r in picks]) / len(picks)
    whole_local = timed(lambda: pickle.load(gzip.open(path)))
    print(f"local: one random activation via the index {one_local * 1e3:.1f} ms; "
          f"whole shard (pickle.load(gzip.open)) {whole_local:.1f} s")

    # In-memory storage: the emulator answers a ranged GET by slicing the whole object, which
    # from disk would mean reading the full 1 GB file per request (a cost no real GCS has).
    with GcsEmulator(None) as emulator:
        client = emulator.client()
        client.create_bucket("bench")
        blob = client.bucket("bench").blob("shard_0001.pkl.gz")
        blob.chunk_size = 64 * 2**20
        blob.upload_from_filename(path, timeout=600)
        gs = "gs://bench/shard_0001.pkl.gz"
        one_gcs = timed(lambda: [read_activation({**r, "shard_path": gs}) for r in picks]) / len(picks)
        request_floor = timed(lambda: [read_range(gs, 0, 1) for _ in picks]) / len(picks)
        whole_gcs = timed(lambda: load_shard(gs))
        print(f"GCS emulator: one random activation via the index {one_gcs * 1e3:.1f} ms "
              f"(a 1-byte ranged GET alone: {request_floor * 1e3:.1f} ms); "
              f"whole shard download + load {whole_gcs:.1f} s")


if __name__ == "__main__":
    main()
