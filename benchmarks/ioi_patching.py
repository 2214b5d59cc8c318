"""Activation patching on the real Qwen2.5-Coder-0.5B-Instruct over indirect-object-identification
pairs (``fixtures.ioi``): the worked example of docs/ablation.md#activation-patching.

For ``--pairs`` pairs of one template (same length, so their grids average position by position),
each stream site's exact patching grid (``ablation.patching.patching_grid``, normalized: 0 the
corrupted run, 1 the clean one) averaged over the pairs, its strongest cells, and attribution
patching's estimate of it (``attribution_grid``, one forward and one backward a pair) against it:
their correlation and the seconds each took, exact patching being the baseline. Writes the mean
grids as heatmaps (``--chart_dir``).

Then the same pairs as a dataset, the way a user runs them: ``pipeline.prepare`` (pairs kept,
one-token answers), a ``runners.tpu_host`` store of the clean and corrupted samples, ``pipeline.index``
and ``runners.ablate --metric logit_diff --method both`` with the clean values read from the store:
its wall time, its mean ``hook_resid_pre`` grid against the library's above (the largest
difference), the [layers, heads] grid's strongest heads (its heatmap written to ``--chart_dir``)
and both grids' agreement.

    python benchmarks/ioi_patching.py [--pairs 4] [--chart_dir docs/images]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

SITES = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--template", type=int, default=0, help="which of fixtures.ioi's templates")
    parser.add_argument("--model_path", help="default: the real model of fixtures.real_models, built if needed")
    parser.add_argument("--chart_dir", default=None, help="write each site's mean grid here as a PNG")
    args = parser.parse_args(argv)
    import jax.numpy as jnp
    from transformers import AutoTokenizer
    from ablation.charts import write_heatmap
    from ablation.patching import agreement, attribution_grid, baselines, pairs_from_rows, patching_grid
    from fixtures.ioi import TEMPLATES, ioi_rows
    from fixtures.real_models import cached_checkpoints
    from model.loading import load_model
    model_path = args.model_path or str(cached_checkpoints("qwen2.5-coder-0.5b-instruct")["float32"])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = load_model(model_path, jnp.float32, with_head=True)
    rows = [row for row in ioi_rows(args.pairs * len(TEMPLATES)) if row["pair"] % len(TEMPLATES) == args.template]
    pairs = pairs_from_rows(rows, tokenizer)[:args.pairs]
    runs = [baselines(model, pair) for pair in pairs]
    print(f"{len(pairs)} IOI pairs of {len(pairs[0].clean)} tokens ({TEMPLATES[args.template]!r}); logit difference "
          f"answer - wrong: clean {np.mean([c for c, _ in runs]):.3f}, corrupted {np.mean([k for _, k in runs]):.3f} "
          f"(mean over pairs)")
    # Positions named by pair 0's tokens, its two names by their roles (the same in every pair).
    names = {pairs[0].answer: "[IO]", pairs[0].wrong: "[S]"}
    labels = [names.get(t, tokenizer.decode([t])) for t in pairs[0].clean]
    grids = {}
    for site in SITES:
        start = time.perf_counter()
        exact = np.mean([patching_grid(model, pair, site, normalized=True) for pair in pairs], axis=0)
        exact_s = time.perf_counter() - start
        start = time.perf_counter()
        estimate = np.mean([attribution_grid(model, pair, site, normalized=True) for pair in pairs], axis=0)
        estimate_s = time.perf_counter() - start
        report = agreement(exact, estimate)
        grids[site] = exact
        strongest = np.argsort(-np.abs(exact).ravel())[:3]
        cells = ", ".join(f"layer {i // exact.shape[1]} at {labels[i % exact.shape[1]]!r}: "
                          f"{exact.ravel()[i]:.2f}" for i in strongest)
        print(f"{site}: exact grid [{exact.shape[0]} layers x {exact.shape[1]} positions] in {exact_s:.1f} s "
              f"(baseline), attribution in {estimate_s:.1f} s ({exact_s / estimate_s:.1f}x faster); correlation "
              f"{report['correlation']:.3f}; strongest cells {cells}")
        if args.chart_dir:
            os.makedirs(args.chart_dir, exist_ok=True)
            path = write_heatmap(exact, os.path.join(args.chart_dir, f"ioi_patching_{site}.png"),
                                 f"IOI, Qwen2.5-Coder-0.5B: patching {site} (mean of {len(pairs)} pairs; 1 = clean)",
                                 column_labels=labels, cmap="RdBu")
            print(f"  chart: {path}")
    dataset_run(rows[:2 * len(pairs)], model_path, grids["hook_resid_pre"], args.chart_dir)
    return 0


def run(*command: str) -> float:
    """Seconds a command took; its output shown where it fails."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", *command], cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{command[0]} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def dataset_run(rows: list[dict], model_path: str, library_grid: np.ndarray, chart_dir: str | None) -> None:
    """The pairs through prepare, a store, and runners.ablate --metric logit_diff (see the docstring)."""
    import pandas as pd
    work = pathlib.Path(tempfile.mkdtemp(prefix="ioi_patching_"))
    (work / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run("pipeline.prepare", "--dataset", str(work / "pairs.jsonl"), "--tokenizer", model_path, "--keep_columns",
        "pair,variant", "--answer_columns", "answer,wrong_answer", "--num_machines", "1", "--output_dir",
        str(work / "streams"))
    stored = run("runners.tpu_host", "--machine_id", "0", "--streams_dir", str(work / "streams"), "--model_path",
                 model_path, "--sites", "hook_resid_pre,attn.hook_z", "--output_dir", str(work / "store"))
    run("pipeline.index", "--activations_dir", str(work / "store"), "--output", str(work / "index.parquet"))
    seconds = run("runners.ablate", "--model_path", model_path, "--stream", str(work / "streams" / "stream_000.jsonl"),
                  "--metric", "logit_diff", "--method", "both", "--patch_from", str(work / "index.parquet"),
                  "--interventions", "patch:*:hook_resid_pre:pos=*", "patch:*:attn.hook_z:heads=*", "--output_dir",
                  str(work / "out"), "--no_tensorboard")
    summary = pd.read_csv(work / "out" / "patching_summary.csv")
    exact = summary[summary["method"] == "exact"]
    resid = exact[exact["grid"] == "patch:*:hook_resid_pre:pos=*"].sort_values(["layer", "position"])
    grid = resid["normalized"].to_numpy().reshape(library_grid.shape)
    heads = exact[exact["grid"] == "patch:*:attn.hook_z:heads=*"].nlargest(3, "normalized")
    agreement = json.loads((work / "out" / "agreement.json").read_text())
    if chart_dir:  # the runner's [layers, heads] heatmap
        shutil.copy(work / "out" / "charts" / "patching_attn.hook_z_by_head_exact.png",
                    os.path.join(chart_dir, "ioi_patching_heads.png"))
    print(f"as a dataset ({len(rows) // 2} pairs: pipeline.prepare -> runners.tpu_host store of hook_resid_pre and "
          f"attn.hook_z in {stored:.1f} s -> runners.ablate --metric logit_diff --method both in {seconds:.1f} s): "
          f"its hook_resid_pre grid from the store differs from the library's by at most "
          f"{np.abs(grid - library_grid).max():.1e}; strongest heads (all positions) "
          + ", ".join(f"{int(r.layer)}.{int(r.head)}: {r.normalized:.2f}" for r in heads.itertuples())
          + "; attribution against exact: " + ", ".join(f"{g} correlation {a['correlation']:.2f}"
                                                       for g, a in agreement.items()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
