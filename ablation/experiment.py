"""A grid of interventions over a stream: the mean pass (when a ``mode=mean`` intervention needs
it), then window by window of records, per batch the unablated forward once and each pending
intervention one forward of the same compiled function; rows are written after every window.

A re-run with the same settings skips every (intervention, sample) already in results.parquet
(a finished intervention entirely), and reuses means.npz.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from ablation.config import AblationConfig
from ablation.records import Record, read_records
from ablation.results import (RESULTS_FILE, SUMMARY_FILE, describe, load_results, summarize,
                              write_results)
from common.cli import UserError
from common.profiling import BatchProfiler
from interventions.resolve import (ablation_arrays, check_blocks, parse_for, steered_mask, steered_positions,
                                   steering_digests)
from interventions.spec import BASELINE, Intervention
from model.families import load_config
from model.interventions import STEER_TOKENS, Means
from model.run_settings import changed_settings
from model.scoring import InterventionModel, scored_tokens

log = logging.getLogger("runners.ablate")
MEANS_FILE, EXPERIMENT_FILE, RUN_FILE, STEERING_FILE = "means.npz", "experiment.json", "run.json", "steering.json"


@dataclasses.dataclass
class RunReport:
    """What a run did (also written to run.json)."""
    interventions: int        # in the grid, the baseline not counted
    samples: int
    computed: int             # interventions (baseline included) with samples left to compute
    forwards: int             # batch forwards under an intervention, the baseline's included
    compiles: int             # compiled functions, one per function and batch shape
    compile_s: float
    batch_shapes: list[tuple[int, int]]        # (rows, length) of the batches scored
    compiled: dict[str, list[tuple[int, ...]]]  # function -> the shapes it was compiled for
    means: str                # computed | loaded | not needed
    wall_s: float
    outputs: list[str]


def settings(config: AblationConfig) -> dict[str, Any]:
    """What decides the numbers: a re-run into the same output must keep it (the steerings'
    files: ``check_steering``)."""
    import jax.numpy as jnp
    from model.extract import resolve_dtype, resolve_residual_dtype, residual_dtype_name
    dtype = resolve_dtype(config.dtype)
    return {"model_path": config.model_path, "stream": config.stream, "max_samples": config.max_samples,
            "max_seq_length": config.max_seq_length, "dtype": jnp.dtype(dtype).name,
            "residual_dtype": residual_dtype_name(dtype, resolve_residual_dtype(config.residual_dtype)),
            "attention": config.attention}


def check_steering(output_dir: str, grid: Sequence[Intervention]) -> None:
    """Records each directions file the grid steers with by its contents' hash
    (``steering.json``); refuses a re-run whose file at a recorded path now holds other vectors
    (the results would mix). A grid may add files."""
    steers = tuple(atom for intervention in grid for atom in intervention.atoms if atom.kind == "steer")
    current = steering_digests(Intervention(steers)) or {}
    path = os.path.join(output_dir, STEERING_FILE)
    stored = {}
    if os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
    changed = [name for name, digest in current.items() if stored.get(name, digest) != digest]
    if changed:
        raise UserError(f"{changed[0]!r} holds other directions than when {output_dir!r} was scored with it: "
                        "use another --output_dir (or the file as it was)")
    if current.keys() - stored.keys():
        with open(path, "w") as f:
            json.dump({**stored, **current}, f, indent=2)


def check_settings(output_dir: str, current: dict[str, Any]) -> None:
    """Records the settings on a first run; refuses a re-run with other ones (its rows would mix)."""
    path = os.path.join(output_dir, EXPERIMENT_FILE)
    if os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
        changed = changed_settings(stored, current)
        if changed:
            raise UserError(f"{output_dir!r} holds results made with other settings ({'; '.join(changed)}): "
                            "use another --output_dir")
        return
    os.makedirs(output_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(current, f, indent=2)


def plan(config: AblationConfig) -> tuple[list[Intervention], list[Record], Any]:
    """Everything checked before the model loads: the grid (against the model's config.json),
    the records of the stream."""
    from model.extract import check_model_fits
    config.validate()
    model_config = load_config(config.model_dir())
    check_model_fits(model_config, (), config.max_seq_length)  # before anything is written
    grid = parse_for(config.interventions, model_config)
    patching = next((iv for iv in grid if iv.patches), None)
    if patching is not None:
        raise UserError(f"{patching.name!r} patches: activation patching is scored by --metric logit_diff "
                        "(with --patch_from INDEX)")
    check_blocks(grid, model_config)
    records = read_records(config.stream, config.max_samples, config.max_seq_length)
    if not records:
        raise UserError(f"no records in {config.stream!r}")
    for tokens in {iv.steer_tokens for iv in grid} - {None}:  # the stream has the roles they choose by
        steered_positions(tokens, records[0].roles, len(records[0].input_ids), records[0].sample_id)
    return grid, records, model_config


def run_experiment(config: AblationConfig) -> RunReport:
    start = time.perf_counter()
    grid, records, model_config = plan(config)
    check_settings(config.output_dir, settings(config))
    check_steering(config.output_dir, grid)
    everything = [Intervention(), *grid]  # the baseline first: every other is scored against it
    done = load_results(config.output_dir)
    finished = set(zip(done["intervention"], done["sample_id"]))
    pending = [iv for iv in everything if any((iv.name, r.sample_id) not in finished for r in records)]
    report = RunReport(len(grid), len(records), len(pending), 0, 0, 0.0, [], {}, "not needed", 0.0, [])
    if pending:
        model = _load_model(config)
        means = _means(config, model, records, report) if any(iv.needs_means for iv in pending) else None
        def arrays(iv: Intervention) -> dict[str, np.ndarray]:
            # Built at each use, not all at once: every head of a big model would not fit.
            return ablation_arrays(iv, model.config, model.num_layers, means)

        profiler = BatchProfiler(config.profile_dir, config.profile_batches) if config.profile_dir else None
        try:
            for first in range(0, len(records), config.window):
                window = records[first:first + config.window]
                rows = _score_window(model, window, pending, finished, arrays, report, profiler)
                if rows:
                    done = pd.concat([done, pd.DataFrame(rows)], ignore_index=True) if len(done) else pd.DataFrame(rows)
                    write_results(config.output_dir, done)
                    finished.update((row["intervention"], row["sample_id"]) for row in rows)
                log.info("records %d-%d of %d: %d rows written", first, first + len(window) - 1, len(records),
                         len(rows))
        finally:
            if profiler is not None:
                profiler.stop()
        report.compiles, report.compile_s, report.compiled = model.compiles, round(model.compile_s, 2), model.compiled()
    report.outputs = _write_outputs(config, model_config, done, [iv.name for iv in everything], bool(pending))
    report.wall_s = round(time.perf_counter() - start, 2)
    with open(os.path.join(config.output_dir, RUN_FILE), "w") as f:
        json.dump(dataclasses.asdict(report), f, indent=2)
    return report


def _load_model(config: AblationConfig) -> InterventionModel:
    from model.extract import resolve_dtype
    from model.loading import load_model
    loaded = load_model(config.model_path, resolve_dtype(config.dtype), config.mesh_type, config.model_axis_size,
                        with_head=True,
                        revision=config.model_revision)
    return InterventionModel(loaded, config.batch_size, config.max_seq_length, config.attention,
                             config.residual_dtype, config.moe_dispatch)


def _means(config: AblationConfig, model: InterventionModel, records: list[Record], report: RunReport) -> Means:
    path = os.path.join(config.output_dir, MEANS_FILE)
    if os.path.exists(path):
        report.means = "loaded"
        return Means.load(path)
    log.info("mean pass over %d records", len(records))
    means = model.means(r.input_ids for r in records)
    means.save(path)
    report.means = "computed"
    return means


def _score_window(model: InterventionModel, window: list[Record], pending: list[Intervention],
                  finished: set, arrays: Callable[[Intervention], dict[str, np.ndarray]], report: RunReport,
                  profiler: BatchProfiler | None) -> list[dict[str, Any]]:
    """The rows of every pending (intervention, record) of one window."""
    todo = [iv for iv in pending if any((iv.name, r.sample_id) not in finished for r in window)]
    rows: list[dict[str, Any]] = []
    if not todo:
        return rows
    for batch in model.batches((r, r.input_ids) for r in window):
        batch_records = [r for r, _ in batch.items]
        ids, lengths = model.inputs([r.input_ids for r in batch_records], batch.length)
        if ids.shape not in report.batch_shapes:
            report.batch_shapes.append(ids.shape)
        base = model.residuals(ids, lengths, arrays(Intervention()))
        unablated = model.unablated(base, ids, [scored_tokens(len(r.input_ids), r.answer_start) for r in batch_records])
        for iv in todo:
            needed = [i for i, r in enumerate(batch_records) if (iv.name, r.sample_id) not in finished]
            if not needed:
                continue
            with profiler.batch() if profiler is not None else contextlib.nullcontext():
                residuals = (base if iv.name == BASELINE
                             else model.residuals(ids, lengths, _batch_arrays(iv, arrays, ids, batch_records)))
                result = model.scores(residuals, unablated, lengths, len(batch_records))
            report.forwards += 1
            rows += [{"intervention": iv.name, **describe(iv), "sample_id": batch_records[i].sample_id,
                      "source": batch_records[i].source, "loss": result.loss[i], "accuracy": result.accuracy[i],
                      "kl": result.kl[i], "scored_tokens": int(result.scored_tokens[i]),
                      "truncated": batch_records[i].truncated,
                      "resid_change": result.resid_change[i].astype(np.float32).tolist()} for i in needed]
    return rows


def _batch_arrays(iv: Intervention, arrays: Callable[[Intervention], dict[str, np.ndarray]], ids: np.ndarray,
                  records: list[Record]) -> dict[str, np.ndarray]:
    """The intervention's arrays for one batch: with a steering of chosen tokens, which they are."""
    if iv.steer_tokens is None:
        return arrays(iv)
    mask = steered_mask(iv.steer_tokens, [r.roles for r in records], *ids.shape, [r.sample_id for r in records])
    return {**arrays(iv), STEER_TOKENS: mask}


def _write_outputs(config: AblationConfig, model_config: Any, results: pd.DataFrame,
                   order: list[str], new_results: bool) -> list[str]:
    """summary.csv, and the charts and tracking the config asks for; returns what was written
    (results.parquet too when this run added rows to it)."""
    from ablation.charts import write_charts
    from ablation.tracking import write_tensorboard, write_wandb
    summary = summarize(results, order, config.bootstrap, config.seed)
    out = config.output_dir
    summary.to_csv(os.path.join(out, SUMMARY_FILE), index=False)
    written = [RESULTS_FILE, SUMMARY_FILE] if new_results else [SUMMARY_FILE]
    charts = (write_charts(summary, os.path.join(out, "charts"), model_config.num_hidden_layers,
                           model_config.num_attention_heads, model_config.num_experts) if config.charts else [])
    written += [os.path.relpath(p, out) for p in charts]
    if config.tensorboard:
        write_tensorboard(os.path.join(out, "tensorboard"), summary, charts)
        written.append("tensorboard/")
    if config.wandb:
        written.append(os.path.relpath(write_wandb(out, config.wandb_project, config, summary, charts), out))
    return written
