"""Directions from the store's statistics: the diff-in-means of a label's two values, per site and
layer (written with the probe's weights as a directions file, ``activations.directions``)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from activations.index import store_moments
from activations.site_stats import GroupKey, label_text
from model.sites import ArrayKey


def label_means(index: str, keys: Sequence[ArrayKey], label: str, values: Sequence[Any],
                ) -> dict[ArrayKey, dict[Any, np.ndarray]] | None:
    """Per key, each label value's mean [width] float64 over its stored tokens, from the
    statistics the runners kept by the label (``--stats_by LABEL``); None where they kept none.
    ``UserError`` where the store has no statistics, or none of every row it stores (``store_moments``)."""
    moments = store_moments(index)
    out = {}
    for key in keys:
        groups = {value: moments.get(GroupKey(key, label, label_text(value))) for value in values}
        if any(m is None for m in groups.values()):
            return None
        out[key] = {value: m.mean for value, m in groups.items()}
    return out
