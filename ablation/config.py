"""An experiment's description: one dataclass, from ``--config experiments.yaml`` and flags
(flags win), e.g.

    model_path: Qwen/Qwen2.5-0.5B
    stream: streams/stream_000.jsonl
    max_samples: 200
    interventions: ["head:0-3.*", "layer:*", "mlp:*", "mlp:*:mode=mean"]
    output_dir: ablation_out
"""

from __future__ import annotations

import dataclasses
import re

from common.cli import UserError, flag
from common.extras import require
from model.settings import ModelRunSettings, ProfileSettings

METRICS = ("loss", "logit_diff")
PATCHING_METHODS = ("exact", "attribution", "both")


def spec_list(text: str) -> tuple[str, ...]:
    """One word of ``--interventions``: specs, split at spaces and at a comma before a kind (a
    steering's ``tokens=user,assistant`` keeps its comma)."""
    from interventions.spec import KINDS
    return tuple(part for part in re.sub(f",(?=(?:{'|'.join(KINDS)}):)", " ", text).split() if part)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AblationConfig(ModelRunSettings, ProfileSettings):
    stream: str | None = flag(None, "a stream of pipeline.prepare (local or gs://): a file, e.g. "
                              "streams/stream_000.jsonl, a parted one's directory, or the prepare's output "
                              "directory (every machine's stream, in machine order); ARC streams made "
                              "with --include_answers score the expected output grid, others every token")
    max_samples: int | None = flag(None, "use the first N records of the stream")
    interventions: tuple[str, ...] = flag((), "the grid: specs such as head:0-3.* layer:* mlp:2:mode=mean "
                                          "head:3.1+head:3.2 (see interventions/spec.py)", parse=spec_list)
    metric: str = flag("loss", "loss: each intervention's loss, accuracy and KL against the unablated model; "
                       "logit_diff: activation patching (patch: specs) over a paired stream, the clean answer's "
                       "logit minus the wrong answer's at the last position, and normalized (0 corrupted, 1 clean)")
    method: str = flag("exact", "with --metric logit_diff: exact (a forward per cell), attribution (one forward and "
                       "one backward per pair) or both (and their agreement per grid)")
    patch_from: str | None = flag(None, "with --metric logit_diff: the clean store's index.parquet (pipeline.index; "
                                  "local or gs://), holding the patched sites of each pair's clean sample")
    output_dir: str = flag("ablation_output", "local directory for results.parquet, summary.csv, means.npz, "
                           "charts/, tensorboard/ (a re-run skips what is there)")
    max_seq_length: int = flag(2048, "longest sequence: longer records are truncated to it")
    window: int = flag(32, "records scored together: results are written after each window")
    bootstrap: int = flag(1000, "bootstrap resamples for summary.csv's 95%% intervals")
    seed: int = flag(0, "seed of the bootstrap")
    tensorboard: bool = flag(True, "write TensorBoard event files to OUTPUT/tensorboard")
    charts: bool = flag(True, "write PNG charts to OUTPUT/charts")
    wandb: bool = flag(False, "log to Weights & Biases in offline mode (OUTPUT/wandb; sync later "
                       "with wandb sync)")
    wandb_project: str = flag("ablation", "Weights & Biases project")

    def validate(self) -> None:
        if not self.model_path:
            raise UserError("pass --model_path (or model_path: in --config)")
        if not self.stream:
            raise UserError("pass --stream (or stream: in --config)")
        if not self.interventions:
            raise UserError("pass --interventions (or interventions: in --config)")
        if "://" in self.output_dir:
            raise UserError(f"--output_dir must be a local directory, got {self.output_dir!r}")
        self.validate_batches()
        self.validate_mesh()
        self.validate_profiling()
        for name in ("max_seq_length", "window", "bootstrap"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be at least 1, got {getattr(self, name)}")
        self.validate_metric()
        if self.max_samples is not None and self.max_samples < 1:
            raise UserError(f"--max_samples must be at least 1, got {self.max_samples}")
        if self.tensorboard:
            require("tensorboardX", "tracking", "--tensorboard (turn it off with --no_tensorboard)")
        if self.charts:
            require("matplotlib", "charts", "--charts (turn them off with --no_charts)")
        if self.wandb:
            require("wandb", "tracking", "--wandb")

    def validate_metric(self) -> None:
        if self.metric not in METRICS:
            raise UserError(f"--metric must be {' or '.join(METRICS)}, got {self.metric!r}")
        if self.method not in PATCHING_METHODS:
            raise UserError(f"--method must be {', '.join(PATCHING_METHODS)}, got {self.method!r}")
        if self.metric == "logit_diff":
            if not self.patch_from:
                raise UserError("--metric logit_diff patches each pair's corrupted prompt with its clean prompt's "
                                "values: pass --patch_from INDEX (the clean store's index.parquet)")
            if self.wandb:
                raise UserError("--wandb logs ablation summaries; a patching run writes patching_summary.csv and "
                                "charts (pass --no_wandb)")
        elif self.patch_from or self.method != "exact":
            given = "--patch_from" if self.patch_from else "--method"
            raise UserError(f"{given} is for activation patching: --metric logit_diff")
