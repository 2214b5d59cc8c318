"""What a probe run writes beside its directions: the results table (``results.csv``: one row
per (site, layer)) and the chart of the held-out metric by layer, a line per site, the
diff-in-means baselines dashed (the statistics') and dotted (the training rows') beside it,
the majority class's accuracy as a grey line (``by_layer.png``)."""

from __future__ import annotations

import os

import pandas as pd

RESULTS, CHART = "results.csv", "by_layer.png"


def write_results(rows: list[dict], folder: str) -> pd.DataFrame:
    table = pd.DataFrame(rows).sort_values(["site", "layer"], kind="stable").reset_index(drop=True)
    table.to_csv(os.path.join(folder, RESULTS), index=False, float_format="%.6f")
    return table


def write_chart(table: pd.DataFrame, folder: str, label: str) -> str:
    """The held-out metric by layer; returns the chart's path."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    figure, axes = plt.subplots(figsize=(7, 4))
    for site, rows in table.groupby("site", sort=True):
        line, = axes.plot(rows["layer"], rows["held_out"], marker="o", label=f"{site}: probe")
        if rows["baseline"].notna().any():
            axes.plot(rows["layer"], rows["baseline"], linestyle="--", color=line.get_color(),
                      label=f"{site}: diff-in-means (statistics)")
        if rows["baseline_rows"].notna().any():
            axes.plot(rows["layer"], rows["baseline_rows"], linestyle=":", color=line.get_color(),
                      label=f"{site}: diff-in-means (training rows)")
    if table["majority"].notna().any():  # the same for every (site, layer): the split's
        axes.axhline(table["majority"].iloc[0], color="grey", linewidth=1, label="majority class")
    metric = table["metric"].iloc[0]
    axes.set(xlabel="layer", ylabel=f"held-out {metric}", title=f"Probing {label!r} by layer")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.legend(fontsize="small")
    axes.grid(alpha=0.3)
    path = os.path.join(folder, CHART)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def summary(table: pd.DataFrame, label: str) -> str:
    """One line: how many probes, and the best held-out one with its baseline."""
    line = f"{len(table)} probes of {label!r} ({table['task'].iloc[0]})"
    scored = table.dropna(subset=["held_out"])
    if scored.empty:
        return line
    best = scored.loc[scored["held_out"].idxmax()]
    baselines = [f"diff-in-means {name} {best[column]:.4f}" for column, name in
                 (("baseline", "statistics"), ("baseline_rows", "training rows")) if pd.notna(best[column])]
    if pd.notna(best["majority"]):
        baselines.append(f"majority class {best['majority']:.4f}")
    baseline = f" ({', '.join(baselines)})" if baselines else ""
    return (f"{line}; best held-out {best['metric']} {best['held_out']:.4f} at {best['site']} layer "
            f"{best['layer']}{baseline}")
