"""A short SAELens training on an export (``pipeline.export --format saelens``): its loss curve and
its dead latents, to see that the stored activations have structure a sparse autoencoder finds.

SAELens reads the export as it is (``ActivationsStore(cached_activations_path=...)``, as
docs/training.md shows) and trains with its own ``SAETrainer``. The loop here calls the trainer's
``step`` (the seam SAELens's own ``fit`` and its multi-SAE coordinator use) so that each step's
losses can be recorded; everything else is SAELens's. Needs the ``real-models`` extra (sae-lens).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any

from activations.saelens_export import EXPORT_INFO_FILE
from common.cli import UserError, flag
from common.extras import require


@dataclasses.dataclass(frozen=True)
class SaeTrainingConfig:
    export_dir: str = flag(help="a directory written by pipeline.export --format saelens")
    hook_name: str | None = flag(None, "column to train on (default: the export's only layer)")
    expansion: int = flag(4, "latents per input dimension: d_sae = expansion x hidden size")
    l1_coefficient: float = flag(5.0, "weight of the L1 sparsity penalty")
    lr: float = flag(3e-4, "Adam learning rate (constant)")
    batch_tokens: int = flag(1024, "tokens per training step")
    steps: int = flag(200, "training steps (the export is read again from the start when it runs out)")
    log_every: int = flag(20, "print the mean losses of each run of this many steps")
    dead_window: int = flag(50, "a latent that fired on no token of the last N steps is dead")
    seed: int = flag(0, "torch seed of the SAE's initialisation")
    output_dir: str | None = flag(None, "save the trained SAE here (sae_lens.SAE.load_from_disk reads it)")

    def validate(self) -> None:
        for name in ("expansion", "batch_tokens", "steps", "log_every", "dead_window"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.dead_window > self.steps:
            raise UserError(f"--dead_window {self.dead_window} is longer than the training (--steps {self.steps})")


@dataclasses.dataclass(frozen=True)
class TrainingLog:
    """Per run of ``log_every`` steps (its last step, mean losses), and the end state."""
    steps: list[int]
    loss: list[float]  # SAELens's training loss: MSE + L1 penalty
    mse: list[float]
    l0: list[float]  # latents active per token
    explained_variance: list[float]  # 1 - MSE / variance of the batch's activations
    dead_fraction: float  # latents that fired on no token of the last dead_window steps
    d_sae: int


def export_info(export_dir: str) -> dict[str, Any]:
    path = os.path.join(export_dir, EXPORT_INFO_FILE)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{export_dir!r} is not a pipeline.export --format saelens directory "
                        f"(no {EXPORT_INFO_FILE})") from None


def chosen_hook(info: dict[str, Any], hook_name: str | None) -> str:
    names = [layer["hook_name"] for layer in info["layers"]]
    if hook_name is None and len(names) == 1:
        return names[0]
    if hook_name not in names:
        raise UserError(f"--hook_name: choose one of the export's columns: {', '.join(names)}")
    return hook_name


def train_sae(config: SaeTrainingConfig, report=print) -> TrainingLog:
    """Trains a standard SAE on ``config.export_dir``; ``report`` gets one line per logged run."""
    config.validate()
    info = export_info(config.export_dir)
    hook = chosen_hook(info, config.hook_name)
    torch = require("torch", "real-models", "runners.train_sae")
    sae_lens = require("sae_lens", "real-models", "runners.train_sae")
    from sae_lens.config import LoggingConfig, SAETrainerConfig
    from sae_lens.training.activations_store import ActivationsStore
    d_in, context = info["hidden_size"], info["context_size"]
    if info["tokens"] < config.batch_tokens:
        raise UserError(f"the export holds {info['tokens']} tokens, fewer than one batch (--batch_tokens "
                        f"{config.batch_tokens})")
    torch.manual_seed(config.seed)
    store = ActivationsStore(
        model=None, dataset=None, streaming=False, cached_activations_path=config.export_dir, hook_name=hook,
        hook_head_index=None, context_size=context, d_in=d_in, dtype="float32", prepend_bos=False,
        store_batch_size_prompts=8, n_batches_in_buffer=max(2, -(-2 * config.batch_tokens // context)),
        train_batch_size_tokens=config.batch_tokens, total_training_tokens=config.steps * config.batch_tokens,
        normalize_activations="none", device="cpu")
    sae = sae_lens.StandardTrainingSAE(sae_lens.StandardTrainingSAEConfig(
        d_in=d_in, d_sae=config.expansion * d_in, l1_coefficient=config.l1_coefficient))
    trainer = sae_lens.SAETrainer(
        cfg=SAETrainerConfig(total_training_samples=config.steps * config.batch_tokens,
                             train_batch_size_samples=config.batch_tokens, lr=config.lr, lr_end=config.lr,
                             dead_feature_window=config.dead_window, device="cpu",
                             logger=LoggingConfig(log_to_wandb=False)),
        sae=sae, data_provider=iter(store))
    log = TrainingLog([], [], [], [], [], 0.0, config.expansion * d_in)
    window: list[tuple[float, float, float, float]] = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*new epoch.*")  # a small export is read several times
        for step in range(1, config.steps + 1):
            batch = next(trainer.data_provider)  # [batch_tokens, d_in]
            output = trainer.step(batch)
            trainer.n_training_steps += 1
            mse = output.losses["mse_loss"].item()  # summed over dimensions, mean over tokens
            variance = ((batch - batch.mean(0)) ** 2).sum(-1).mean().item()
            l0 = (output.feature_acts > 0).sum(-1).float().mean().item()
            window.append((output.loss.item(), mse, l0, 1 - mse / variance))
            if step % config.log_every == 0 or step == config.steps:
                means = [sum(column) / len(window) for column in zip(*window)]
                for series, value in zip((log.loss, log.mse, log.l0, log.explained_variance), means):
                    series.append(value)
                log.steps.append(step)
                report(f"step {step:>5}  loss {means[0]:10.4f}  mse {means[1]:10.4f}  L0 {means[2]:7.1f}  "
                       f"explained variance {means[3]:6.3f}")
                window = []
    log = dataclasses.replace(log, dead_fraction=float(trainer.dead_neurons.float().mean()))
    if config.output_dir:
        trainer.sae.save_model(config.output_dir)
    return log
