"""Reading shards back, safely, from local disk or ``gs://``.

``load_shard`` unpickles with a restricted unpickler that only reconstructs plain containers and
numpy arrays: a tampered shard cannot run code. ``iter_activations`` looks samples up through the
merged Parquet index and opens each shard once.
"""

from __future__ import annotations

import gzip
import io
import pickle
from typing import Any, Iterable, Iterator

import numpy as np

from common.files import open_read

ALLOWED_GLOBALS = {
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy", "float32"), ("numpy", "float16"), ("numpy", "int64"),
    ("ml_dtypes", "bfloat16"),
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


def loads_shard(data: bytes) -> dict:
    """A shard document from its file bytes (gzip detected by its magic number)."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return RestrictedUnpickler(io.BytesIO(data)).load()


def load_shard(path: str) -> dict:
    """The whole shard at a local or ``gs://`` path."""
    with open_read(path) as f:
        return loads_shard(f.read())


def iter_activations(index: Any, sample_ids: Iterable[int], layer: int) -> Iterator[tuple[int, np.ndarray]]:
    """(sample_id, activation [num_tokens, hidden]) for each requested id, through the index.

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
        entries = load_shard(shard_path)[layer]
        for sample_id, position in zip(group.index, group["position"]):
            entry = entries[int(position)]
            if entry["sample_id"] != sample_id:
                raise ValueError(f"index puts sample {sample_id} at position {position} of "
                                 f"{shard_path}, which holds sample {entry['sample_id']}")
            yield int(sample_id), entry["activation"]


def _index_frame(index: Any):
    import pyarrow as pa
    import pyarrow.parquet as pq
    if isinstance(index, str):
        with open_read(index) as f:
            index = pq.read_table(f)
    if isinstance(index, pa.Table):
        index = index.to_pandas()
    return index
