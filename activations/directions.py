"""The directions file: how directions in a model's activation space travel from what finds them
(``runners.probe``: ``probing/``) to what uses them (steering: ``interventions/``).

``activation-directions/1``: one ``.npz`` (``np.load(path)``, no pickle) holding
``metadata``, a JSON string (the format, the model, the label and its two values, the index,
the token selection, and per array its site, layer, width and kind), and one float32 [width]
array per (kind, site, layer), named ``KIND/blocks.L.SITE``:

    diff_in_means/blocks.12.hook_resid_post   mean of the positive value's tokens minus the
                                              negative's (the stored statistics, float64 sums)
    probe/blocks.12.hook_resid_post           the probe's weight toward the positive value, unit norm

The diff-in-means keeps its length (the distance between the two means: the natural scale of an
added direction); a probe's weight has none of its own.
"""

from __future__ import annotations

import functools
import io
import json
from typing import Any

import numpy as np

from common.cli import UserError
from common.files import read_optional, write_bytes
from model.sites import ArrayKey, hook_name, key_parts

FORMAT = "activation-directions/1"
KINDS = ("diff_in_means", "probe")  # the first is what a steering takes where the file has both


def array_name(kind: str, key: ArrayKey) -> str:
    return f"{kind}/{hook_name(*key_parts(key))}"


def write_directions(path: str, directions: dict[tuple[str, ArrayKey], np.ndarray], metadata: dict[str, Any]) -> None:
    """Writes ``directions`` ((kind, key) -> [width]) and ``metadata`` as one ``.npz`` (local or gs://)."""
    arrays = {array_name(kind, key): np.asarray(vector, np.float32) for (kind, key), vector in directions.items()}
    described = {**metadata, "format": FORMAT,
                 "arrays": {array_name(kind, key): {"kind": kind, "site": key_parts(key)[0], "layer": key_parts(key)[1],
                                                    "width": int(len(vector))}
                            for (kind, key), vector in directions.items()}}
    out = io.BytesIO()
    np.savez(out, metadata=np.array(json.dumps(described)), **arrays)
    write_bytes(path, out.getvalue())


@functools.lru_cache(maxsize=8)  # a grid's steerings read their file once, not once a batch
def read_directions(path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays by name, metadata) of a directions file (not to be modified: cached by path);
    one line when it is none."""
    data = read_optional(path)
    if data is None:
        raise UserError(f"no directions file at {path!r}")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        metadata = json.loads(str(arrays.pop("metadata")))
    except (ValueError, KeyError, OSError) as e:
        raise UserError(f"{path!r} is not a directions file ({e})") from None
    if metadata.get("format") != FORMAT:
        raise UserError(f"{path!r} is a {metadata.get('format')!r} file, not {FORMAT}")
    return arrays, metadata
