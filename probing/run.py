"""A probe run: for each (site, layer), a linear probe fit on the training groups' rows and scored
on the held-out ones, two nearest-class-mean baselines scored beside it (the stored statistics'
means, and the training rows' own), and the directions, probes, results and chart written to a folder."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os

import numpy as np
import pandas as pd

from activations.index import store_model
from activations.selection import selection_flag
from activations.token_plan import check_fixed_width
from common.cli import UserError, flag, int_list
from common.extras import require
from common.files import write_bytes
from model.sites import DEFAULT_SITES, SITES, ArrayKey, array_keys, hook_name, integers_held, key_parts, parse_sites
from activations.directions import write_directions
from probing.directions import label_means
from probing.fit import (TASKS, fit_probe, held_out, majority_accuracy, nearest_mean_accuracy, task_of,
                         training_means)
from probing.report import write_chart, write_results
from probing.rows import ProbeRows, read_rows

log = logging.getLogger("runners.probe")
DIRECTIONS, PROBES, SPLIT = "directions.npz", "probes.npz", "split.parquet"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    index: str = flag(help="merged index.parquet (local or gs://), with the label among its kept columns")
    label: str = flag(help="the index column to probe for (a kept column: pipeline.prepare --keep_columns)")
    layers: tuple[int, ...] = flag(help="stored layers to probe (e.g. 0,6,12,18)", parse=int_list)
    sites: tuple[str, ...] = flag(DEFAULT_SITES, "stored sites to probe at each layer (docs/sites.md)",
                                  parse=parse_sites)
    tokens: str | None = flag(None, "the rows: a token selection (last, mean:assistant, assistant,-special; "
                              "docs/datasets.md#token-selection), each row labelled by its sample; default every "
                              "stored token", parse=selection_flag)
    task: str = flag("auto", "classification (logistic regression, accuracy) | regression (ridge, R^2) | auto "
                     "(regression for a float label)", choices=TASKS)
    group_column: str = flag("sample_id", "the split's unit: an index column whose rows are held out together "
                             "(a conversation's id for several samples of one conversation)")
    test_fraction: float = flag(0.2, "share of the groups held out")
    regularization: float = flag(1.0, "L2 strength: 1/C of the logistic regression, ridge's alpha")
    max_rows: int = flag(200_000, "read at most about this many rows (a draw by token): memory is rows x "
                                "the widths x 4 bytes")
    seed: int = flag(0, "the split's and the draw's seed")
    output_dir: str = flag(help="local folder for results.csv, by_layer.png, directions.npz, probes.npz, "
                           "split.parquet")
    chart: bool = flag(True, "draw by_layer.png (needs the charts extra)")

    @property
    def keys(self) -> list[ArrayKey]:
        return array_keys(parse_sites(self.sites), self.layers)

    def validate(self) -> None:
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise UserError(f"--layers must name distinct layers, got {list(self.layers)}")
        if not 0 < self.test_fraction < 1:
            raise UserError(f"--test_fraction must be between 0 and 1, got {self.test_fraction}")
        if self.regularization <= 0:
            raise UserError(f"--regularization must be positive, got {self.regularization}")
        if self.max_rows < 2:
            raise UserError(f"--max_rows must be at least 2, got {self.max_rows}")
        ids = [site for site in self.sites if SITES[site].integer]
        if ids:
            raise UserError(f"--sites {ids[0]}: it holds {integers_held(ids[0])}, not activations to probe")
        for site in self.sites:  # a pattern's rows: no probe of one width fits them
            check_fixed_width(f"--sites {site}", site)
        if "://" in self.output_dir:
            raise UserError(f"--output_dir {self.output_dir!r}: a local folder (copy it to a bucket after)")
        if self.seed < 0:
            raise UserError(f"--seed must be >= 0, got {self.seed}")
        require("sklearn.linear_model", "probes", "runners.probe")  # before reading anything
        if self.chart:
            require("matplotlib", "charts", "--chart (turn it off with --no_chart)")


def run_probes(config: ProbeConfig) -> pd.DataFrame:
    """Fits, scores and writes every (site, layer)'s probe; returns the results table."""
    config.validate()
    keys = config.keys
    rows = read_rows(config.index, keys, config.label, config.group_column, config.tokens, config.max_rows,
                     config.seed)
    task = task_of(rows.label_type, config.task)
    values = sorted(set(rows.labels.tolist()))
    if len(values) < 2:
        raise UserError(f"--label {config.label}: every row read has the value {values[0]!r}: nothing to probe for")
    test = held_out(rows.groups, config.test_fraction, config.seed)
    if task == "classification" and len(set(rows.labels[~test].tolist())) < 2:
        raise UserError(f"the training rows hold one value of --label {config.label}: choose another --group_column "
                        f"({config.group_column}) or --test_fraction")
    log.info("%d rows (%d train, %d held out; %d left out: null label), %s, classes %s", len(test),
             (~test).sum(), test.sum(), rows.null_labels, task, values if task == "classification" else "-")
    means = statistics_means(config, keys, values) if task == "classification" else None
    os.makedirs(config.output_dir, exist_ok=True)
    results, directions, probes = [], {}, {}
    y_train, y_test = rows.labels[~test], rows.labels[test]
    majority = majority_accuracy(y_train, y_test) if task == "classification" else np.nan
    for key in keys:
        # This (site, layer)'s rows on each side, in float64 once: the probe, its scores and the baselines read them.
        x_train, x_test = (rows.features[key][side].astype(np.float64) for side in (~test, test))
        probe = fit_probe(x_train, y_train, task, config.regularization)
        site, layer = key_parts(key)
        baseline = baseline_rows = np.nan
        if means is not None:
            baseline = nearest_mean_accuracy(x_test, y_test, means[key])
        if task == "classification":  # the same rule, the means of the training rows read (the probe's own)
            baseline_rows = nearest_mean_accuracy(x_test, y_test, training_means(x_train, y_train))
        results.append({"site": site, "layer": layer, "task": task,
                        "metric": "accuracy" if task == "classification" else "r2",
                        "held_out": probe.score(x_test, y_test), "train": probe.score(x_train, y_train),
                        "baseline": baseline, "baseline_rows": baseline_rows, "majority": majority,
                        "converged": probe.converged,
                        "train_rows": int((~test).sum()), "held_out_rows": int(test.sum()),
                        "null_label_rows": rows.null_labels,
                        "classes": len(values) if task == "classification" else None})
        probes[f"{hook_name(site, layer)}/coef"], probes[f"{hook_name(site, layer)}/intercept"] = (probe.coef,
                                                                                          probe.intercept)
        norm = np.linalg.norm(probe.coef[0])
        if probe.coef.shape[0] == 1 and norm > 0:  # one weight vector: ridge, or two classes
            directions["probe", key] = probe.coef[0] / norm  # toward the positive value, or larger ones
        if means is not None and len(values) == 2:
            directions["diff_in_means", key] = means[key][values[1]] - means[key][values[0]]
    table = write_results(results, config.output_dir)
    _write_outputs(config, rows, test, task, values, directions, probes)
    if config.chart:
        write_chart(table, config.output_dir, config.label)
    return table


def statistics_means(config: ProbeConfig, keys: list[ArrayKey], values: list) -> dict | None:
    """Each label value's mean per key from the store's statistics (``label_means``), or None, with
    a warning saying why: the baseline and diff-in-means are optional; partial statistics are never used."""
    try:
        means = label_means(config.index, keys, config.label, values)
    except UserError as e:
        log.warning("no diff-in-means baseline: %s", e)
        return None
    if means is None:
        log.warning("no statistics by %s beside %s (runners.tpu_host --stats_by %s): no diff-in-means baseline",
                    config.label, config.index, config.label)
    return means


def _write_outputs(config: ProbeConfig, rows: ProbeRows, test: np.ndarray, task: str, values: list,
                   directions: dict, probes: dict[str, np.ndarray]) -> None:
    """directions.npz, probes.npz and split.parquet (each group's side)."""
    two = task == "classification" and len(values) == 2
    # The model, depth and width: what a steering checks the file against (interventions.resolve.steering_vector).
    metadata = {**store_model(rows.loader.metadata), "index": config.index,
                "label": config.label,
                "task": task, "negative": values[0] if two else None, "positive": values[1] if two else None,
                "tokens": config.tokens, "regularization": config.regularization}
    if directions:
        write_directions(os.path.join(config.output_dir, DIRECTIONS), directions, metadata)
    out = io.BytesIO()
    np.savez(out, metadata=np.array(json.dumps({**metadata, "classes": values if task == "classification" else None})),
             **probes)
    write_bytes(os.path.join(config.output_dir, PROBES), out.getvalue())
    sides = pd.DataFrame({"group": [str(g) for g in rows.groups.tolist()], "sample_id": rows.sample_ids,
                          "held_out": test}).drop_duplicates("sample_id")  # a group as text
    sides.to_parquet(os.path.join(config.output_dir, SPLIT), index=False)
