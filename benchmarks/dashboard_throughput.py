"""Feature dashboards' throughput and memory per worker, at 1x and ``--scale`` times the store.

A synthetic 2-machine store (``fixtures.stored_activations``: hidden 896 as Qwen2.5-0.5B's, float16,
64..512 tokens a sample) and a random SAELens SAE of ``--expansion`` x 896 features (biases set so
that about a tenth fire), a tiny Qwen2 checkpoint of width 896 for the logit effects. For each
scale, ``runners.dashboard`` on the local FnApiRunner with 2 workers (``multi_processing``), in a
process of its own: features x tokens encoded per second per worker (each token is encoded twice:
the top pass and the spread pass; the contexts' samples once more), and the peak RSS (``VmHWM``,
polled from outside) of each worker, the 8x run's against the 1x run's (target: within 1.2x).
The baseline, in the same run: the same store's tokens read by the token loader and encoded and
summarized (``features.top_activations``) in one plain process, features x tokens per second; the
job's rate between the two scales (its fixed start left out) is printed against it.

    python benchmarks/dashboard_throughput.py [--scale 8] [--samples_per_machine 12] [--expansion 4]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks.prepare_throughput import measured_run  # noqa: E402
from fixtures.stored_activations import StoredSpec, write_stored  # noqa: E402

HIDDEN, LAYER = 896, 12
TARGET_RATIO = 1.2


def make_sae(path: str, features: int) -> None:
    """A random standard SAE of ``features`` at layer 12, about a tenth of its features firing a token."""
    import sae_lens
    import torch
    from sae_lens.saes.sae import SAEMetadata
    sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=HIDDEN, d_sae=features, metadata=SAEMetadata(
        hook_name=f"blocks.{LAYER}.hook_resid_post")))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        sae.W_enc.copy_(torch.randn(sae.W_enc.shape, generator=generator) / HIDDEN ** 0.5)
        sae.W_dec.copy_(torch.randn(sae.W_dec.shape, generator=generator) / HIDDEN ** 0.5)
        sae.b_enc.fill_(-1.3)  # rows of unit variance: each pre-activation ~N(0, 1), P(> 1.3) ~ 0.1
        sae.b_dec.zero_()
    sae.save_model(path)


def dashboards(index: str, sae: str, model: str, out: str) -> dict:
    """One dashboard job with 2 local workers, in a process of its own: seconds and peak RSS."""
    command = [sys.executable, "-m", "runners.dashboard", "--index", index, "--features", sae, "--model_path", model,
               "--output_dir", out, "--most_active", "64", "--direct_num_workers", "2",
               "--direct_running_mode", "multi_processing"]
    run = measured_run(command, "the dashboard job", REPO)
    return {**run, "tokens": json.loads((pathlib.Path(out) / "dashboard.json").read_text())["tokens_read"]}


def plain(index: str, sae: str) -> float:
    """Features x tokens per second of the plain loop: the loader's batches encoded and summarized."""
    from activations.token_loader import LoaderConfig, TokenLoader
    from features.dashboard import folded
    from features.encoders import load_features
    from features.top_activations import TopActivations, block_top, merged
    features = folded(load_features(sae, LAYER))
    loader = TokenLoader(LoaderConfig(index=index, layers=(LAYER,), seed=None, batch_tokens=1024, read_threads=1))
    summary, tokens = TopActivations.empty(features.size, 20), 0
    first = True
    for batch in loader:
        if len(batch) < 1024:  # one compiled shape, as the job pads
            rows = np.zeros((1024, HIDDEN), np.float32)
            rows[:len(batch)] = batch.activations[LAYER]
        else:
            rows = batch.activations[LAYER]
        if first:  # compile outside the timing
            block_top(features.encode(rows), batch.sample_ids, batch.positions, 20)
            start, first = time.perf_counter(), False
        summary = merged(summary, block_top(features.encode(rows), batch.sample_ids, batch.positions, 20))
        tokens += len(batch)
    return features.size * tokens / (time.perf_counter() - start)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=8)
    parser.add_argument("--samples_per_machine", type=int, default=12)
    parser.add_argument("--expansion", type=int, default=4)
    args = parser.parse_args(argv)
    from fixtures.qwen_tokenizer import cached_tokenizer_dir
    from fixtures.tiny_models import write_checkpoint
    import shutil
    with tempfile.TemporaryDirectory() as root:
        model = write_checkpoint(f"{root}/model", "qwen2", hidden_size=HIDDEN, num_attention_heads=14,
                                 num_key_value_heads=2, num_hidden_layers=1, intermediate_size=256, norm_std=0.2)
        for name in cached_tokenizer_dir().iterdir():
            shutil.copy(name, model)
        sae = f"{root}/sae"
        make_sae(sae, args.expansion * HIDDEN)
        features = args.expansion * HIDDEN
        runs = {}
        for scale in (1, args.scale):
            spec = StoredSpec(num_machines=2, samples_per_machine=args.samples_per_machine * scale, lengths=(64, 512),
                              hidden_size=HIDDEN, layers=(LAYER,), dtype="float16", shard_size_bytes=32 << 20,
                              vocab_size=5000)
            index = write_stored(f"{root}/store{scale}", spec)
            runs[scale] = run = dashboards(index, sae, model, f"{root}/out{scale}")
            rate = features * run["tokens"] * 2 / run["seconds"] / 2
            workers = ", ".join(f"{w / 2**20:.0f}" for w in run["workers"])
            print(f"{scale}x: {run['tokens']} tokens x {features} features in {run['seconds']:.1f} s: "
                  f"{rate / 1e6:.1f} M features x tokens/s per worker (2 passes); peak RSS per worker "
                  f"{workers} MiB, runner {run['runner'] / 2**20:.0f} MiB")
            if scale == 1:
                baseline = plain(index, sae)
                print(f"baseline, the plain loop (loader + encode + top-k, one process): {baseline / 1e6:.1f} M "
                      "features x tokens/s")
        small, large = runs[1], runs[args.scale]
        marginal = features * (large["tokens"] - small["tokens"]) * 2 / (large["seconds"] - small["seconds"]) / 2
        print(f"from 1x to {args.scale}x, past the job's fixed start (Beam, workers' compiles, the logit effects): "
              f"{marginal / 1e6:.1f} M features x tokens/s per worker (2 passes), against the baseline's "
              f"{baseline / 1e6:.1f} M (1 pass, one process on every core)")
        ratio = max(runs[args.scale]["workers"]) / max(runs[1]["workers"])
        print(f"peak RSS per worker, {args.scale}x over 1x: {ratio:.2f} (target <= {TARGET_RATIO}): "
              f"{'met' if ratio <= TARGET_RATIO else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
