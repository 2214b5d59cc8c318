"""What a training job keeps across a kill: the checkpoint (every dictionary's state and the
settings, one file replaced atomically), ``metrics.csv`` (each step's row once) and TensorBoard
events (each step's values once, by ``purge_step``); and each step's metrics, kept on the device
until read (``StepLog``)."""

from __future__ import annotations

import csv
import io
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from common.cli import UserError
from common.extras import require
from common.files import write_atomically
from dictionaries.training import State
from model.run_settings import changed_settings

CHECKPOINT_FILE, METRICS_FILE = "checkpoint.npz", "metrics.csv"
METRICS = ("step", "dictionary", "tokens", "lr", "coefficient", "loss", "mse_loss", "sparsity_loss",
           "auxiliary_loss", "explained_variance", "l0", "dead")


class StepLog:
    """Each step's metrics, kept on the device until a log line or a checkpoint reads them: reading
    them at once would wait for the step, and the next batch's read would not overlap it."""

    def __init__(self, batch_tokens: int, names: list[str]):
        self.batch_tokens, self.names = batch_tokens, names
        self.pending: list[tuple[int, float, float, list[dict[str, jax.Array]]]] = []  # since the last checkpoint
        self.rows: list[dict[str, Any]] = []    # the first of them, read back (one a dictionary and step)
        self.window: list[dict[str, Any]] = []  # rows read since the last log line

    def add(self, step: int, lr: float, weight: float, metrics: list[dict[str, jax.Array]]) -> None:
        self.pending.append((step, lr, weight, metrics))

    def _read(self) -> None:
        read = len(self.rows) // len(self.names)
        new = [metrics_row(step, name, self.batch_tokens, lr, weight, found)
               for step, lr, weight, per_dictionary in self.pending[read:]
               for name, found in zip(self.names, per_dictionary)]
        self.rows += new
        self.window += new

    def take_window(self) -> list[dict[str, Any]]:
        """The rows since the last log line."""
        self._read()
        window, self.window = self.window, []
        return window

    def take_rows(self) -> list[dict[str, Any]]:
        """The rows since the last checkpoint."""
        self._read()
        rows, self.rows, self.pending = self.rows, [], []
        return rows


def metrics_row(step: int, name: str, batch_tokens: int, lr: float, weight: float,
                metrics: dict[str, jax.Array]) -> dict[str, Any]:
    """A step's ``metrics.csv`` row of one dictionary (the sparsity terms summed, the auxiliary ones summed)."""
    losses = {k: float(v) for k, v in metrics.items()}
    sparsity = sum(v for k, v in losses.items() if k in ("l1_loss", "l0_loss", "pre_act_loss"))
    auxiliary = sum(v for k, v in losses.items() if k == "auxiliary_reconstruction_loss" or k.startswith("inner_"))
    return {"step": step, "dictionary": name, "tokens": (step + 1) * batch_tokens, "lr": lr, "coefficient": weight,
            "loss": losses["loss"], "mse_loss": losses["mse_loss"], "sparsity_loss": sparsity,
            "auxiliary_loss": auxiliary, "explained_variance": losses["explained_variance"], "l0": losses["l0"],
            "dead": int(losses["dead"])}


def mean_rows(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each dictionary's mean losses over ``rows`` and its last dead count."""
    out = {}
    for name in dict.fromkeys(r["dictionary"] for r in rows):
        mine = [r for r in rows if r["dictionary"] == name]
        out[name] = {k: float(np.mean([r[k] for r in mine])) for k in ("loss", "mse_loss", "explained_variance",
                                                                        "l0")} | {"dead": mine[-1]["dead"]}
    return out


def open_events(output_dir: str, start: int) -> Any:
    """A TensorBoard event writer whose readers drop what a killed run logged from ``start`` on
    (``purge_step``): each step's values once, as in metrics.csv."""
    writer = require("tensorboardX", "tracking", "--tensorboard").SummaryWriter
    return writer(os.path.join(output_dir, "tensorboard"), purge_step=start or None)


def write_events(events: Any, rows: list[dict[str, Any]], several: bool) -> None:
    """The rows as scalars ``train/{metric}`` (``{dictionary}/train/{metric}`` where there are several)."""
    if events is None:
        return
    for row in rows:
        prefix = f"{row['dictionary']}/" if several else ""
        for name in METRICS[3:]:
            events.add_scalar(f"{prefix}train/{name}", row[name], row["step"])
    events.flush()


def flat_state(states: list[State]) -> dict[str, np.ndarray]:
    """Every dictionary's state as named arrays (``0/params/W_enc``, ``0/moments/m/W_enc``, ``0/step``, ...)."""
    out = {}
    for i, state in enumerate(states):
        out.update({f"{i}/params/{k}": np.asarray(v) for k, v in state["params"].items()})
        for which, moments in state["moments"].items():
            out.update({f"{i}/moments/{which}/{k}": np.asarray(v) for k, v in moments.items()})
        out.update({f"{i}/{k}": np.asarray(state[k]) for k in ("step", "since_fired", "topk_threshold")})
    return out


def nested_states(arrays: dict[str, np.ndarray]) -> list[State]:
    states: dict[int, State] = {}
    for name, value in arrays.items():
        if name == "settings":
            continue
        index, *parts = name.split("/")
        state = states.setdefault(int(index), {"params": {}, "moments": {"m": {}, "v": {}}})
        if parts[0] == "params":
            state["params"][parts[1]] = value
        elif parts[0] == "moments":
            state["moments"][parts[1]][parts[2]] = value
        else:
            state[parts[0]] = jnp.asarray(value)
    return [states[i] for i in sorted(states)]


def write_checkpoint(output_dir: str, states: list[State], current: dict[str, Any]) -> None:
    """The states (numpy) and the settings in one file, replaced atomically: a kill leaves this one or the last."""
    buffer = io.BytesIO()
    np.savez(buffer, settings=np.array(json.dumps(current, sort_keys=True)), **flat_state(states))
    write_atomically(os.path.join(output_dir, CHECKPOINT_FILE), buffer.getvalue())


def resumed_states(output_dir: str, current: dict[str, Any]) -> list[State] | None:
    """The checkpoint's states, as numpy arrays (None: no checkpoint); refused where it was written
    with other settings."""
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
    return nested_states(arrays)


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


def append_metrics(output_dir: str, rows: list[dict[str, Any]]) -> None:
    path = os.path.join(output_dir, METRICS_FILE)
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, METRICS, lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
