"""The flat export layout (``activation-export-flat/1``): what ``pipeline.export --format flat``
writes, for trainers that read at disk speed, and the reader of it.

    EXPORT/export.json                        the manifest (written last: the export is complete)
    EXPORT/statistics.json                    per column, the statistics it was normalised by (if it was)
    EXPORT/shard_00000/blocks.12.hook_resid_post.npy   one contiguous [rows, width] array per column
    EXPORT/shard_00000/rows.parquet           the rows' provenance: sample_id, position, token_id, role

Every shard holds ``rows_per_shard`` rows (the last one fewer), drawn uniformly from the whole
export; row ``i`` of every array of a shard is the same token, described by row ``i`` of its
``rows.parquet``. A column of several stores is named ``STORE/blocks.L.SITE``; its file
``STORE__blocks.L.SITE.npy``. float32 and float16 arrays are plain ``.npy``; bfloat16 ones hold
the raw 16 bits (``.npy`` of ``<u2``; the manifest says ``bfloat16``): in torch,
``torch.from_numpy(np.load(path).view(np.int16)).view(torch.bfloat16)``, in numpy
``.view(ml_dtypes.bfloat16)``. A reader in ten lines needs the manifest's ``columns`` (name, file,
width, dtype) and ``shards`` (directory, rows) only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import json
import os
import re
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common.cli import UserError
from common.files import join, match, open_read, read_optional, write_bytes
from common.roles import ROLES

if TYPE_CHECKING:
    from activations.export_plan import ExportPlan

LAYOUT = "activation-export-flat/1"
MANIFEST, STATISTICS, ROWS = "export.json", "statistics.json", "rows.parquet"
SPILL_DIR = "_spill"  # what the export job spills while it runs (transforms.export), deleted at its end
# Each row's provenance, as the job carries it (a role as its code: common.roles, -1 unknown).
PROVENANCE = {"sample_id": np.int64, "position": np.int64, "token_id": np.int32, "role": np.int8}
ROWS_SCHEMA = pa.schema([("sample_id", pa.int64()), ("position", pa.int64()), ("token_id", pa.int32()),
                         ("role", pa.string())])


def shard_name(shard: int) -> str:
    return f"shard_{shard:05d}"


def array_file(column: str) -> str:
    """The file of a column in a shard's directory."""
    return column.replace("/", "__") + ".npy"


def npy_bytes(array: np.ndarray) -> bytes:
    """``array`` as ``.npy`` bytes; bfloat16 as its raw 16 bits."""
    if array.dtype.name == "bfloat16":
        array = array.view(np.uint16)
    out = io.BytesIO()
    np.save(out, np.ascontiguousarray(array), allow_pickle=False)
    return out.getvalue()


def write_shard(root: str, shard: int, arrays: dict[str, np.ndarray], rows: dict[str, np.ndarray]) -> int:
    """Writes one output shard (each column's [rows, width] array, the rows' provenance); the same
    bytes for the same rows whoever writes them (a retried write replaces them alike). Returns
    the bytes written."""
    folder = join(root, shard_name(shard))
    written = 0
    for column, values in arrays.items():
        data = npy_bytes(values)
        write_bytes(join(folder, array_file(column)), data)
        written += len(data)
    roles = rows["role"]
    table = pa.table({"sample_id": rows["sample_id"], "position": rows["position"], "token_id": rows["token_id"],
                      "role": pa.array([ROLES[c] if c >= 0 else None for c in roles.tolist()], pa.string())},
                     schema=ROWS_SCHEMA)
    out = io.BytesIO()
    pq.write_table(table, out, compression="zstd")
    write_bytes(join(folder, ROWS), out.getvalue())
    return written + out.tell()


# What a flat export's directory holds; anything else there is never replaced.
WRITTEN = re.compile(rf"{re.escape(MANIFEST)}|{re.escape(STATISTICS)}|{SPILL_DIR}|shard_\d+")


def write_statistics(root: str, statistics: dict[str, Any] | None) -> None:
    """``statistics.json``: per column, its store's statistics and what was applied (by the
    planner, before the job: the workers never carry them)."""
    if statistics:
        write_bytes(join(root, STATISTICS), json.dumps(statistics, indent=1).encode())


def check_output_dir(output_dir: str, overwrite: bool, written: re.Pattern = WRITTEN, what: str = "flat") -> None:
    """An export's directory (local or gs://, not a bucket's root) must hold nothing, or with
    ``overwrite`` an earlier export of its format (names matching ``written``; deleted once the
    new one is planned, so that none of its files stays among the new ones); anything else there
    is refused."""
    if "://" in output_dir and not output_dir.split("://", 1)[1].strip("/").count("/"):
        raise UserError(f"--output_dir {output_dir!r}: give a folder in the bucket, not its root")
    if "://" in output_dir:
        prefix = output_dir.rstrip("/") + "/"
        held = sorted({path[len(prefix):].split("/", 1)[0] for path in match(join(output_dir, "**"))})
    elif os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise UserError(f"{output_dir!r} is a file, not a directory: not replaced")
    else:
        held = sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []
    if held and not overwrite:
        raise UserError(f"{output_dir!r} exists and is not empty (pass --overwrite to replace an earlier export)")
    strange = [name for name in held if not written.fullmatch(name)]
    if strange:
        raise UserError(f"{output_dir!r} holds {strange[0]!r}, which no {what} export writes: not replaced")


@dataclasses.dataclass(frozen=True)
class FlatFormat:
    """The flat layout as an export job's ``transforms.export.ShardFormat``."""
    output_dir: str
    dtype: str                                 # float32 | float16 | bfloat16
    description: dict[str, Any]                # the selection and filters, for the manifest

    def write_shard(self, plan: "ExportPlan", shard: int, arrays: dict[str, np.ndarray],
                    provenance: dict[str, np.ndarray]) -> int:
        return write_shard(self.output_dir, shard, arrays, provenance)

    def finish(self, plan: "ExportPlan", shards: list[tuple[int, int, int]], dropped: dict[str, int]) -> dict[str, Any]:
        """``export.json``, written last."""
        manifest = {
            "layout": LAYOUT, "rows": plan.exported, "rows_per_shard": plan.rows_per_shard, "seed": plan.seed,
            "dtype": self.dtype, **self.description,
            "dropped_tokens": {**dropped, "max_tokens": plan.total - plan.exported},
            "columns": [{"name": name, "file": array_file(name), "store": plan.stores[store].name,
                         "key": str(key), "width": plan.widths[name], "dtype": self.dtype}
                        for name, (store, key) in plan.columns.items()],
            "stores": [{"name": s.name, "index": s.index} for s in plan.stores],
            "shards": [{"directory": shard_name(s), "rows": rows, "bytes": size} for s, rows, size in shards],
        }
        write_bytes(join(self.output_dir, MANIFEST), json.dumps(manifest, indent=1).encode())
        return manifest


class FlatExport:
    """A flat export, read: its manifest, and each shard's arrays (memory-mapped where local)."""

    def __init__(self, root: str):
        self.root = root
        data = read_optional(join(root, MANIFEST))
        if data is None:
            raise UserError(f"no {MANIFEST} in {root!r}: not a flat export, or one that did not finish")
        self.manifest = json.loads(data)
        if self.manifest.get("layout") != LAYOUT:
            raise UserError(f"{root!r} is a {self.manifest.get('layout')!r} export, not {LAYOUT}")
        self.columns = {c["name"]: c for c in self.manifest["columns"]}
        self.shards = self.manifest["shards"]

    @property
    def rows(self) -> int:
        return int(self.manifest["rows"])

    def path(self, shard: int, column: str) -> str:
        return join(self.root, self.shards[shard]["directory"], self.columns[column]["file"])

    def array(self, shard: int, column: str, mmap: bool = True) -> np.ndarray:
        """Shard ``shard``'s [rows, width] array of ``column``, in its dtype (memory-mapped where
        local and ``mmap``; read whole from gs://)."""
        path = self.path(shard, column)
        if "://" in path:
            return self._read_whole(shard, column)
        return _typed(np.load(path, mmap_mode="r" if mmap else None), self.columns[column]["dtype"])

    def provenance(self, shard: int) -> pa.Table:
        return pq.read_table(join(self.root, self.shards[shard]["directory"], ROWS))

    def batches(self, batch_rows: int, columns: list[str] | None = None, read_ahead: int = 2,
                ) -> Iterator[dict[str, np.ndarray]]:
        """Every row once, in order (the export is shuffled already), in batches of ``batch_rows``
        (``{column: [batch, width]}``; a shard's last batch may be shorter): each shard's arrays
        read whole, sequentially, by a thread ``read_ahead`` (>= 1) shards ahead of the consumer."""
        if batch_rows < 1 or read_ahead < 1:
            raise UserError(f"batch_rows and read_ahead must be at least 1, got {batch_rows} and {read_ahead}")
        columns = list(self.columns) if columns is None else columns
        unknown = [c for c in columns if c not in self.columns]
        if unknown:
            raise UserError(f"{unknown[0]!r} is no column of {self.root!r} (it has {', '.join(self.columns)})")
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="flat-reader")
        read = lambda shard: {c: self._read_whole(shard, c) for c in columns}
        pending = [pool.submit(read, s) for s in range(min(read_ahead, len(self.shards)))]
        try:
            for shard in range(len(self.shards)):
                arrays = pending.pop(0).result()
                if shard + read_ahead < len(self.shards):
                    pending.append(pool.submit(read, shard + read_ahead))
                rows = len(next(iter(arrays.values())))
                for start in range(0, rows, batch_rows):
                    yield {c: a[start:start + batch_rows] for c, a in arrays.items()}
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _read_whole(self, shard: int, column: str) -> np.ndarray:
        """A column's array of a shard, read into memory in one sequential read (local or gs://)."""
        path = self.path(shard, column)
        with open_read(path) as f:
            fmt = np.lib.format
            header = fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = header(f)
            count = int(np.prod(shape))
            values = (np.fromfile(f, dtype=dtype, count=count) if "://" not in path else
                      np.frombuffer(f.read(), dtype=dtype, count=count))
        return _typed(values.reshape(shape), self.columns[column]["dtype"])


def _typed(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes
        return values.view(ml_dtypes.bfloat16)
    return values
