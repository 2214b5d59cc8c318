"""An activation-patching experiment over a paired stream (``runners.ablate --metric logit_diff``):
for every pair of the stream (``pipeline.prepare --keep_columns pair,variant --answer_columns
answer,wrong_answer``), every cell of every ``patch:`` intervention of the grid run on its corrupted
prompt with the clean prompt's values read from a store (``--patch_from INDEX``), scored by the
logit difference of the clean answer over the wrong one at the last position, and normalized (0 the
corrupted run, 1 the clean one). ``--method exact`` patches each cell in a forward of its own
(``ROWS_PER_FORWARD`` cells a batch); ``attribution`` estimates every cell from one forward and one
backward a pair (``ablation.patching.attribution_metrics``); ``both`` does both and reports their
agreement per grid.

Results are written as parts (``patching_parts/part-NNNNNN.parquet``, one per forward, each
renamed into place whole), so a run killed at any moment resumes with the cells it had not
finished; at the end they are gathered into ``patching.parquet``, ``patching_summary.csv``,
``agreement.json`` and a heatmap per grid (``charts/``).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
import time
from typing import Any, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ablation.charts import write_heatmap
from ablation.config import AblationConfig
from ablation.experiment import check_settings
from activations.index import arrays_path, check_same_model, merged_metadata_path, model_shape, store_model
from activations.token_plan import read_index_table
from ablation.patching import (ROWS_PER_FORWARD, Cell, Pair, agreement, attribution_metrics, baselines, cells,
                               exact_metrics, normalize, paired, stored_values)
from ablation.records import Record, read_records
from common.cli import UserError
from common.files import read_optional
from interventions.resolve import check_blocks, parse_for
from interventions.spec import Intervention
from model.families import load_config
from model.sites import array_key, describe_key

log = logging.getLogger("runners.ablate")
PARTS_DIR, RESULTS_FILE, SUMMARY_FILE, AGREEMENT_FILE = ("patching_parts", "patching.parquet", "patching_summary.csv",
                                                         "agreement.json")
METHODS = {"exact": ("exact",), "attribution": ("attribution",), "both": ("exact", "attribution")}
SCHEMA = pa.schema([
    ("grid", pa.string()), ("intervention", pa.string()), ("site", pa.string()), ("layer", pa.int32()),
    ("head", pa.int32()), ("position", pa.int32()), ("method", pa.string()), ("pair", pa.string()),
    ("sample_id", pa.int64()), ("clean_sample_id", pa.int64()), ("logit_diff", pa.float64()),
    ("normalized", pa.float64()), ("clean_logit_diff", pa.float64()), ("corrupted_logit_diff", pa.float64()),
])
WORST_CELLS = 5  # cells listed per grid where attribution and exact patching differ most


@dataclasses.dataclass
class PatchingReport:
    """What a run did (also written to run.json)."""
    interventions: int    # in the grid
    pairs: int
    cells: int            # (cell, pair, method) results in all
    computed: int         # of them, computed by this run
    forwards: int         # batched forwards of patched cells
    backwards: int        # attribution's backward passes (one per pair)
    wall_s: float
    outputs: list[str]


@dataclasses.dataclass(frozen=True)
class Plan:
    grid: list[Intervention]
    pairs: list[Pair]
    cells: dict[str, list[tuple[Intervention, Intervention, Cell]]]  # pair -> (intervention, the cell's, cell)


def plan(config: AblationConfig) -> Plan:
    """Everything checked before the model loads: the grid (patches only, against the model's
    config.json), the stream's pairs and every pair's cells, and the store's index (``check_store``)."""
    from model.extract import check_model_fits
    config.validate()
    model_config = load_config(config.model_dir())
    check_model_fits(model_config, (), config.max_seq_length)
    grid = parse_for(config.interventions, model_config)
    other = next((iv for iv in grid if len(iv.patches) != len(iv.atoms)), None)
    if other is not None:
        raise UserError(f"--metric logit_diff scores patches (patch:L:SITE...): {other.name!r} is not one")
    check_blocks(grid, model_config)
    records = read_records(config.stream, config.max_samples, config.max_seq_length)
    pairs = paired([_paired_item(record) for record in records])
    if not pairs:
        raise UserError(f"no pairs in {config.stream!r}")
    cut = next((r for r in records if r.truncated), None)
    if cut is not None:
        raise UserError(f"sample {cut.sample_id} is longer than --max_seq_length {config.max_seq_length}: a patched "
                        "prompt is scored at its last token, which the cut would move")
    planned = {}
    for pair in pairs:  # each cell once, though two interventions name it (pos=* and pos=0-1)
        found = {own.name: (iv, own, cell) for iv in grid for own, cell in cells(iv, pair)}
        planned[pair.name] = list(found.values())
    check_store(config.patch_from, model_config, config.model_path, pairs, planned)
    return Plan(grid, pairs, planned)


def patched_blocks(planned: Sequence[tuple[Intervention, Intervention, Cell]]) -> list[tuple[str, int]]:
    """The (site, block)s a pair's cells patch: what the store must hold of its clean sample."""
    return sorted({(patch.site, patch.layer) for _, _, cell in planned for patch in cell})


def check_store(index: str, model_config, model_path: str, pairs: Sequence[Pair],
                planned: dict[str, list[tuple[Intervention, Intervention, Cell]]]) -> None:
    """From the store's merged metadata and per-array index (no array read): one line for another
    model's store, or one without a pair's clean sample at a (site, block) its cells patch, or
    holding another number of tokens of it; a warning for values computed or stored below the
    float32 patching runs in, and for another model name (the same model elsewhere is allowed)."""
    raw = read_optional(merged_metadata_path(index))
    if raw is None:
        raise UserError(f"--patch_from {index}: no merged_metadata.json beside it: pass the index.parquet that "
                        "pipeline.index wrote for the clean store")
    metadata = json.loads(raw)
    check_same_model(store_model(metadata), {**model_shape(model_config), "model": model_path},
                     f"{index} holds activations", "this model")
    machines = metadata.get("machines", [])
    lower = sorted({m.get(k) for m in machines for k in ("compute_dtype", "dtype")} - {None, "float32"})
    if lower:
        log.warning("%s was computed or stored in %s: the clean values patched carry that rounding (patching runs "
                    "in float32)", index, ", ".join(lower))
    clean = sorted({pair.clean_sample for pair in pairs})
    table = read_index_table(arrays_path(index), "per-array index", columns=["sample_id", "layer", "site", "shape"],
                             filters=[("sample_id", "in", clean)]).to_pylist()
    rows = {(r["sample_id"], r["site"], r["layer"]): r["shape"][0] for r in table}
    for pair in pairs:
        for site, layer in patched_blocks(planned[pair.name]):
            found, what = rows.get((pair.clean_sample, site, layer)), describe_key(array_key(site, layer))
            if found is None:
                raise UserError(f"{index} holds no {what} of sample {pair.clean_sample} "
                                f"(pair {pair.name!r}'s clean prompt): store the site at the blocks patched "
                                "(runners.tpu_host --sites, --layers_to_extract)")
            if found != len(pair.clean):
                raise UserError(f"{index} holds {found} tokens of sample {pair.clean_sample} at {what}, the stream's "
                                "clean prompt has "
                                f"{len(pair.clean)}: store every token of the stream this experiment reads (no "
                                "--tokens selection, the same prepare)")


def _paired_item(record: Record) -> dict[str, Any]:
    """A record as ``ablation.patching.paired`` takes it; ``UserError`` for one without a pair."""
    columns = record.columns or {}
    missing = [name for name in ("pair", "variant") if columns.get(name) is None]
    if missing:
        raise UserError(f"sample {record.sample_id} has no {missing[0]} column: a patching stream pairs its samples "
                        "(pipeline.prepare --keep_columns pair,variant)")
    return {"pair": columns["pair"], "variant": columns["variant"], "ids": record.input_ids,
            "answers": record.answers, "sample_id": record.sample_id, "roles": record.roles}


def patching_settings(config: AblationConfig) -> dict[str, Any]:
    """What decides a patching run's numbers (float32 and its own attention, whatever --dtype or
    --attention say): a re-run into the same output must keep it."""
    return {"model_path": config.model_path, "stream": config.stream, "max_samples": config.max_samples,
            "max_seq_length": config.max_seq_length, "metric": config.metric, "patch_from": config.patch_from}


def run_patching(config: AblationConfig) -> PatchingReport:
    start = time.perf_counter()
    planned = plan(config)
    check_settings(config.output_dir, patching_settings(config))
    parts = Parts(config.output_dir)
    finished = set(zip(parts.rows["intervention"], parts.rows["method"], parts.rows["sample_id"]))
    methods = METHODS[config.method]
    report = PatchingReport(len(planned.grid), len(planned.pairs), sum(map(len, planned.cells.values())) * len(methods),
                            0, 0, 0, 0.0, [])
    model = None
    for pair in planned.pairs:
        todo = {method: [c for c in planned.cells[pair.name]
                         if (c[1].name, method, pair.corrupted_sample) not in finished] for method in methods}
        if not any(todo.values()):
            continue
        if model is None:
            model = _load_model(config)
        values = stored_values(config.patch_from, pair.clean_sample, patched_blocks(planned.cells[pair.name]))
        clean, corrupted = baselines(model, pair)
        for first in range(0, len(todo.get("exact", [])), ROWS_PER_FORWARD):
            chunk = todo["exact"][first:first + ROWS_PER_FORWARD]
            metrics = exact_metrics(model, pair, [cell for _, _, cell in chunk], values)
            parts.write(_rows(chunk, "exact", pair, metrics, clean, corrupted))
            report.forwards, report.computed = report.forwards + 1, report.computed + len(chunk)
        if todo.get("attribution"):
            chunk = todo["attribution"]
            estimates, backwards = attribution_metrics(model, pair, [cell for _, _, cell in chunk], values)
            parts.write(_rows(chunk, "attribution", pair, estimates, clean, corrupted))
            report.backwards, report.computed = report.backwards + backwards, report.computed + len(chunk)
        log.info("pair %s: %s", pair.name, ", ".join(f"{len(t)} {m} cells" for m, t in todo.items()))
    report.outputs = write_outputs(config, parts.gather())
    report.wall_s = round(time.perf_counter() - start, 2)
    with open(os.path.join(config.output_dir, "run.json"), "w") as f:
        json.dump(dataclasses.asdict(report), f, indent=2)
    return report


def _load_model(config: AblationConfig):
    import jax.numpy as jnp
    from model.loading import load_model
    if config.dtype not in ("auto", "float32"):
        log.warning("patching runs in float32 (--dtype %s is not used)", config.dtype)
    return load_model(config.model_path, jnp.float32, with_head=True, revision=config.model_revision)


def _rows(chunk: Sequence[tuple[Intervention, Intervention, Cell]], method: str, pair: Pair, metrics: np.ndarray,
          clean: float, corrupted: float) -> list[dict[str, Any]]:
    """One result row per cell of ``chunk``: site, layer, head and position those of a cell of one
    patch (position: its pos=, of a grid over positions), null for a cell of several."""
    rows = []
    for (_, own, _), metric, fraction in zip(chunk, metrics, normalize(metrics, clean, corrupted)):
        atom = own.atoms[0] if len(own.atoms) == 1 else None
        rows.append({"grid": grid_name(own), "intervention": own.name, "site": atom.site if atom else None,
                     "layer": atom.layer if atom else None, "head": atom.head if atom else None,
                     "position": int(atom.position) if atom and atom.position else None,
                     "method": method, "pair": pair.name, "sample_id": pair.corrupted_sample,
                     "clean_sample_id": pair.clean_sample, "logit_diff": float(metric),
                     "normalized": float(fraction), "clean_logit_diff": clean, "corrupted_logit_diff": corrupted})
    return rows


class Parts:
    """The results written so far, one parquet part per forward: a part is renamed into place
    whole, so a kill leaves every finished forward's rows and none of the one it interrupted."""

    def __init__(self, output_dir: str):
        self.folder = os.path.join(output_dir, PARTS_DIR)
        os.makedirs(self.folder, exist_ok=True)
        paths = sorted(glob.glob(os.path.join(self.folder, "part-*.parquet")))
        # The next part's number: past the last (a part missing in the middle leaves its number unused).
        self.count = max((int(os.path.basename(p)[5:11]) + 1 for p in paths), default=0)
        tables = [pq.read_table(p, schema=SCHEMA) for p in paths]
        self.rows = (pa.concat_tables(tables) if tables else SCHEMA.empty_table()).to_pandas()

    def write(self, rows: list[dict[str, Any]]) -> None:
        path = os.path.join(self.folder, f"part-{self.count:06d}.parquet")
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path + ".tmp")
        os.replace(path + ".tmp", path)
        self.count += 1

    def gather(self) -> pd.DataFrame:
        """Every row written, by this run and those before it."""
        return Parts(os.path.dirname(self.folder)).rows


def summarize(results: pd.DataFrame) -> pd.DataFrame:
    """One row per (cell, method): the pairs it was computed on, and the mean logit difference and
    normalized metric over them."""
    keys = ["grid", "intervention", "site", "layer", "head", "position", "method"]
    summary = (results.groupby(keys, dropna=False, sort=False)
               .agg(pairs=("pair", "size"), logit_diff=("logit_diff", "mean"), normalized=("normalized", "mean"),
                    normalized_std=("normalized", "std"))
               .reset_index())
    return summary.astype({"layer": "Int64", "head": "Int64", "position": "Int64"})


def grid_name(intervention: Intervention) -> str:
    """The grid a cell belongs to, as TransformerLens lays grids out: for one patch its site over
    blocks, and over heads and positions where it has them (``patch:*:attn.hook_z:heads=*:pos=*``);
    a cell of several patches is a grid of its own (its intervention's name)."""
    if len(intervention.atoms) != 1:
        return intervention.name
    atom = intervention.atoms[0]
    return (f"patch:*:{atom.site}" + (":heads=*" if atom.head is not None else "")
            + (":pos=*" if atom.position else "") + (f":tokens={atom.tokens}" if atom.tokens else ""))


def agreements(summary: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Per grid computed by both methods: the correlation of attribution's cells with exact
    patching's (of the normalized metric averaged over pairs), and the cells where they differ most."""
    both = summary.pivot_table(index="intervention", columns="method", values="normalized", aggfunc="first")
    if not {"exact", "attribution"} <= set(both.columns):
        return {}
    grids = summary.drop_duplicates("intervention").set_index("intervention")["grid"]
    out = {}
    for grid, names in grids.groupby(grids, sort=False).groups.items():
        cells = both.loc[list(names), ["exact", "attribution"]].dropna()
        if cells.empty:
            continue
        found = agreement(cells["exact"].to_numpy(), cells["attribution"].to_numpy(), WORST_CELLS)
        correlation = found["correlation"] if np.isfinite(found["correlation"]) else None  # one cell, or constant
        out[grid] = {"cells": len(cells), "correlation": correlation,
                     "worst": [{"intervention": cells.index[i[0]], "exact": exact, "attribution": estimate}
                               for i, exact, estimate in found["worst"]]}
    return out


def write_outputs(config: AblationConfig, results: pd.DataFrame) -> list[str]:
    """patching.parquet, patching_summary.csv, agreement.json (both methods) and the charts; the
    paths written, relative to the output directory."""
    out = config.output_dir
    pq.write_table(pa.Table.from_pandas(results, schema=SCHEMA, preserve_index=False), os.path.join(out, "tmp.parquet"))
    os.replace(os.path.join(out, "tmp.parquet"), os.path.join(out, RESULTS_FILE))
    summary = summarize(results)
    summary.to_csv(os.path.join(out, SUMMARY_FILE), index=False)
    written = [RESULTS_FILE, SUMMARY_FILE]
    found = agreements(summary)
    if found:
        with open(os.path.join(out, AGREEMENT_FILE), "w") as f:
            json.dump(found, f, indent=2)
        written.append(AGREEMENT_FILE)
        for grid, figures in found.items():
            log.info("%s: attribution against exact patching, correlation %s over %d cells", grid,
                     "none" if figures["correlation"] is None else f"{figures['correlation']:.3f}", figures["cells"])
    charts = write_charts(summary, os.path.join(out, "charts")) if config.charts else []
    written += [os.path.relpath(p, out) for p in charts]
    if config.tensorboard:
        from ablation.tracking import write_tensorboard
        write_tensorboard(os.path.join(out, "tensorboard"), summary, charts, block_series(summary))
        written.append("tensorboard/")
    return written


def block_series(summary: pd.DataFrame) -> list[tuple[str, int, float]]:
    """(tag, block, mean normalized metric) of each cell patching one site of one block whole (no
    head, no position): a series over blocks per grid and method."""
    whole = summary[summary["site"].notna() & summary["head"].isna() & summary["position"].isna()]
    return [(f"{row['grid']}/{row['method']}/normalized", int(row["layer"]), float(row["normalized"]))
            for _, row in whole.iterrows()]


def chart_grid(rows: pd.DataFrame) -> tuple[np.ndarray, list[str], list[str]]:
    """One grid's [rows, columns] of the mean normalized metric (NaN: no pair has the cell), with
    the rows' labels (blocks, or block.head where positions are the columns) and the columns'
    (positions, or heads, or one column)."""
    by_position, by_head = rows["position"].notna().any(), rows["head"].notna().any()
    row_of = (rows["layer"].astype(str) + "." + rows["head"].astype(str)) if by_position and by_head \
        else rows["layer"].astype(str)
    column_of = (rows["position"] if by_position else rows["head"] if by_head else pd.Series(0, index=rows.index))
    row_labels = list(dict.fromkeys(row_of.iloc[np.lexsort((rows["head"].fillna(-1), rows["layer"]))]))
    columns = sorted(set(column_of.astype(int)))
    grid = np.full((len(row_labels), len(columns)), np.nan)
    for label, column, value in zip(row_of, column_of.astype(int), rows["normalized"]):
        grid[row_labels.index(label), columns.index(column)] = value
    column_labels = [str(c) for c in columns] if (by_position or by_head) else ["all positions"]
    return grid, row_labels, column_labels


def write_charts(summary: pd.DataFrame, folder: str) -> list[str]:
    """A heatmap of each grid and method (the mean normalized metric); the paths written."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for (grid, method), rows in summary[summary["site"].notna()].groupby(["grid", "method"]):
        values, row_labels, column_labels = chart_grid(rows)
        what = "position" if rows["position"].notna().any() else "head" if rows["head"].notna().any() else ""
        tokens = grid.split(":tokens=")[1] if ":tokens=" in grid else ""
        name = rows.iloc[0]["site"] + ("_by_head" if ":heads=" in grid else "") + (
            "_by_position" if ":pos=" in grid else "") + ("_" + re.sub(r"[^A-Za-z0-9]+", "_", tokens) if tokens else "")
        title = f"{grid}\n{method} patching: normalized logit difference, mean of {int(rows['pairs'].max())} pairs"
        path = os.path.join(folder, f"patching_{name}_{method}.png")
        paths.append(write_heatmap(values, path, title, rows="block.head" if "." in row_labels[0] else "layer",
                                   columns=what, row_labels=row_labels, column_labels=column_labels, cmap="RdBu"))
    return paths
