"""A linear probe's fit and held-out score, with scikit-learn.

The split is by group (``--group_column``: a sample, or a conversation of several): a seeded
share of the groups is held out, every row of a group on one side, never both. A categorical
label gets an L2-regularised logistic regression (``C = 1 / regularization``; several classes:
multinomial), scored by accuracy; a numeric one ridge regression (``alpha = regularization``),
scored by R^2. Both in float64, on the stored values as they are (no rescaling), so that a
probe's weight is a direction of the stored space.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np
import pyarrow as pa

from common.cli import UserError
from common.extras import require

TASKS = ("auto", "classification", "regression")


def task_of(label_type: pa.DataType, requested: str) -> str:
    """``classification`` or ``regression``: ``auto`` gives regression to a float label."""
    if requested != "auto":
        if requested == "regression" and not (pa.types.is_integer(label_type) or pa.types.is_floating(label_type)):
            raise UserError(f"--task regression needs a numeric label, not {label_type}")
        return requested
    return "regression" if pa.types.is_floating(label_type) else "classification"


def held_out(groups: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """[rows] bool: the rows whose group is in the held-out share (a seeded draw of the distinct
    groups, at least one and at least one left to train on)."""
    names = np.array(sorted({repr(g) for g in groups.tolist()}), dtype=object)
    if len(names) < 2:
        raise UserError(f"{len(names)} group(s) of rows: a held-out split needs at least 2 (see --group_column)")
    count = min(len(names) - 1, max(1, round(fraction * len(names))))
    test = set(np.random.default_rng(seed).permutation(names)[:count].tolist())
    return np.array([repr(g) in test for g in groups.tolist()], bool)


@dataclasses.dataclass
class Probe:
    """A fit probe: ``coef`` [outputs, width] and ``intercept`` [outputs] (a binary classifier
    or a regression: one output, toward ``classes[1]`` for the former), ``classes`` its label
    values (None for a regression)."""
    model: Any                   # the scikit-learn estimator
    coef: np.ndarray
    intercept: np.ndarray
    classes: list | None

    @property
    def converged(self) -> bool:
        """Whether the solver stopped before its iteration limit (ridge: always)."""
        iterations = getattr(self.model, "n_iter_", None)
        return iterations is None or bool(np.max(iterations) < getattr(self.model, "max_iter", np.inf))

    def score(self, features: np.ndarray, labels: np.ndarray) -> float:
        """Accuracy (classification) or R^2 (regression) on these rows."""
        return float(self.model.score(np.asarray(features, np.float64), _targets(labels, self.classes)))


def fit_probe(features: np.ndarray, labels: np.ndarray, task: str, regularization: float) -> Probe:
    """A probe of ``task`` fit on ``features`` [rows, width] against ``labels`` [rows]."""
    linear_model = require("sklearn.linear_model", "probes", "runners.probe")
    x = np.asarray(features, np.float64)
    if task == "classification":
        classes = sorted(set(labels.tolist()))
        model = linear_model.LogisticRegression(C=1 / regularization, max_iter=2000)
        model.fit(x, _targets(labels, classes))
    else:
        classes = None
        model = linear_model.Ridge(alpha=regularization)
        model.fit(x, _targets(labels, None))
    return Probe(model, np.atleast_2d(model.coef_).astype(np.float64), np.atleast_1d(model.intercept_), classes)


def _targets(labels: np.ndarray, classes: list | None) -> np.ndarray:
    """Class numbers (by ``classes``' order), or the values as float64."""
    if classes is None:
        return np.asarray(labels.tolist(), np.float64)
    number = {value: i for i, value in enumerate(classes)}
    return np.array([number.get(value, -1) for value in labels.tolist()], np.int64)


def nearest_mean_accuracy(features: np.ndarray, labels: np.ndarray, means: dict[Any, np.ndarray]) -> float:
    """The accuracy of labelling each row by the nearest class mean (two classes: which side of
    the midpoint its projection on the diff-in-means falls)."""
    classes = list(means)
    centres = np.stack([means[c] for c in classes])                        # [classes, width]
    x = np.asarray(features, np.float64)
    distances = (x**2).sum(1)[:, None] - 2 * x @ centres.T + (centres**2).sum(1)[None]  # [rows, classes]
    chosen = np.array(classes, dtype=object)[distances.argmin(1)]
    return float(np.mean([a == b for a, b in zip(chosen.tolist(), labels.tolist())]))


def training_means(features: np.ndarray, labels: np.ndarray) -> dict[Any, np.ndarray]:
    """Each label value's mean [width] float64 over the rows ``features`` [rows, width] that carry it."""
    values, x = labels.tolist(), np.asarray(features, np.float64)
    return {value: x[[v == value for v in values]].mean(axis=0) for value in sorted(set(values))}


def majority_accuracy(train_labels: np.ndarray, labels: np.ndarray) -> float:
    """The accuracy of labelling every row with the training rows' commonest value (on a tie, the
    one first in sorted order): what a probe must beat to have read anything."""
    counts = collections.Counter(train_labels.tolist())
    commonest = max(sorted(counts), key=counts.__getitem__)  # max keeps the first of equal counts
    return float(np.mean([value == commonest for value in labels.tolist()]))
