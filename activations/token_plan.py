"""What a token loader reads: the stored arrays of the chosen keys (layers, or the hook names of
other sites: ``model.sites``), looked up in the merged index, and the contiguous byte ranges
(blocks) that an epoch reads them in.

Rows are kept in storage order: shard by shard (sorted by path: machine, process, shard number),
position by position; within a machine's shard that is sample-id order. One key's arrays of one
shard are consecutive in the file (a shard holds each key's list whole), so a run of
neighbouring samples is one ranged read per key: a *block*. An epoch reads every block once:
in storage order, or, shuffled, in a random order.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from activations.index import arrays_path, merged_metadata_path, read_parquet
from activations.reader import coalesced_reads, frame_keys
from activations.selection import Selection
from activations.stored_tokens import StoredTokens, read_stored_tokens, store_selection
from common.cli import UserError
from common.files import read_optional
from model.config import FLOAT8
from model.sites import PATTERNS, RESID_POST, ArrayKey, describe_key, key_parts, normalized_key

ARRAYS_WHAT = "per-array index (pipeline.index writes it beside the index)"
# Why a pattern site (model.sites.PATTERNS) is refused wherever rows of one width are read.
VARIABLE_WIDTH = ("its rows are each token's [heads, keys] flattened, n_heads x the sample's tokens wide (a width per "
                  "sample), not the one width a token batch, an export, a probe or a dashboard reads; read them as "
                  "stored with activations.reader.read_activations")


def check_fixed_width(what: str, site: str) -> None:
    """``UserError`` in one line, ``what: why``, where ``site`` is a pattern site: its rows differ in
    width by sample, so no [batch, width] batch, export column, probe or feature holds them."""
    if site in PATTERNS:
        raise UserError(f"{what}: {VARIABLE_WIDTH}")


@dataclasses.dataclass
class StoredArrays:
    """The selected samples' arrays, one row per sample in storage order; per key, where each
    array lies in its shard. Every column is a numpy array over the rows."""
    keys: tuple[ArrayKey, ...]
    shard_paths: list[str]
    shard: np.ndarray         # [rows] int32: index into shard_paths
    position: np.ndarray      # [rows] int64: place in the shard's lists
    sample_id: np.ndarray     # [rows] int64
    machine_id: np.ndarray    # [rows] int64
    num_tokens: np.ndarray    # [rows] int64: stored rows (the arrays' first dimension): tokens, or selected ones
    sample_tokens: np.ndarray  # [rows] int64: the sample's tokens (the index's num_tokens)
    offset: dict[ArrayKey, np.ndarray]   # key -> [rows] int64: byte offset of the array (its gzip member)
    length: dict[ArrayKey, np.ndarray]   # key -> [rows] int64
    dtype: dict[ArrayKey, str]           # key -> stored dtype name
    width: dict[ArrayKey, int]           # key -> the arrays' last dimension
    metadata: dict[str, Any]             # merged_metadata.json beside the index ({} if absent)
    selection: Selection | None = None   # the token selection the store was made with (None: every token)
    tokens: StoredTokens | None = None   # the index's tokens table, for a store made with a selection
    # Keys stored as float8 (model.quantize) -> [rows] int64: where each array's scales lie, right after it.
    scale_offset: dict[ArrayKey, np.ndarray] = dataclasses.field(default_factory=dict)
    scale_length: dict[ArrayKey, np.ndarray] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sample_id)

    def rows(self, chosen: np.ndarray) -> StoredArrays:
        """These rows alone (indices or a [rows] bool mask, kept in storage order): a part of the
        store, e.g. its held-out samples or one process's share of an epoch."""
        chosen = np.flatnonzero(chosen) if np.asarray(chosen).dtype == bool else np.sort(np.asarray(chosen, np.int64))
        per_row = {f.name: getattr(self, f.name)[chosen] for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), np.ndarray)}
        per_key = {name: {k: v[chosen] for k, v in getattr(self, name).items()}
                   for name in ("offset", "length", "scale_offset", "scale_length")}
        return dataclasses.replace(self, **per_row, **per_key)

    @functools.cached_property
    def extent(self) -> dict[ArrayKey, np.ndarray]:
        """Per key, [rows] int64: the bytes from each array's first to its last, through its scales if any."""
        return {key: self.scale_offset[key] + self.scale_length[key] - self.offset[key]
                if key in self.scale_offset else self.length[key] for key in self.keys}


def read_index_table(path: str, what: str, **kwargs) -> pa.Table:
    """An index Parquet file (``what``, for the error), ``kwargs`` to ``read_parquet``; one line
    when it is missing or unreadable."""
    try:
        return read_parquet(path, **kwargs)
    except FileNotFoundError:
        raise UserError(f"no {what} at {path!r}") from None
    except Exception as e:
        raise UserError(f"cannot read {what} {path!r}: {str(e).splitlines()[0]}") from None


def stored_arrays(index: str, keys: Sequence[ArrayKey]) -> StoredArrays:
    """The arrays of ``keys`` (layers or hook names, normalised by ``model.sites.normalized_key``)
    of every sample of the merged ``index`` (``index.parquet`` with its ``index_arrays.parquet``
    beside it, as ``pipeline.index`` writes them); a pattern site's refused (``check_fixed_width``)."""
    if not keys:
        raise UserError("name at least one layer to read")
    keys = [normalized_key(k) for k in keys]
    for key in keys:
        check_fixed_width(describe_key(key), key_parts(key)[0])
    samples = read_index_table(index, "merged index", columns=["sample_id", "machine_id", "num_tokens"])
    arrays = read_index_table(arrays_path(index), ARRAYS_WHAT,
                         filters=[("layer", "in", sorted({key_parts(k)[1] for k in keys}))])
    samples = samples.to_pandas().set_index("sample_id")
    frames = {k: _key_rows(arrays, k).to_pandas().sort_values(["shard_path", "position"], ignore_index=True)
              for k in keys}
    del arrays
    missing = [k for k, frame in frames.items() if frame.empty]
    if missing:
        raise UserError(f"{', '.join(map(describe_key, missing))} not stored under this index (it has "
                        f"{', '.join(map(describe_key, _stored_keys(index)))})")
    first = frames[keys[0]]
    selection, stored, rows = store_selection(index), None, samples["num_tokens"]
    if selection is not None:  # the store holds the rows of its selection: as many as the tokens table says
        stored = read_stored_tokens(index)
        rows = pd.Series(stored.rows, index=stored.ids)
    for key, frame in frames.items():
        _check_key(key, frame, first, keys[0], samples, rows)
    shard_paths, shard = np.unique(first["shard_path"].to_numpy(), return_inverse=True)
    shapes = {k: np.stack(f["shape"].to_numpy()) for k, f in frames.items()}  # [rows, 2] each
    return StoredArrays(
        keys=tuple(keys), shard_paths=list(shard_paths), shard=shard.astype(np.int32),
        position=first["position"].to_numpy(np.int64), sample_id=first["sample_id"].to_numpy(np.int64),
        machine_id=samples.loc[first["sample_id"], "machine_id"].to_numpy(np.int64),
        num_tokens=shapes[keys[0]][:, 0].astype(np.int64),
        sample_tokens=samples.loc[first["sample_id"], "num_tokens"].to_numpy(np.int64),
        offset={k: f["byte_offset"].to_numpy(np.int64) for k, f in frames.items()},
        length={k: f["byte_length"].to_numpy(np.int64) for k, f in frames.items()},
        dtype={k: _only(f["dtype"], k, "dtypes") for k, f in frames.items()},
        width={k: _only(s[:, 1], k, "widths") for k, s in shapes.items()},
        metadata=_merged_metadata(index), selection=selection, tokens=stored,
        scale_offset={k: f["scale_offset"].to_numpy(np.int64) for k, f in frames.items() if _scaled(f)},
        scale_length={k: f["scale_length"].to_numpy(np.int64) for k, f in frames.items() if _scaled(f)})


def _scaled(frame) -> bool:
    """Whether a key's arrays are stored as float8, with their scales; ``UserError`` where float8
    arrays lack them (an arrays index merged by a ``pipeline.index`` from before float8)."""
    float8 = (frame["dtype"] == FLOAT8).to_numpy()
    if not float8.any():
        return False
    located = frame["scale_offset"].notna().to_numpy() if "scale_offset" in frame.columns else np.zeros_like(float8)
    if not located[float8].all():
        raise UserError("the arrays index locates no scales for some float8 arrays (scale_offset): merge the index "
                        "again with pipeline.index")
    return True


def _key_rows(arrays: pa.Table, key: ArrayKey) -> pa.Table:
    """The rows of one key; an index without a ``site`` column (written before sites existed)
    holds block outputs only."""
    site, layer = key_parts(key)
    rows = pc.equal(arrays["layer"], layer)
    if "site" in arrays.column_names:
        rows = pc.and_(rows, pc.equal(arrays["site"], site))
    elif site != RESID_POST:
        rows = pc.and_(rows, pa.scalar(False))
    return arrays.filter(rows)


def _stored_keys(index: str) -> list[ArrayKey]:
    """Every key the per-array index holds (for messages: it reads the whole table)."""
    frame = read_index_table(arrays_path(index), ARRAYS_WHAT).to_pandas()
    frame = frame.drop_duplicates(["layer", "site"] if "site" in frame.columns else ["layer"])
    return sorted(set(frame_keys(frame)), key=lambda k: key_parts(k)[::-1])


def _only(values, key: ArrayKey, what: str):
    """The one value of ``values``; ``UserError`` if the key's arrays have several."""
    distinct = sorted(set(np.asarray(values).tolist()))
    if len(distinct) != 1:
        raise UserError(f"the stored arrays of {describe_key(key)} have several {what} ({distinct})")
    return distinct[0]


def _check_key(key: ArrayKey, frame, first, first_key: ArrayKey, samples, rows) -> None:
    """Every sample of the index has this key's array, beside the first key's, of its stored
    length (``rows``, by sample id: its tokens, or the rows its selection kept)."""
    what = describe_key(key)
    if len(frame) != len(samples) or not frame["sample_id"].isin(samples.index).all():
        absent = samples.index.difference(frame["sample_id"])
        example = f" (e.g. sample {absent[0]})" if len(absent) else ""
        raise UserError(f"{what}: the per-array index has {len(frame)} arrays for "
                        f"{len(samples)} samples{example}: merge the index again with pipeline.index")
    if not (frame["sample_id"].to_numpy() == first["sample_id"].to_numpy()).all():
        raise UserError(f"{what}'s arrays are not stored beside {describe_key(first_key)}'s")
    lengths = np.stack(frame["shape"].to_numpy())[:, 0]
    expected = rows.reindex(frame["sample_id"]).to_numpy()
    if not (lengths == expected).all():
        bad = frame["sample_id"].to_numpy()[lengths != expected][0]
        raise UserError(f"sample {bad}: its {what} array's length differs from the rows the index says it stored")


def _merged_metadata(index: str) -> dict[str, Any]:
    data = read_optional(merged_metadata_path(index))
    return json.loads(data) if data else {}


def blocks(stored: StoredArrays, rng: np.random.Generator | None, block_bytes: int) -> list[tuple[int, int]]:
    """One epoch's reads, as ``(start, stop)`` row ranges of ``stored``, in reading order: runs of
    neighbouring rows of one shard of at most ``block_bytes`` over all keys (a larger array is
    a block alone), in storage order, or with ``rng`` in a random order."""
    first = stored.keys[0]
    offsets, lengths = stored.offset[first].tolist(), stored.extent[first].tolist()
    # The first key's share of the budget, by width (its arrays are planned; the others follow).
    first_share = max(1, block_bytes * stored.width[first] // sum(stored.width.values()))
    out = []
    edges = [0, *(np.flatnonzero(np.diff(stored.shard)) + 1).tolist(), len(stored)]
    for lo, hi in zip(edges[:-1], edges[1:]):
        out += [(lo + a, lo + b) for a, b in coalesced_reads(offsets[lo:hi], lengths[lo:hi], max_bytes=first_share)]
    if rng is not None:
        out = [out[i] for i in rng.permutation(len(out))]
    return out
