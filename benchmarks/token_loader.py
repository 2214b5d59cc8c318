"""The shuffled token loader vs reading whole shards in order, and the SAELens export.

Stored activations of the Qwen2.5-0.5B shape (hidden 896, float32, one layer, 1..2048 tokens a
sample; random values, which compress like real ones: about 8%) are written as the runner writes
them (ShardWriter: isal gzip members, per-shard indexes), then read four ways, each timed from
start to its last batch of 4096 tokens:
  (a) naive: every shard in order, ``pickle.load(gzip.open(path))``, arrays concatenated into
      batches; no shuffling (the baseline);
  (b) the token loader shuffled across all shards, with a buffer of --buffer_gb (<= 1 GB);
  (c) the token loader unshuffled (stored order);
and (d) ``pipeline.export --format saelens`` of the same tokens (globally shuffled, context 128: the
Beam export job on the local runner, one worker, its start included).
Target: (b) >= 50% of (a)'s tokens/s. The files sit in the page cache after writing: the
figures are the reading side's CPU cost, not the disk's.

    python benchmarks/token_loader.py [--gb 1.5] [--buffer_gb 1.0] [--shard_gb 0.25]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import os
import pickle
import shutil
import tempfile
import time

import numpy as np

from activations.token_loader import LoaderConfig, TokenLoader, row_bytes
from fixtures.stored_activations import StoredSpec, write_stored

HIDDEN, LAYER, BATCH = 896, 12, 4096


def naive_epoch(shards: list[str]) -> int:
    """Tokens of whole shards read in order and cut into batches, as a user without the loader would."""
    tokens, pending, held = 0, [], 0
    for path in shards:
        with gzip.open(path) as f:
            document = pickle.load(f)
        for entry in document[LAYER]:
            pending.append(entry["activation"])
            held += len(entry["activation"])
            while held >= BATCH:
                joined = np.concatenate(pending)
                tokens += BATCH
                pending, held = [joined[BATCH:]], held - BATCH
    return tokens + held


def timed(label: str, fn, baseline: float | None = None) -> float:
    start = time.perf_counter()
    tokens = fn()
    seconds = time.perf_counter() - start
    rate = tokens / seconds
    versus = f"  {rate / baseline:.0%} of (a)" if baseline else ""
    print(f"{label:48s} {tokens:>10,} tokens {seconds:6.1f} s {rate:>10,.0f} tokens/s "
          f"{rate * HIDDEN * 4 / 1e6:7.1f} MB/s{versus}")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.5, help="float32 activations to store")
    parser.add_argument("--buffer_gb", type=float, default=1.0, help="the loader's shuffle buffer")
    parser.add_argument("--shard_gb", type=float, default=0.25)
    parser.add_argument("--threads", type=int, default=4, help="the loader's reader threads")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="token_loader.")
    try:
        per_sample = 1024.5 * HIDDEN * 4  # mean of 1..2048 tokens
        spec = StoredSpec(num_machines=2, samples_per_machine=int(args.gb * 1e9 / per_sample / 2),
                          lengths=(1, 2048), hidden_size=HIDDEN, layers=(LAYER,),
                          shard_size_bytes=int(args.shard_gb * 1e9))
        start = time.perf_counter()
        index = write_stored(work, spec)
        shards = sorted(glob.glob(os.path.join(work, "activations", "machine_*", "shard_*.pkl.gz")))
        size = sum(os.path.getsize(p) for p in shards)
        print(f"stored {size / 1e9:.2f} GB in {len(shards)} shards ({time.perf_counter() - start:.0f} s), "
              f"hidden {HIDDEN}, float32, batches of {BATCH} tokens")
        buffer_tokens = int(args.buffer_gb * 1e9 // row_bytes([HIDDEN], with_token_ids=False))
        config = LoaderConfig(index=index, layers=(LAYER,), batch_tokens=BATCH, buffer_tokens=buffer_tokens,
                              seed=0, read_threads=args.threads)
        shuffled = TokenLoader(config)
        unshuffled = TokenLoader(LoaderConfig(**{**config.__dict__, "seed": None}))
        naive = timed("(a) naive: whole shards in order (pickle + gzip)", lambda: naive_epoch(shards))
        timed(f"(b) token loader, shuffled, {args.buffer_gb:g} GB buffer",
              lambda: sum(len(b) for b in shuffled), naive)
        timed("(c) token loader, stored order", lambda: sum(len(b) for b in unshuffled), naive)
        print(f"    (b) held at most {shuffled.stats.peak_buffered_tokens:,} tokens "
              f"({shuffled.stats.peak_buffered_tokens * row_bytes([HIDDEN], with_token_ids=False) / 1e9:.2f} GB); "
              f"{shuffled.stats.blocks_read} reads of "
              f"{shuffled.stats.bytes_read / shuffled.stats.blocks_read / 1e6:.1f} MB")
        from pipeline.export import main as export
        out = os.path.join(work, "saelens")
        timed("(d) pipeline.export --format saelens (globally shuffled)",
              lambda: export(["--format", "saelens", "--index", index, "--layers", str(LAYER), "--output_dir", out])
              or shuffled.total_tokens)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
