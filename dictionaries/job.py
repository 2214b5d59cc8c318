"""The dictionary training job: a merged store read through the token loader's global shuffle, one
compiled step a batch (``dictionaries.training``), checkpoints that make a kill -9 cost nothing but
the steps since the last one, and SAELens's files at the end.

    run(TrainingConfig(index="out/index.parquet", site="blocks.12.hook_resid_post", output_dir="sae"),
        DictionaryConfig(architecture="topk", k=32), OptimizerConfig(lr=3e-4))

Exactly once: the state (weights, Adam's moments, the step, the firing counts, BatchTopK's running
threshold) and the settings are one file, ``checkpoint.npz``, replaced atomically every
``checkpoint_every`` steps. The loader's stream is a function of its seed and epoch, so a resume
takes up at the batch after the checkpoint's (whole epochs skipped by count, the rest of one read
and dropped) and ends with the weights an uninterrupted run ends with. ``metrics.csv`` gains each
step's row when its checkpoint is written; a resume cuts rows past the checkpoint, so every step
is there once.

Normalisation (``--normalize``, on by default): each site scaled by the store's statistics to
tokens of norm sqrt(width) on average (SAELens's ``expected_average_only_in``, measured in the
extraction's compiled step instead of over batches), folded into the saved weights.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import os
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from activations.index import store_model
from activations.token_loader import LoaderConfig, TokenBatch, TokenLoader
from common.cli import UserError, flag
from common.extras import require
from common.files import write_atomically
from dictionaries.config import DTYPES, DictionaryConfig, OptimizerConfig
from dictionaries.optimizer import coefficient, learning_rate
from dictionaries.sae import init_params
from dictionaries.saelens_format import saved_architecture, write_saelens
from dictionaries.training import State, initial_state, train_step
from model.run_settings import changed_settings
from model.sites import describe_key, key_parts, hook_name, normalized_key

log = logging.getLogger("dictionaries.job")
CHECKPOINT_FILE, METRICS_FILE = "checkpoint.npz", "metrics.csv"
METRICS = ("step", "tokens", "lr", "coefficient", "loss", "mse_loss", "sparsity_loss", "auxiliary_loss",
           "explained_variance", "l0", "dead")


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """What the job reads, how long it trains and where it writes."""
    index: str = flag(help="the store's merged index.parquet (pipeline.index)")
    site: str = flag(help="the input: a layer (its block output) or a stored site's hook name")
    output_dir: str = flag(help="where the checkpoint, metrics.csv and SAELens's files go")
    target: str | None = flag(None, "a transcoder's output site (e.g. blocks.L.hook_mlp_out for "
                              "blocks.L.ln2.hook_normalized); none: an SAE of --site")
    steps: int = flag(1000, "training steps")
    batch_tokens: int = flag(4096, "tokens a step")
    seed: int = flag(0, "seed of the initialisation and of the store's shuffle")
    buffer_tokens: int = flag(1 << 18, "the shuffle buffer's tokens (activations.token_loader)")
    tokens: str | None = flag(None, "train on a token selection (activations.selection), e.g. -special")
    exclude_first_positions: int = flag(0, "leave out each sample's first k tokens (attention sinks)")
    normalize: bool = flag(True, "scale each site to mean norm sqrt(width) by the store's statistics "
                           "(folded into the saved weights)")
    dtype: str = flag("float32", f"the weights' dtype: {', '.join(DTYPES)}")
    tensorboard: bool = flag(True, "the metrics as TensorBoard events too (tensorboard/ in --output_dir; needs "
                             "the 'tracking' extra)")
    checkpoint_every: int = flag(200, "steps between checkpoints")
    log_every: int = flag(50, "steps between log lines")

    def validate(self) -> None:
        for name in ("steps", "batch_tokens", "checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.target is not None and normalized_key(self.target) == normalized_key(self.site):
            raise UserError(f"--target is --site ({self.site}): an SAE has no --target")

    @property
    def keys(self) -> tuple[Any, ...]:
        return (normalized_key(self.site),) + ((normalized_key(self.target),) if self.target else ())


@dataclasses.dataclass(frozen=True)
class TrainingResult:
    steps: int               # steps taken in all (the checkpoint's, on a resume)
    resumed_from: int        # the step a resume took up at (0: a new run)
    d_in: int
    d_sae: int
    d_out: int
    final: dict[str, float]  # the last logged window's mean metrics
    dead: int                # latents that fired in none of the last dead_feature_window steps
    tokens_per_s: float      # this process's, over the steps it took
    wait_share: float        # the share of its time spent waiting for batches
    output_dir: str


def settings(training: TrainingConfig, dictionary: DictionaryConfig, optimizer: OptimizerConfig) -> dict[str, Any]:
    """Every setting a resume must share, by flag name (the logging ones aside)."""
    found = {**dataclasses.asdict(dictionary), **dataclasses.asdict(optimizer), **dataclasses.asdict(training)}
    for name in ("checkpoint_every", "log_every", "output_dir", "tensorboard"):
        found.pop(name)
    return json.loads(json.dumps(found))  # tuples as lists, as a checkpoint reads them back


def open_loader(training: TrainingConfig) -> TokenLoader:
    """The store's tokens of the input (and target) sites, shuffled, in whole batches."""
    loader = TokenLoader(LoaderConfig(
        index=training.index, layers=training.keys, batch_tokens=training.batch_tokens, seed=training.seed,
        buffer_tokens=max(training.buffer_tokens, training.batch_tokens), drop_last=True,
        tokens=training.tokens, exclude_first_positions=training.exclude_first_positions,
        normalize="mean_norm" if training.normalize else "none"))
    if loader.total_tokens < training.batch_tokens:
        raise UserError(f"{training.index!r}: {int(loader.kept_tokens.sum())} tokens to train on, fewer than one "
                        f"batch (--batch_tokens {training.batch_tokens})")
    return loader


def batches_from(loader: TokenLoader, start: int) -> Iterator[TokenBatch]:
    """Batches without end (epoch after epoch), from the ``start``-th: whole epochs skipped by count."""
    per_epoch = loader.total_tokens // loader.config.batch_tokens
    epoch, skip = divmod(start, per_epoch)
    while True:
        for i, batch in enumerate(loader.batches(epoch)):
            if i >= skip:
                yield batch
        epoch, skip = epoch + 1, 0


def run(training: TrainingConfig, dictionary: DictionaryConfig, optimizer: OptimizerConfig) -> TrainingResult:
    """Trains (or resumes) one dictionary and writes it in SAELens's layout; see the module's docstring."""
    for config in (training, dictionary):
        config.validate()
    optimizer.validate(training.steps)
    saved_architecture(dictionary, transcoder=training.target is not None)  # a TopK transcoder: refused now
    loader = open_loader(training)
    input_key, target_key = training.keys[0], training.keys[-1]
    d_in, d_out = loader.stored.width[input_key], loader.stored.width[target_key]
    d_sae = dictionary.width(d_in)
    if dictionary.architecture == "matryoshka_batchtopk" and dictionary.matryoshka_widths[-1] > d_sae:
        raise UserError(f"--matryoshka_widths end at {dictionary.matryoshka_widths[-1]}, past --d_sae {d_sae}")
    dtype = jnp.float64 if training.dtype == "float64" else jnp.float32
    current = settings(training, dictionary, optimizer)
    os.makedirs(training.output_dir, exist_ok=True)
    state = resumed_state(training.output_dir, current)
    start = 0 if state is None else int(state["step"])
    if state is None:
        state = initial_state(init_params(dictionary, d_in, d_out, jax.random.key(training.seed), dtype))
    cut_metrics(training.output_dir, start)
    events = open_events(training, start)
    log.info("%s %s of %d latents on %s%s: steps %d..%d of %d tokens", "resuming" if start else "training",
             dictionary.architecture, d_sae, describe_key(input_key),
             f" -> {describe_key(target_key)}" if training.target else "", start, training.steps, training.batch_tokens)
    steps, final, waited, began = StepLog(training.batch_tokens), {}, 0.0, time.perf_counter()
    stream = batches_from(loader, start)
    for step in range(start, training.steps):
        t0 = time.perf_counter()
        batch = next(stream)
        waited += time.perf_counter() - t0
        x = jnp.asarray(batch.activations[input_key], dtype)
        y = jnp.asarray(batch.activations[target_key], dtype) if training.target else x
        lr = learning_rate(optimizer, step, training.steps)
        weight = step_coefficient(dictionary, step)
        state, metrics = train_step(state, x, y, jnp.asarray(lr, dtype), jnp.asarray(weight, dtype),
                                    config=dictionary, optimizer=optimizer, sae=training.target is None)
        steps.add(step, lr, weight, metrics)
        if (step + 1) % training.log_every == 0 or step + 1 == training.steps:
            final = mean_row(steps.take_window())
            log_window(final, step + 1, training, time.perf_counter() - began, start)
        if (step + 1) % training.checkpoint_every == 0 or step + 1 == training.steps:
            rows = steps.take_rows()
            append_metrics(training.output_dir, rows)
            write_events(events, rows)
            write_checkpoint(training.output_dir, state, current)
    stream.close()  # the loader's reading threads
    if events is not None:
        events.close()
    elapsed = max(time.perf_counter() - began, 1e-9)
    write_dictionary(training, dictionary, loader, state)
    dead = int(jnp.sum(state["since_fired"] > optimizer.dead_feature_window))
    taken = training.steps - start
    return TrainingResult(training.steps, start, d_in, d_sae, d_out, final, dead,
                          taken * training.batch_tokens / elapsed, waited / elapsed, training.output_dir)


class StepLog:
    """Each step's metrics, kept on the device until a log line or a checkpoint reads them: reading
    them at once would wait for the step, and the next batch's read would not overlap it."""

    def __init__(self, batch_tokens: int):
        self.batch_tokens = batch_tokens
        self.pending: list[tuple[int, float, float, dict[str, jax.Array]]] = []  # since the last checkpoint
        self.rows: list[dict[str, float]] = []    # the first of them, read back
        self.window: list[dict[str, float]] = []  # rows read since the last log line

    def add(self, step: int, lr: float, weight: float, metrics: dict[str, jax.Array]) -> None:
        self.pending.append((step, lr, weight, metrics))

    def _read(self) -> None:
        new = [metrics_row(step, self.batch_tokens, *rest) for step, *rest in self.pending[len(self.rows):]]
        self.rows += new
        self.window += new

    def take_window(self) -> list[dict[str, float]]:
        """The rows since the last log line."""
        self._read()
        window, self.window = self.window, []
        return window

    def take_rows(self) -> list[dict[str, float]]:
        """The rows since the last checkpoint."""
        self._read()
        rows, self.rows, self.pending = self.rows, [], []
        return rows


def step_coefficient(dictionary: DictionaryConfig, step: int) -> float:
    """The scheduled sparsity weight: standard's L1, jumprelu's L0 (0 for the top-k kinds)."""
    if dictionary.architecture == "standard":
        return coefficient(dictionary.l1_coefficient, dictionary.l1_warm_up_steps, step)
    if dictionary.architecture == "jumprelu":
        return coefficient(dictionary.l0_coefficient, dictionary.l0_warm_up_steps, step)
    return 0.0


def metrics_row(step: int, batch_tokens: int, lr: float, weight: float,
                metrics: dict[str, jax.Array]) -> dict[str, float]:
    """A step's ``metrics.csv`` row (the sparsity terms summed, the auxiliary ones summed)."""
    losses = {k: float(v) for k, v in metrics.items()}
    sparsity = sum(v for k, v in losses.items() if k in ("l1_loss", "l0_loss", "pre_act_loss"))
    auxiliary = sum(v for k, v in losses.items() if k == "auxiliary_reconstruction_loss" or k.startswith("inner_"))
    return {"step": step, "tokens": (step + 1) * batch_tokens, "lr": lr, "coefficient": weight,
            "loss": losses["loss"], "mse_loss": losses["mse_loss"], "sparsity_loss": sparsity,
            "auxiliary_loss": auxiliary, "explained_variance": losses["explained_variance"], "l0": losses["l0"],
            "dead": int(losses["dead"])}


def mean_row(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([r[k] for r in rows])) for k in ("loss", "mse_loss", "explained_variance", "l0")} | {
        "dead": rows[-1]["dead"]}


def log_window(m: dict[str, float], done: int, training: TrainingConfig, elapsed: float, start: int) -> None:
    """One progress line: the window's mean losses (``mean_row``), tokens/s and the time left."""
    rate = (done - start) * training.batch_tokens / max(elapsed, 1e-9)
    left = (training.steps - done) * training.batch_tokens / max(rate, 1e-9)
    log.info("step %d/%d: loss %.4g, mse %.4g, explained variance %.3f, L0 %.1f, dead %d; %.0f tokens/s, %.0f s left",
             done, training.steps, m["loss"], m["mse_loss"], m["explained_variance"], m["l0"], m["dead"], rate, left)


def open_events(training: TrainingConfig, start: int) -> Any:
    """A TensorBoard event writer (None where off) whose readers drop what a killed run logged from
    ``start`` on (``purge_step``): each step's values once, as in metrics.csv."""
    if not training.tensorboard:
        return None
    writer = require("tensorboardX", "tracking", "--tensorboard").SummaryWriter
    return writer(os.path.join(training.output_dir, "tensorboard"), purge_step=start or None)


def write_events(events: Any, rows: list[dict[str, float]]) -> None:
    if events is None:
        return
    for row in rows:
        for name in METRICS[2:]:
            events.add_scalar(f"train/{name}", row[name], row["step"])
    events.flush()


def flat_state(state: State) -> dict[str, np.ndarray]:
    """The state as named arrays (``params/W_enc``, ``moments/m/W_enc``, ``step``, ...)."""
    out = {f"params/{k}": np.asarray(v) for k, v in state["params"].items()}
    for which, moments in state["moments"].items():
        out.update({f"moments/{which}/{k}": np.asarray(v) for k, v in moments.items()})
    out.update({k: np.asarray(state[k]) for k in ("step", "since_fired", "topk_threshold")})
    return out


def nested_state(arrays: dict[str, np.ndarray]) -> State:
    state: State = {"params": {}, "moments": {"m": {}, "v": {}}}
    for name, value in arrays.items():
        if name == "settings":
            continue
        parts, value = name.split("/"), jnp.asarray(value)
        if parts[0] == "params":
            state["params"][parts[1]] = value
        elif parts[0] == "moments":
            state["moments"][parts[1]][parts[2]] = value
        else:
            state[name] = value
    return state


def write_checkpoint(output_dir: str, state: State, current: dict[str, Any]) -> None:
    """The state and the settings in one file, replaced atomically: a kill leaves this one or the last."""
    buffer = io.BytesIO()
    np.savez(buffer, settings=np.array(json.dumps(current, sort_keys=True)), **flat_state(state))
    write_atomically(os.path.join(output_dir, CHECKPOINT_FILE), buffer.getvalue())


def resumed_state(output_dir: str, current: dict[str, Any]) -> State | None:
    """The checkpoint's state (None: no checkpoint); refused where it was written with other settings."""
    path = os.path.join(output_dir, CHECKPOINT_FILE)
    if not os.path.exists(path):
        return None
    with np.load(path) as saved:
        arrays = {name: saved[name] for name in saved.files}
    stored = json.loads(str(arrays["settings"]))
    changed = changed_settings(stored, current)
    if changed:
        raise UserError(f"{path} was written with other settings ({'; '.join(changed)}): resume with the same "
                        "ones, or train into another --output_dir")
    return nested_state(arrays)


def cut_metrics(output_dir: str, start: int) -> None:
    """``metrics.csv`` holding only the steps before ``start`` (those a killed run wrote past its checkpoint cut)."""
    path = os.path.join(output_dir, METRICS_FILE)
    if not os.path.exists(path):
        return
    with open(path, newline="") as f:
        kept = [row for row in csv.DictReader(f) if int(row["step"]) < start]
    text = io.StringIO()
    writer = csv.DictWriter(text, METRICS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(kept)
    write_atomically(path, text.getvalue().encode())


def append_metrics(output_dir: str, rows: list[dict[str, float]]) -> None:
    path = os.path.join(output_dir, METRICS_FILE)
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, METRICS, lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())


def write_dictionary(training: TrainingConfig, dictionary: DictionaryConfig, loader: TokenLoader,
                     state: State) -> None:
    """SAELens's files in ``output_dir``, the activation scales folded in."""
    def scale(key) -> float:
        return float(loader.scaling[key][1][0]) if key in loader.scaling else 1.0
    input_key, target_key = training.keys[0], training.keys[-1]
    metadata = {"hook_name": _hook(input_key),
                "model_name": store_model(loader.metadata)["model"],
                "dataset_path": training.index, "exclude_first_positions": training.exclude_first_positions,
                "tokens": training.tokens}
    if training.target:
        metadata["hook_name_out"] = _hook(target_key)
    write_saelens(training.output_dir, dictionary, state["params"], float(state["topk_threshold"]),
                  training.target is not None, metadata, scale(input_key), scale(target_key))


def _hook(key) -> str:
    site, layer = key_parts(key)
    return hook_name(site, layer)
