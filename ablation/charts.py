"""PNG charts of a summary: Δloss per head (and per expert, of an expert removal or forced routing)
as a layer x head (expert) heatmap, and per block as a bar chart (with its 95% interval) for each
other kind, one chart per mode."""

from __future__ import annotations

import os
import re

import numpy as np
import pandas as pd


LABELS = {"layer": "skipped block", "attn": "attention output", "mlp": "MLP output", "norm": "block's norms"}


def write_charts(summary: pd.DataFrame, folder: str, num_layers: int, num_heads: int,
                 num_experts: int = 0) -> list[str]:
    """The charts the summary has data for, written to ``folder``; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    os.makedirs(folder, exist_ok=True)
    single = summary[summary["kind"].notna()]
    paths = []
    for (kind, mode), rows in single.groupby(["kind", "mode"], sort=True):
        path = os.path.join(folder, f"delta_loss_{kind}_{re.sub(r'[^A-Za-z0-9=.-]+', '_', mode).strip('_')}.png")
        if kind == "head":
            _heatmap(plt, rows, num_layers, num_heads, f"Δloss per head ({mode} ablation)", path)
        elif kind in ("expert", "route"):  # the results' head column holds the expert
            what = "removed expert" if kind == "expert" else "expert all tokens are routed to"
            _heatmap(plt, rows, num_layers, num_experts, f"Δloss per {what}", path, "expert")
        elif kind == "steer":
            _bars(plt, rows, f"Δloss per block steered ({mode})", path)
        else:
            _bars(plt, rows, f"Δloss per {LABELS[kind]} ({mode} ablation)", path)
        paths.append(path)
    return paths


def _heatmap(plt, rows: pd.DataFrame, num_layers: int, num_heads: int, title: str, path: str,
             columns: str = "head") -> None:
    grid = np.full((num_layers, num_heads), np.nan)  # [layer, head (expert)]; not run: blank
    grid[rows["layer"].astype(int), rows["head"].astype(int)] = rows["delta_loss"]
    fig, ax = plt.subplots(figsize=(max(4, num_heads * 0.45 + 2), max(3, num_layers * 0.35 + 1.5)))
    limit = np.nanmax(np.abs(grid)) or 1.0
    image = ax.imshow(grid, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xlabel(columns)
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="Δloss (nats)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bars(plt, rows: pd.DataFrame, title: str, path: str) -> None:
    rows = rows.sort_values("layer")
    layers = rows["layer"].astype(int).to_numpy()
    delta = rows["delta_loss"].to_numpy()
    errors = np.abs(np.stack([delta - rows["delta_loss_low"].to_numpy(), rows["delta_loss_high"].to_numpy() - delta]))
    fig, ax = plt.subplots(figsize=(max(4, len(layers) * 0.35 + 2), 3.5))
    ax.bar(layers, delta, yerr=errors, capsize=2, color="tab:blue")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("layer")
    ax.set_ylabel("Δloss (nats), 95% interval")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
