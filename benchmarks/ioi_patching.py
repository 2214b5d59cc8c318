"""Activation patching on the real Qwen2.5-Coder-0.5B-Instruct over indirect-object-identification
pairs (``fixtures.ioi``): the worked example of docs/ablation.md#activation-patching.

For ``--pairs`` pairs of one template (same length, so their grids average position by position),
each stream site's exact patching grid (``ablation.patching.patching_grid``, normalized: 0 the
corrupted run, 1 the clean one) averaged over the pairs, its strongest cells, and attribution
patching's estimate of it (``attribution_grid``, one forward and one backward a pair) against it:
their correlation and the seconds each took, exact patching being the baseline. Writes the mean
grids as heatmaps (``--chart_dir``).

    python benchmarks/ioi_patching.py [--pairs 4] [--chart_dir docs/images]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
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
    from ablation.patching import agreement, attribution_grid, baselines, pairs_from_rows, patching_grid, \
        write_grid_chart
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
    for site in SITES:
        start = time.perf_counter()
        exact = np.mean([patching_grid(model, pair, site, normalized=True) for pair in pairs], axis=0)
        exact_s = time.perf_counter() - start
        start = time.perf_counter()
        estimate = np.mean([attribution_grid(model, pair, site, normalized=True) for pair in pairs], axis=0)
        estimate_s = time.perf_counter() - start
        report = agreement(exact, estimate)
        strongest = np.argsort(-np.abs(exact).ravel())[:3]
        cells = ", ".join(f"layer {i // exact.shape[1]} at {labels[i % exact.shape[1]]!r}: "
                          f"{exact.ravel()[i]:.2f}" for i in strongest)
        print(f"{site}: exact grid [{exact.shape[0]} layers x {exact.shape[1]} positions] in {exact_s:.1f} s "
              f"(baseline), attribution in {estimate_s:.1f} s ({exact_s / estimate_s:.1f}x faster); correlation "
              f"{report['correlation']:.3f}; strongest cells {cells}")
        if args.chart_dir:
            os.makedirs(args.chart_dir, exist_ok=True)
            path = write_grid_chart(exact, labels, f"IOI, Qwen2.5-Coder-0.5B: patching {site} (mean of "
                                    f"{len(pairs)} pairs; 1 = clean)", os.path.join(args.chart_dir,
                                                                                     f"ioi_patching_{site}.png"))
            print(f"  chart: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
