"""What a token loader reads: the stored arrays of the chosen layers, looked up in the merged
index, and the contiguous byte ranges (blocks) that an epoch reads them in.

Rows are kept in storage order: shard by shard (sorted by path: machine, process, shard number),
position by position; within a machine's shard that is sample-id order. One layer's arrays of one
shard are consecutive in the file (a shard holds each layer's list whole), so a run of
neighbouring samples is one ranged read per layer: a *block*. An epoch reads every block once:
in storage order, or, shuffled, in a random order.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

import numpy as np
import pyarrow.compute as pc

from activations.index import arrays_path, merged_metadata_path, read_parquet
from activations.reader import coalesced_reads
from common.cli import UserError
from common.files import read_optional

ARRAY_COLUMNS = ["sample_id", "layer", "shard_path", "position", "byte_offset", "byte_length", "dtype", "shape"]


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


def _read_index(path: str, what: str, **kwargs):
    try:
        return read_parquet(path, **kwargs)
    except FileNotFoundError:
        raise UserError(f"no {what} at {path!r}") from None
    except Exception as e:
        raise UserError(f"cannot read {what} {path!r}: {str(e).splitlines()[0]}") from None


def stored_arrays(index: str, layers: Sequence[int]) -> StoredArrays:
    """The arrays of ``layers`` of every sample of the merged ``index`` (``index.parquet`` with
    its ``index_arrays.parquet`` beside it, as ``pipeline.index`` writes them)."""
    if not layers:
        raise UserError("name at least one layer to read")
    samples = _read_index(index, "merged index", columns=["sample_id", "machine_id", "num_tokens"])
    what = "per-array index (pipeline.index writes it beside the index)"
    arrays = _read_index(arrays_path(index), what, columns=ARRAY_COLUMNS,
                         filters=[("layer", "in", list(layers))])
    missing = sorted(set(layers) - set(pc.unique(arrays["layer"]).to_pylist()))
    if missing:
        stored = sorted(pc.unique(_read_index(arrays_path(index), what, columns=["layer"])["layer"]).to_pylist())
        raise UserError(f"layer(s) {missing} not stored under this index (it has layers {stored})")
    samples = samples.to_pandas().set_index("sample_id")
    frames = {l: arrays.filter(pc.equal(arrays["layer"], l)).to_pandas()
              .sort_values(["shard_path", "position"], ignore_index=True) for l in layers}
    del arrays
    first = frames[layers[0]]
    for layer, frame in frames.items():
        _check_layer(layer, frame, first, samples)
    shard_paths, shard = np.unique(first["shard_path"].to_numpy(), return_inverse=True)
    shapes = {l: np.stack(f["shape"].to_numpy()) for l, f in frames.items()}  # [rows, 2] each
    hidden = np.unique(np.concatenate([s[:, 1] for s in shapes.values()]))
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
        num_tokens=shapes[layers[0]][:, 0].astype(np.int64),
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
    data = read_optional(merged_metadata_path(index))
    return json.loads(data) if data else {}


def blocks(stored: StoredArrays, rng: np.random.Generator | None, block_bytes: int) -> list[tuple[int, int]]:
    """One epoch's reads, as ``(start, stop)`` row ranges of ``stored``, in reading order: runs of
    neighbouring rows of one shard of at most ``block_bytes`` over all layers (a larger array is
    a block alone), in storage order, or with ``rng`` in a random order."""
    first = stored.layers[0]
    offsets, lengths = stored.offset[first].tolist(), stored.length[first].tolist()
    per_layer = max(1, block_bytes // len(stored.layers))
    out = []
    edges = [0, *(np.flatnonzero(np.diff(stored.shard)) + 1).tolist(), len(stored)]
    for lo, hi in zip(edges[:-1], edges[1:]):
        out += [(lo + a, lo + b) for a, b in coalesced_reads(offsets[lo:hi], lengths[lo:hi], max_bytes=per_layer)]
    if rng is not None:
        out = [out[i] for i in rng.permutation(len(out))]
    return out
