"""A short SAELens training on an export (``pipeline.export --format saelens``): its loss curve and
its dead latents, to see that the stored activations have structure a sparse autoencoder (or a
transcoder) finds.

SAE: SAELens reads the export as it is (``ActivationsStore(cached_activations_path=...)``, as
docs/training.md shows) and trains with its own ``SAETrainer``. The loop here calls the trainer's
``step`` (the seam SAELens's own ``fit`` and its multi-SAE coordinator use) so that each step's
losses can be recorded; everything else is SAELens's.

Transcoder (``target_hook_name``): SAELens's ``Transcoder`` (it has no trainer for one, and its
``ActivationsStore`` reads one column) trained here by Adam on a paired export: each row's two
columns (input and target, the same tokens) read in order, flattened to tokens. The loss is
SAELens's standard SAE loss with the target in place of the input: squared error summed over
dimensions plus ``l1_coefficient`` x sum(|feature| x its decoder row's norm), both a mean over
tokens. Needs the ``real-models`` extra (sae-lens).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Callable, Iterator

import numpy as np

from activations.saelens_export import EXPORT_INFO_FILE
from common.cli import UserError, flag
from common.extras import require


@dataclasses.dataclass(frozen=True)
class SaeTrainingConfig:
    export_dir: str = flag(help="a directory written by pipeline.export --format saelens")
    hook_name: str | None = flag(None, "column to train on, or the transcoder's input (default: the export's "
                                 "only column, or only other column)")
    target_hook_name: str | None = flag(None, "train a transcoder from --hook_name to this column (e.g. "
                                        "blocks.L.hook_mlp_out from blocks.L.ln2.hook_normalized)")
    expansion: int = flag(4, "latents per input dimension: d_sae = expansion x input width")
    l1_coefficient: float = flag(5.0, "weight of the L1 sparsity penalty")
    lr: float = flag(3e-4, "Adam learning rate (constant)")
    batch_tokens: int = flag(1024, "tokens per training step")
    steps: int = flag(200, "training steps (the export is read again from the start when it runs out)")
    log_every: int = flag(20, "print the mean losses of each run of this many steps")
    dead_window: int = flag(50, "a latent that fired on no token of the last N steps is dead")
    seed: int = flag(0, "torch seed of the SAE's initialisation")
    output_dir: str | None = flag(None, "save the trained SAE or transcoder here (sae_lens.SAE.load_from_disk "
                                  "reads either)")

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
    loss: list[float]  # the training loss: MSE + L1 penalty
    mse: list[float]   # squared error summed over dimensions, mean over tokens
    l0: list[float]  # latents active per token
    explained_variance: list[float]  # 1 - MSE / variance of the batch's activations (the target's)
    dead_fraction: float  # latents that fired on no token of the last dead_window steps
    d_sae: int


# One training step: (loss, mse, the variance of what is reconstructed, feature_acts [batch, d_sae]).
Step = Callable[[], tuple[float, float, float, Any]]


def export_info(export_dir: str) -> dict[str, Any]:
    path = os.path.join(export_dir, EXPORT_INFO_FILE)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{export_dir!r} is not a pipeline.export --format saelens directory "
                        f"(no {EXPORT_INFO_FILE})") from None


def chosen_hooks(info: dict[str, Any], hook_name: str | None,
                 target_hook_name: str | None) -> tuple[str, str | None]:
    """(input column, target column or None): ``hook_name`` defaults to the export's only column
    besides the target."""
    names = [column["hook_name"] for column in info["layers"]]
    if target_hook_name is not None and target_hook_name not in names:
        raise UserError(f"--target_hook_name: choose one of the export's columns: {', '.join(names)}")
    others = [name for name in names if name != target_hook_name]
    if hook_name is None and len(others) == 1:
        return others[0], target_hook_name
    if hook_name not in others:
        what = "a column other than --target_hook_name" if target_hook_name else "one of the export's columns"
        raise UserError(f"--hook_name: choose {what}: {', '.join(others)}")
    return hook_name, target_hook_name


def column_width(info: dict[str, Any], hook_name: str) -> int:
    """A column's width (an export written before sites existed has only the hidden size)."""
    column = next(c for c in info["layers"] if c["hook_name"] == hook_name)
    return column.get("width", info["hidden_size"])


def train_sae(config: SaeTrainingConfig, report=print) -> TrainingLog:
    """Trains a standard SAE, or a transcoder with ``target_hook_name``, on ``config.export_dir``;
    ``report`` gets one line per logged run."""
    config.validate()
    info = export_info(config.export_dir)
    hook, target = chosen_hooks(info, config.hook_name, config.target_hook_name)
    torch = require("torch", "real-models", "runners.train_sae")
    require("sae_lens", "real-models", "runners.train_sae")
    if info["tokens"] < config.batch_tokens:
        raise UserError(f"the export holds {info['tokens']} tokens, fewer than one batch (--batch_tokens "
                        f"{config.batch_tokens})")
    torch.manual_seed(config.seed)
    d_sae = config.expansion * column_width(info, hook)
    model, step = (_transcoder(config, info, hook, target) if target else _sae(config, info, hook))
    log = _logged_training(config, d_sae, step, report)
    if config.output_dir:
        model.save_model(config.output_dir)
    return log


def _sae(config: SaeTrainingConfig, info: dict[str, Any], hook: str) -> tuple[Any, Step]:
    """A standard SAE and its step: SAELens's ``ActivationsStore`` over the export and its
    ``SAETrainer``."""
    import sae_lens
    from sae_lens.config import LoggingConfig, SAETrainerConfig
    from sae_lens.training.activations_store import ActivationsStore
    d_in, context = column_width(info, hook), info["context_size"]
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

    def step():
        batch = next(trainer.data_provider)  # [batch_tokens, d_in]
        output = trainer.step(batch)
        trainer.n_training_steps += 1
        return output.loss.item(), output.losses["mse_loss"].item(), _variance(batch), output.feature_acts
    return trainer.sae, step


def _transcoder(config: SaeTrainingConfig, info: dict[str, Any], hook: str, target: str) -> tuple[Any, Step]:
    """A SAELens ``Transcoder`` from ``hook`` to ``target`` and its Adam step on the export's rows."""
    import torch
    from sae_lens import Transcoder, TranscoderConfig
    d_in = column_width(info, hook)
    transcoder = Transcoder(TranscoderConfig(d_in=d_in, d_sae=config.expansion * d_in,
                                             d_out=column_width(info, target), apply_b_dec_to_input=False))
    transcoder.cfg.metadata.hook_name, transcoder.cfg.metadata.hook_name_out = hook, target
    optimizer = torch.optim.Adam(transcoder.parameters(), lr=config.lr)
    batches = paired_batches(config.export_dir, (hook, target), config.batch_tokens)

    def step():
        x, y = (torch.from_numpy(a) for a in next(batches))  # [batch, d_in], [batch, d_out]
        feature_acts = transcoder.encode(x)  # [batch, d_sae]
        mse = ((transcoder.decode(feature_acts) - y) ** 2).sum(-1).mean()
        sparsity = (feature_acts * transcoder.W_dec.norm(dim=1)).sum(-1).mean()
        loss = mse + config.l1_coefficient * sparsity
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item(), mse.item(), _variance(y), feature_acts.detach()
    return transcoder, step


def paired_batches(export_dir: str, hooks: tuple[str, ...], batch_tokens: int) -> Iterator[list[np.ndarray]]:
    """Endless batches of the export's tokens, one [batch_tokens, width] float32 array per column
    of ``hooks`` (row i of each is the same token): the rows in order, each flattened to its
    tokens, read again from the start when they run out."""
    import datasets
    rows = datasets.load_from_disk(export_dir).with_format("numpy", columns=list(hooks))
    pending, held = [], 0
    while True:
        for chunk in rows.iter(batch_size=max(1, batch_tokens // rows.features[hooks[0]].shape[0])):
            pending.append([chunk[h].reshape(-1, chunk[h].shape[-1]) for h in hooks])  # [rows x context, width]
            held += len(pending[-1][0])
            while held >= batch_tokens:
                joined = [np.concatenate(parts) for parts in zip(*pending)]
                yield [column[:batch_tokens] for column in joined]
                pending, held = [[column[batch_tokens:] for column in joined]], held - batch_tokens


def _variance(batch) -> float:
    """The batch's variance summed over dimensions (what MSE is compared with)."""
    return ((batch - batch.mean(0)) ** 2).sum(-1).mean().item()


def _logged_training(config: SaeTrainingConfig, d_sae: int, step: Step, report) -> TrainingLog:
    """Runs ``config.steps`` steps, reporting the mean losses of every ``log_every``; a latent is
    dead when it fired on no token of the last ``dead_window`` steps (SAELens's definition)."""
    import torch
    log = TrainingLog([], [], [], [], [], 0.0, d_sae)
    window: list[tuple[float, float, float, float]] = []
    since_fired = torch.zeros(d_sae)  # [d_sae] steps since each latent last fired
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*new epoch.*")  # a small export is read several times
        for i in range(1, config.steps + 1):
            loss, mse, variance, feature_acts = step()
            since_fired += 1
            since_fired[(feature_acts > 0).any(0)] = 0
            l0 = (feature_acts > 0).sum(-1).float().mean().item()
            window.append((loss, mse, l0, 1 - mse / variance))
            if i % config.log_every == 0 or i == config.steps:
                means = [sum(column) / len(window) for column in zip(*window)]
                for series, value in zip((log.loss, log.mse, log.l0, log.explained_variance), means):
                    series.append(value)
                log.steps.append(i)
                report(f"step {i:>5}  loss {means[0]:10.4f}  mse {means[1]:10.4f}  L0 {means[2]:7.1f}  "
                       f"explained variance {means[3]:6.3f}")
                window = []
    return dataclasses.replace(log, dead_fraction=float((since_fired > config.dead_window).float().mean()))
