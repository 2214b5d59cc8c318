"""PNG charts of a summary: Δloss per head (and per expert, of an expert removal or forced routing)
as a layer x head (expert) heatmap, and per block as a bar chart (with its 95% interval) for each
other kind, one chart per mode. The heatmap writer is the patching grids' too (``ablation.patching_run``)."""

from __future__ import annotations

import os
import re
from typing import Sequence

import numpy as np
import pandas as pd


LABELS = {"layer": "skipped block", "attn": "attention output", "mlp": "MLP output", "norm": "block's norms"}


def write_charts(summary: pd.DataFrame, folder: str, num_layers: int, num_heads: int,
                 num_experts: int = 0) -> list[str]:
    """The charts the summary has data for, written to ``folder``; returns their paths."""
    os.makedirs(folder, exist_ok=True)
    single = summary[summary["kind"].notna()]
    paths = []
    for (kind, mode), rows in single.groupby(["kind", "mode"], sort=True):
        path = os.path.join(folder, f"delta_loss_{kind}_{re.sub(r'[^A-Za-z0-9=.-]+', '_', mode).strip('_')}.png")
        if kind == "head":
            _head_heatmap(rows, num_layers, num_heads, f"Δloss per head ({mode} ablation)", path)
        elif kind in ("expert", "route"):  # the results' head column holds the expert
            what = "removed expert" if kind == "expert" else "expert all tokens are routed to"
            _head_heatmap(rows, num_layers, num_experts, f"Δloss per {what}", path, "expert")
        elif kind == "steer":
            _bars(rows, f"Δloss per block steered ({mode})", path)
        else:
            _bars(rows, f"Δloss per {LABELS[kind]} ({mode} ablation)", path)
        paths.append(path)
    return paths


def write_heatmap(grid: np.ndarray, path: str, title: str, *, rows: str = "layer", columns: str = "",
                  row_labels: Sequence[str] | None = None, column_labels: Sequence[str] | None = None,
                  scale: str = "", cmap: str = "RdBu_r") -> str:
    """A [rows, columns] grid (NaN: blank) as a heatmap PNG at ``path``, its colours symmetric about
    0 (``cmap``: RdBu_r draws positive values red); its axes named ``rows`` and ``columns``, their
    ticks ``row_labels`` / ``column_labels`` (None: the numbers), its colour bar ``scale``.
    Returns ``path``."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(max(6.0, 0.5 * grid.shape[1] + 2), max(4.0, 0.22 * grid.shape[0] + 1.5)))
    limit = max(float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 0.0, 1e-9)
    image = axes.imshow(grid, cmap=cmap, vmin=-limit, vmax=limit, aspect="auto")
    if column_labels is not None:
        axes.set_xticks(range(len(column_labels)), column_labels, rotation=60, ha="right", fontsize=8)
    if row_labels is not None:
        axes.set_yticks(range(len(row_labels)), row_labels, fontsize=8)
    axes.set_xlabel(columns)
    axes.set_ylabel(rows)
    axes.set_title(title, fontsize=9)
    figure.colorbar(image, ax=axes, label=scale)
    _save(plt, figure, path)
    return path


def _head_heatmap(rows: pd.DataFrame, num_layers: int, num_heads: int, title: str, path: str,
                  columns: str = "head") -> None:
    grid = np.full((num_layers, num_heads), np.nan)  # [layer, head (expert)]; not run: blank
    grid[rows["layer"].astype(int), rows["head"].astype(int)] = rows["delta_loss"]
    write_heatmap(grid, path, title, columns=columns, scale="Δloss (nats)")


def _bars(rows: pd.DataFrame, title: str, path: str) -> None:
    plt = _pyplot()
    rows = rows.sort_values("layer")
    layers = rows["layer"].astype(int).to_numpy()
    delta = rows["delta_loss"].to_numpy()
    errors = np.abs(np.stack([delta - rows["delta_loss_low"].to_numpy(), rows["delta_loss_high"].to_numpy() - delta]))
    figure, axes = plt.subplots(figsize=(max(4, len(layers) * 0.35 + 2), 3.5))
    axes.bar(layers, delta, yerr=errors, capsize=2, color="tab:blue")
    axes.axhline(0, color="black", linewidth=0.8)
    axes.set_xlabel("layer")
    axes.set_ylabel("Δloss (nats), 95% interval")
    axes.set_title(title)
    _save(plt, figure, path)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def _save(plt, figure, path: str) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
