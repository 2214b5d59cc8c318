"""Directions from the store's statistics: the diff-in-means of a label's two values, per site and
layer (written with the probe's weights as a directions file, ``activations.directions``)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from activations.index import read_index_file, stats_path
from activations.site_stats import STATS_SCHEMA, GroupKey, label_text, table_moments
from model.sites import ArrayKey


def label_means(index: str, keys: Sequence[ArrayKey], label: str, values: Sequence[Any],
                ) -> dict[ArrayKey, dict[Any, np.ndarray]] | None:
    """Per key, each label value's mean [width] float64 over its stored tokens, from the
    statistics the runners kept by the label (``--stats_by LABEL``); None where they kept none."""
    try:
        moments = table_moments(read_index_file(stats_path(index), STATS_SCHEMA))
    except FileNotFoundError:
        return None
    out = {}
    for key in keys:
        groups = {value: moments.get(GroupKey(key, label, label_text(value))) for value in values}
        if any(m is None for m in groups.values()):
            return None
        out[key] = {value: m.mean for value, m in groups.items()}
    return out
