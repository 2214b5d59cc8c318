"""An experiment's results: ``results.parquet`` (one row per intervention x sample), which makes a
re-run skip what is done, and ``summary.csv`` (one row per intervention, against the baseline).

results.parquet columns: intervention (its canonical spec; ``baseline`` for the unablated model),
kind, layer, head, mode (for an intervention of one atom, else null), sample_id, source, loss,
accuracy, kl, scored_tokens, truncated, resid_change (per block: mean over the sample's tokens of
|r - r0| / |r0|).

summary.csv columns: intervention, kind, layer, head, mode, samples (those with scored tokens),
loss, delta_loss with delta_loss_low / delta_loss_high (a 95% bootstrap interval over samples),
accuracy, delta_accuracy, kl.
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from interventions.spec import BASELINE, Intervention

RESULTS_FILE, SUMMARY_FILE = "results.parquet", "summary.csv"
SCHEMA = pa.schema([
    ("intervention", pa.string()), ("kind", pa.string()), ("layer", pa.int32()), ("head", pa.int32()),
    ("mode", pa.string()), ("sample_id", pa.int64()), ("source", pa.string()), ("loss", pa.float64()),
    ("accuracy", pa.float64()), ("kl", pa.float64()), ("scored_tokens", pa.int32()),
    ("truncated", pa.bool_()), ("resid_change", pa.list_(pa.float32())),
])


def describe(intervention: Intervention) -> dict[str, Any]:
    """kind, layer, head, mode (a steering's ``FILE[:alpha=A]...``: what follows its layer) of a one-atom
    intervention (nulls otherwise)."""
    if len(intervention.atoms) != 1:
        return {"kind": None, "layer": None, "head": None, "mode": None}
    atom = intervention.atoms[0]
    # A steering's: what follows its layer (file, alpha, direction), the same at every layer of a grid.
    mode = str(atom).split(":", 2)[2] if atom.kind == "steer" else atom.mode
    return {"kind": atom.kind, "layer": atom.layer, "head": atom.head, "mode": mode}


def load_results(output_dir: str) -> pd.DataFrame:
    """The rows stored so far (none if there is no results.parquet yet)."""
    path = os.path.join(output_dir, RESULTS_FILE)
    if not os.path.exists(path):
        return SCHEMA.empty_table().to_pandas()
    return pq.read_table(path, schema=SCHEMA, use_threads=False).to_pandas()


def write_results(output_dir: str, frame: pd.DataFrame) -> None:
    """Rewrites results.parquet atomically (a crash leaves the previous one)."""
    path = os.path.join(output_dir, RESULTS_FILE)
    pq.write_table(pa.Table.from_pandas(frame, schema=SCHEMA, preserve_index=False), path + ".tmp")
    os.replace(path + ".tmp", path)


def bootstrap_interval(values: np.ndarray, resamples: int, rng: np.random.Generator) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the mean over resamples (with replacement) of values."""
    if len(values) == 0:
        return float("nan"), float("nan")
    means = values[rng.integers(0, len(values), (resamples, len(values)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def summarize(results: pd.DataFrame, order: Sequence[str], resamples: int, seed: int) -> pd.DataFrame:
    """One row per intervention (in ``order``, baseline first), each against the baseline on the
    same samples; samples without scored tokens left out."""
    scored = results[results["scored_tokens"] > 0]
    base = scored[scored["intervention"] == BASELINE].set_index("sample_id")
    rows = []
    for name in [BASELINE, *[n for n in order if n != BASELINE]]:
        mine = scored[scored["intervention"] == name].set_index("sample_id")
        both = mine.index.intersection(base.index)
        if not len(both):
            continue
        delta = (mine.loss[both] - base.loss[both]).to_numpy()
        # Each intervention its own stream of resamples: its interval does not depend on the grid.
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        low, high = bootstrap_interval(delta, resamples, rng)
        first = mine.iloc[0]
        rows.append({"intervention": name, "kind": first["kind"], "layer": first["layer"],
                     "head": first["head"], "mode": first["mode"], "samples": len(both),
                     "loss": mine.loss[both].mean(), "delta_loss": delta.mean(), "delta_loss_low": low,
                     "delta_loss_high": high, "accuracy": mine.accuracy[both].mean(),
                     "delta_accuracy": (mine.accuracy[both] - base.accuracy[both]).mean(),
                     "kl": mine.kl[both].mean()})
    frame = pd.DataFrame(rows, columns=["intervention", "kind", "layer", "head", "mode", "samples", "loss",
                                        "delta_loss", "delta_loss_low", "delta_loss_high", "accuracy",
                                        "delta_accuracy", "kl"])
    return frame.astype({"layer": "Int64", "head": "Int64", "samples": "int64"})
