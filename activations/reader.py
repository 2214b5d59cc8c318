"""Reading shards back, safely, from local disk or ``gs://``.

Whole shards: ``load_shard`` unpickles with a restricted unpickler that only reconstructs plain
containers and numpy arrays (a tampered shard cannot run code); ``iter_activations`` looks samples
up through the per-sample index and opens each shard once.

One array at a time: ``read_activation`` / ``read_activations`` use the per-(sample, layer) index
(``*_arrays.parquet``): one ranged read per array (or per run of nearby arrays of a shard),
decompressing only that gzip member, whose CRC is checked: a corrupted or truncated shard raises
``CorruptShardError`` naming the shard and offset, never returns wrong data.

A store of float8 rows (``model.quantize``) reads back dequantized, as float32 rows, unless a
reader is asked not to (``dequantize=False``: ``Float8Rows``, the rows and their scales as stored).
"""

from __future__ import annotations

import gzip
import io
import pickle
import zlib
from typing import IO, Any, Iterable, Iterator, Sequence

import numpy as np
from isal import igzip, isal_zlib

from activations.index import index_beside_arrays
from common.cli import UserError
from common.files import open_read, read_range
from model.config import FLOAT8
from model.quantize import Float8Rows
from model.sites import ArrayKey, array_key, key_parts, normalized_key

COALESCE_GAP_BYTES = 1 << 20  # nearby arrays of one shard are fetched in one read


class CorruptShardError(IOError):
    """An array's bytes in a shard do not decompress or verify."""

ALLOWED_GLOBALS = {
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy", "float32"), ("numpy", "float16"), ("numpy", "int64"),
    ("ml_dtypes", "bfloat16"), ("ml_dtypes", "float8_e4m3fn"),
    ("builtins", "tuple"), ("builtins", "list"), ("builtins", "dict"),
    ("_codecs", "encode"),  # numpy pickles raw array bytes of some dtypes through it
}


class UnsafeShardError(pickle.UnpicklingError):
    """A shard asked to construct something other than containers and numpy arrays."""


class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise UnsafeShardError(f"shard refers to {module}.{name}: only plain containers and "
                                   "numpy arrays may be unpickled")
        return super().find_class(module, name)


def _load_from(f: IO[bytes]) -> dict:
    """Unpickles a shard from a seekable binary file, through a streaming gzip reader if gzipped
    (``gzip.decompress`` copies the remaining data once per member: quadratic in members)."""
    magic = f.read(2)
    f.seek(0)
    source = gzip.GzipFile(fileobj=f, mode="rb") if magic == b"\x1f\x8b" else f
    return RestrictedUnpickler(source).load()


def loads_shard(data: bytes) -> dict:
    """A shard document from its file bytes (gzip detected by its magic number)."""
    return _load_from(io.BytesIO(data))


def load_shard(path: str) -> dict:
    """The whole shard at a local or ``gs://`` path, streamed."""
    with open_read(path) as f:
        return _load_from(f)


def iter_activations(index: Any, sample_ids: Iterable[int], layer: ArrayKey,
                     dequantize: bool = True) -> Iterator[tuple[int, np.ndarray | Float8Rows]]:
    """(sample_id, activation [num_tokens, width]) for each requested id, through the index;
    ``layer``: an array key (a layer, or a site's hook name: ``model.sites``). Float8 rows come
    dequantized (float32), or with ``dequantize=False`` as ``Float8Rows``.

    ``index``: the merged index as a pandas DataFrame, a pyarrow Table or a Parquet path.
    Shards are read once each, in shard order; ids missing from the index raise ``KeyError``.
    """
    table = _index_frame(index)
    wanted = list(dict.fromkeys(int(i) for i in sample_ids))
    rows = table.set_index("sample_id").reindex(wanted)
    missing = rows[rows["shard_path"].isna()].index.tolist()
    if missing:
        raise KeyError(f"sample ids not in the index: {missing[:10]}")
    for shard_path, group in rows.groupby("shard_path", sort=True):
        entries = load_shard(shard_path)[normalized_key(layer)]
        for sample_id, position in zip(group.index, group["position"]):
            entry = entries[int(position)]
            if entry["sample_id"] != sample_id:
                raise ValueError(f"index puts sample {sample_id} at position {position} of "
                                 f"{shard_path}, which holds sample {entry['sample_id']}")
            yield int(sample_id), entry_rows(entry, dequantize)


def entry_rows(entry: dict, dequantize: bool = True) -> np.ndarray | Float8Rows:
    """The rows of one shard entry: its ``activation``, or stored as float8 (with its ``scale``)
    dequantized to float32, or with ``dequantize=False`` its ``Float8Rows``."""
    if "scale" not in entry:
        if entry["activation"].dtype == storage_dtype(FLOAT8):
            raise CorruptShardError(f"sample {entry['sample_id']}: float8 rows without their scales")
        return entry["activation"]
    rows = Float8Rows(entry["activation"], entry["scale"])
    return rows.dequantized() if dequantize else rows


def _index_frame(index: Any):
    import pyarrow as pa
    from activations.index import read_parquet
    if isinstance(index, str):
        index = read_parquet(index)
    if isinstance(index, pa.Table):
        index = index.to_pandas()
    return index


def decode_array(data: bytes | memoryview, dtype: str, shape: Sequence[int], compressed: bool,
                 where: str) -> np.ndarray:
    """One array from its bytes in a shard: its own gzip member (compressed shard), CRC- and
    length-checked, or its raw bytes. ``where`` names the shard and place for the error message."""
    if compressed:
        try:
            # isal: 3x zlib's speed here, the same CRC-32 and length check, the GIL released.
            data = igzip.decompress(data)
        except (OSError, EOFError, zlib.error, isal_zlib.error) as e:
            raise CorruptShardError(f"corrupt gzip member in {where}: {e}") from None
    numpy_dtype = storage_dtype(dtype)
    expected = int(np.prod(shape)) * numpy_dtype.itemsize
    if len(data) != expected:
        raise CorruptShardError(f"wrong array size in {where}: {len(data)} bytes, expected {expected}")
    return np.frombuffer(data, dtype=numpy_dtype).reshape(tuple(shape))


def _decode_row(data: bytes, row: dict) -> np.ndarray:
    where = (f"{row['shard_path']} at byte {row['byte_offset']} (sample {row['sample_id']}, "
             f"{row.get('site') or 'layer'} {row['layer']})")
    if len(data) != row["byte_length"]:
        raise CorruptShardError(f"shard truncated: {where}: got {len(data)} of {row['byte_length']} bytes")
    return decode_array(data, row["dtype"], row["shape"], row["shard_path"].endswith(".gz"), where)


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype of a stored dtype name (``bfloat16`` and ``float8_e4m3fn`` through ``ml_dtypes``)."""
    if name in ("bfloat16", FLOAT8):
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def read_activation(row: dict, dequantize: bool = True) -> np.ndarray | Float8Rows:
    """The array of one row of the arrays index (``shard_path``, ``byte_offset``, ``byte_length``,
    ``dtype``, ``shape``, ...), with one ranged read (float8 rows: through their scales, right
    after them; dequantized unless ``dequantize`` is False)."""
    start = int(row["byte_offset"])
    return _decoded_rows(read_range(row["shard_path"], start, _extent(row)), 0, row, dequantize)


def _scaled(row: dict) -> bool:
    """Whether an arrays-index row is stored as float8 (its scales located beside it)."""
    offset = row.get("scale_offset")
    return offset is not None and offset == offset  # pandas gives NaN for a null


def _extent(row: dict) -> int:
    """The bytes from a row's first byte to its last: its array's, through its scales if any."""
    if not _scaled(row):
        return int(row["byte_length"])
    return int(row["scale_offset"]) + int(row["scale_length"]) - int(row["byte_offset"])


def _decoded_rows(data: bytes, lo: int, row: dict, dequantize: bool) -> np.ndarray | Float8Rows:
    """The rows of an arrays-index row from ``data``, which holds the row's extent from ``lo``."""
    values = _decode_row(data[lo:lo + int(row["byte_length"])], row)
    if not _scaled(row):
        if row["dtype"] == FLOAT8:
            raise UserError(f"sample {row['sample_id']}'s {row.get('site') or 'layer'} {row['layer']} is stored as "
                            "float8 but the arrays index has no scales for it (scale_offset): merge the index again "
                            "with pipeline.index")
        return values
    at = lo + int(row["scale_offset"]) - int(row["byte_offset"])
    scale = decode_array(data[at:at + int(row["scale_length"])], "float32", values.shape[:1],
                         row["shard_path"].endswith(".gz"), f"{row['shard_path']} at byte {int(row['scale_offset'])} "
                         f"(the scales of sample {row['sample_id']}, {row.get('site') or 'layer'} {row['layer']})")
    rows = Float8Rows(values, scale)
    return rows.dequantized() if dequantize else rows


def coalesced_reads(offsets: Sequence[int], lengths: Sequence[int], max_gap: int = COALESCE_GAP_BYTES,
                    max_bytes: int | None = None) -> list[tuple[int, int]]:
    """Ranges of one file, sorted by offset, grouped into reads: ``(start, stop)`` index runs
    whose neighbours lie at most ``max_gap`` bytes apart and whose span stays within
    ``max_bytes`` (a range longer than that is a read alone)."""
    runs, start = [], 0
    for i in range(1, len(offsets) + 1):
        if i < len(offsets):
            gap = offsets[i] - (offsets[i - 1] + lengths[i - 1])
            span = offsets[i] + lengths[i] - offsets[start]
            if gap <= max_gap and (max_bytes is None or span <= max_bytes):
                continue
        runs.append((start, i))
        start = i
    return runs if len(offsets) else []


def read_activations(arrays_index: Any, sample_ids: Iterable[int], layers: Iterable[ArrayKey],
                     tokens: str | None = None, index: str | None = None,
                     dequantize: bool = True) -> dict[tuple[int, ArrayKey], np.ndarray | Float8Rows]:
    """{(sample_id, key): array} for every requested pair; ``layers`` holds array keys: a layer
    number for block outputs, or a site's hook name (``blocks.12.hook_mlp_out``; ``model.sites``).
    Reads that touch the same shard within ``COALESCE_GAP_BYTES`` of each other are merged into
    one ranged read. ``tokens``: only the rows of a token selection (``activations.selection``;
    pooled: their mean, one row), by the tokens table of the merged ``index`` (default: the
    ``index.parquet`` beside an ``index_arrays.parquet`` path). Float8 rows come dequantized
    (float32), or with ``dequantize=False`` as ``Float8Rows`` (a selection's rows of them; a mean
    of them only dequantized)."""
    sample_ids = [int(i) for i in sample_ids]
    out = _read_arrays(arrays_index, sample_ids, layers, dequantize)
    if tokens is None:
        return out
    if index is None and not isinstance(arrays_index, str):
        raise UserError("a token selection reads the index's tokens table: pass index= (the merged index.parquet)")
    return _selected(out, tokens, index or index_beside_arrays(arrays_index))


def _selected(arrays: dict[tuple[int, ArrayKey], np.ndarray], tokens: str,
              index: str) -> dict[tuple[int, ArrayKey], np.ndarray]:
    """Each array's rows that the selection ``tokens`` keeps (pooled: their mean)."""
    from activations.selection import parse_selection, pooled_row
    from activations.stored_tokens import kept_rows, read_stored_tokens
    selection = parse_selection(tokens)
    stored = read_stored_tokens(index, sorted({sample_id for sample_id, _ in arrays}))
    out = {}
    for (sample_id, key), array in arrays.items():
        rows, _ = kept_rows(selection, stored, sample_id)
        if isinstance(array, Float8Rows):
            if selection.pooled:
                raise UserError(f"tokens={tokens!r} pools rows into their mean, which has no stored float8 form: "
                                "read it with dequantize=True")
            out[(sample_id, key)] = Float8Rows(array.values[rows], array.scale[rows])
        else:
            out[(sample_id, key)] = pooled_row(array[rows]) if selection.pooled else array[rows]
    return out


def _read_arrays(arrays_index: Any, sample_ids: list[int], layers: Iterable[ArrayKey],
                 dequantize: bool = True) -> dict[tuple[int, ArrayKey], np.ndarray | Float8Rows]:
    table = _index_frame(arrays_index)
    keys = {normalized_key(k) for k in layers}
    table = table[table["sample_id"].isin(set(int(i) for i in sample_ids))
                  & table["layer"].isin({key_parts(k)[1] for k in keys})]
    row_keys = frame_keys(table)
    wanted = table[[key in keys for key in row_keys]].assign(key=[k for k in row_keys if k in keys])
    out = {}
    for shard_path, group in wanted.sort_values("byte_offset").groupby("shard_path", sort=True):
        rows = group.to_dict("records")
        extents = [_extent(r) for r in rows]
        for start, end in coalesced_reads([r["byte_offset"] for r in rows], extents):
            first = rows[start]["byte_offset"]
            span = rows[end - 1]["byte_offset"] + extents[end - 1] - first
            data = read_range(shard_path, int(first), int(span))
            for row in rows[start:end]:
                out[(int(row["sample_id"]), row["key"])] = _decoded_rows(data, int(row["byte_offset"] - first), row,
                                                                         dequantize)
    return out


def frame_keys(frame) -> list[ArrayKey]:
    """The array key of each row of a per-array index (a pandas frame): its layer, or with a
    ``site`` other than the block output, the hook name."""
    layers = frame["layer"].astype(int).tolist()
    if "site" not in frame.columns:
        return layers
    return [array_key(site, layer) for site, layer in zip(frame["site"].tolist(), layers)]
