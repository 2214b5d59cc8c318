"""What a token loader reads: the stored arrays of the chosen layers, looked up in the merged
index, and the contiguous byte ranges (blocks) that an epoch reads them in.

Rows are kept in storage order (shard, then position). One layer's arrays of one shard are
consecutive in the file (a shard holds each layer's list whole), so a run of neighbouring
samples is one ranged read per layer: a *block*. A shuffled epoch reads every block once, in a
random order; an unshuffled one reads samples in sample-id order, each run of them that lies
side by side in a shard as one block.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

import numpy as np
import pyarrow.compute as pc

from activations.index import arrays_path, read_parquet
from common.cli import UserError
from common.files import read_optional


@dataclasses.dataclass
class StoredArrays:
    """The selected samples' arrays, one row per sample in storage order; per layer, where each
    array lies in its shard. Every column is a numpy array over the rows."""
    layers: tuple[int, ...]
    shard_paths: list[str]
    shard: np.ndarray         # [rows] int32: index into shard_paths
    position: np.ndarray      # [rows] int64: place in the shard's lists
    sample_id: np.ndarray     # [rows] int64
    machine_id: np.ndarray    # [rows] int64
    num_tokens: np.ndarray    # [rows] int64: stored tokens (the arrays' first dimension)
    offset: dict[int, np.ndarray]   # layer -> [rows] int64: byte offset of the array (its gzip member)
    length: dict[int, np.ndarray]   # layer -> [rows] int64
    dtype: dict[int, str]           # layer -> stored dtype name
    hidden_size: int
    metadata: dict[str, Any]        # merged_metadata.json beside the index ({} if absent)

    def __len__(self) -> int:
        return len(self.sample_id)


def _read_parquet(path: str, what: str, **kwargs):
    try:
        return read_parquet(path, **kwargs)
    except FileNotFoundError:
        raise UserError(f"no {what} at {path!r}") from None
    except Exception as e:
        raise UserError(f"cannot read {what} {path!r}: {str(e).splitlines()[0]}") from None


def stored_arrays(index: str, layers: Sequence[int]) -> StoredArrays:
    """The arrays of ``layers`` of every sample of the merged ``index`` (``index.parquet`` with
    its ``index_arrays.parquet`` beside it, as ``pipeline.index`` writes them)."""
    samples = _read_parquet(index, "merged index", columns=["sample_id", "machine_id", "num_tokens"])
    arrays = _read_parquet(arrays_path(index), "per-array index (pipeline.index writes it beside "
                           "the index)", columns=["sample_id", "layer", "shard_path", "position",
                                                  "byte_offset", "byte_length", "dtype", "shape"])
    stored = sorted(pc.unique(arrays["layer"]).to_pylist())
    missing = [l for l in layers if l not in stored]
    if missing:
        raise UserError(f"layer(s) {missing} not stored under this index (it has layers {stored})")
    samples = samples.to_pandas().set_index("sample_id")
    frames = {l: arrays.filter(pc.equal(arrays["layer"], l)).to_pandas()
              .sort_values(["shard_path", "position"], ignore_index=True) for l in layers}
    first = frames[layers[0]]
    for layer, frame in frames.items():
        _check_layer(layer, frame, first, samples)
    shard_paths, shard = np.unique(first["shard_path"].to_numpy(), return_inverse=True)
    shapes = np.stack(first["shape"].to_numpy())  # [rows, 2]
    hidden = np.unique(np.concatenate([np.stack(f["shape"].to_numpy())[:, 1] for f in frames.values()]))
    if len(hidden) != 1:
        raise UserError(f"the stored arrays have several hidden sizes ({hidden.tolist()})")
    dtypes = {l: frame["dtype"].unique().tolist() for l, frame in frames.items()}
    mixed = {l: d for l, d in dtypes.items() if len(d) != 1}
    if mixed:
        raise UserError(f"layer(s) stored in several dtypes: {mixed}")
    return StoredArrays(
        layers=tuple(layers), shard_paths=list(shard_paths), shard=shard.astype(np.int32),
        position=first["position"].to_numpy(np.int64), sample_id=first["sample_id"].to_numpy(np.int64),
        machine_id=samples.loc[first["sample_id"], "machine_id"].to_numpy(np.int64),
        num_tokens=shapes[:, 0].astype(np.int64),
        offset={l: f["byte_offset"].to_numpy(np.int64) for l, f in frames.items()},
        length={l: f["byte_length"].to_numpy(np.int64) for l, f in frames.items()},
        dtype={l: d[0] for l, d in dtypes.items()}, hidden_size=int(hidden[0]),
        metadata=_merged_metadata(index))


def _check_layer(layer: int, frame, first, samples) -> None:
    """Every sample of the index has this layer's array, beside the first layer's, of its length."""
    if len(frame) != len(samples) or not frame["sample_id"].isin(samples.index).all():
        absent = samples.index.difference(frame["sample_id"])
        example = f" (e.g. sample {absent[0]})" if len(absent) else ""
        raise UserError(f"layer {layer}: the per-array index has {len(frame)} arrays for "
                        f"{len(samples)} samples{example}: merge the index again with pipeline.index")
    if not (frame["sample_id"].to_numpy() == first["sample_id"].to_numpy()).all():
        raise UserError(f"layer {layer}'s arrays are not stored beside layer {first['layer'].iloc[0]}'s")
    lengths = np.stack(frame["shape"].to_numpy())[:, 0]
    expected = samples.loc[frame["sample_id"], "num_tokens"].to_numpy()
    if not (lengths == expected).all():
        bad = frame["sample_id"].to_numpy()[lengths != expected][0]
        raise UserError(f"sample {bad}: its layer {layer} array's length differs from num_tokens in the index")


def _merged_metadata(index: str) -> dict[str, Any]:
    folder = index.rsplit("/", 1)[0] if "/" in index else "."
    data = read_optional(f"{folder}/merged_metadata.json")
    return json.loads(data) if data else {}


def blocks(arrays: StoredArrays, rng: np.random.Generator | None, block_bytes: int) -> list[tuple[int, int]]:
    """One epoch's reads, as ``(start, stop)`` row ranges of ``arrays``, in reading order.

    With ``rng``: runs of neighbouring rows of at most ``block_bytes`` (over all layers; a larger
    array is a block alone), in a random order. Without: rows in sample-id order, each run of
    them that is contiguous in its shard one block (same size cap)."""
    if not len(arrays):
        return []
    order = np.arange(len(arrays)) if rng is not None else np.argsort(arrays.sample_id, kind="stable")
    size = sum(arrays.length.values())  # [rows] bytes over all layers
    out, start, held = [], int(order[0]), int(size[order[0]])
    for prev, row in zip(order[:-1].tolist(), order[1:].tolist()):
        adjacent = (row == prev + 1 and arrays.shard[row] == arrays.shard[prev]
                    and arrays.position[row] == arrays.position[prev] + 1)
        if adjacent and held + size[row] <= block_bytes:
            held += int(size[row])
            continue
        out.append((start, prev + 1))
        start, held = row, int(size[row])
    out.append((start, int(order[-1]) + 1))
    if rng is not None:
        out = [out[i] for i in rng.permutation(len(out))]
    return out
