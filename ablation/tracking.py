"""Experiment tracking: TensorBoard event files (tensorboardX, no TensorFlow) and, on request,
Weights & Biases in offline mode. Both are written from the summary once the grid is done, so a
re-run writes them anew rather than twice.

TensorBoard: for each kind and mode a scalar series over blocks (``mlp_zero/delta_loss`` at step
L), heads as one series per block over heads (``head_zero/L3/delta_loss`` at step H), the same
for delta_accuracy and kl; the summary as a text table; the charts as images.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any, Sequence

import pandas as pd


METRICS = ("delta_loss", "delta_accuracy", "kl")


def scalar_series(summary: pd.DataFrame) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every one-atom intervention's metrics."""
    out = []
    for _, row in summary[summary["kind"].notna()].iterrows():
        kind, mode, layer = row["kind"], row["mode"], int(row["layer"])
        for metric in METRICS:
            if kind == "head":
                out.append((f"head_{mode}/L{layer}/{metric}", int(row["head"]), float(row[metric])))
            else:
                out.append((f"{kind}_{mode}/{metric}", layer, float(row[metric])))
    return out


def write_tensorboard(folder: str, summary: pd.DataFrame, charts: Sequence[str],
                      series: Sequence[tuple[str, int, float]] | None = None) -> None:
    """The summary's scalars (``series``; default an ablation summary's, ``scalar_series``), the
    summary as a text table and the charts as images, in a fresh set of event files."""
    from tensorboardX import SummaryWriter
    os.makedirs(folder, exist_ok=True)
    for old in glob.glob(os.path.join(folder, "events.out.tfevents.*")):
        os.remove(old)
    with SummaryWriter(folder) as writer:
        for tag, step, value in scalar_series(summary) if series is None else series:
            writer.add_scalar(tag, value, step)
        # Markdown renders a 4-space indented block as preformatted text.
        writer.add_text("summary", "    " + summary.to_string(index=False).replace("\n", "\n    "))
        for path in charts:
            import matplotlib.image
            image = matplotlib.image.imread(path)  # [H, W, C] floats in 0..1
            writer.add_image(os.path.splitext(os.path.basename(path))[0], image, dataformats="HWC")


def write_wandb(folder: str, project: str, config: Any, summary: pd.DataFrame, charts: Sequence[str]) -> str:
    """An offline W&B run under ``folder`` (``wandb sync`` uploads it); returns its directory."""
    import wandb  # AblationConfig.validate made sure it is there
    run = wandb.init(project=project, dir=folder, mode="offline", config=dataclasses.asdict(config),
                     settings=wandb.Settings(silent=True))
    try:
        run.log({"summary": wandb.Table(dataframe=summary.astype(object).where(summary.notna(), None))})
        for tag, step, value in scalar_series(summary):
            run.summary[f"{tag}@{step}"] = value
        run.log({os.path.splitext(os.path.basename(p))[0]: wandb.Image(p) for p in charts})
        return os.path.dirname(run.dir)  # the run's folder (run.dir is its files/)
    finally:
        run.finish()
