"""The export as Beam transforms: ``ExportFlat`` writes a flat export (``activations.flat_layout``)
of an ``activations.export_plan.ExportPlan``.

    units of the leading store (runs of neighbouring samples of one shard: one ranged read per key)
      -> ReadUnit: every kept token of the unit, its columns from every store (joined on sample id
         and position), its slot from the plan's permutation; one chunk per output shard, spilled
      -> GroupByKey(output shard): references to the chunks only
      -> WriteShard: the shard's rows read and placed at their slots, written (each slot filled
         exactly once)
      -> the manifest, once every shard is written; the spill deleted

The chunks go to spill files (``{output_dir}/_spill/``, one per output shard's bytes of a worker's
bundle, a section an output shard), and only (path, offset, length) travels through the shuffle, as
``transforms.spill`` does for ``pipeline.prepare``: the local runner would hold every element
between stages in memory. A worker holds one unit's arrays (``block_bytes`` of shard, decoded) and
about an output shard of chunks while reading, and one output shard (``rows_per_shard`` rows of
every column, and its bytes as written) while writing, beside each store's plan and token ids (~50
bytes a sample and 4 a token: the provenance columns). The bytes written depend on the plan only:
the same for any number of workers, any bundling, any retry (a retried bundle spills to new files).
"""

from __future__ import annotations

import dataclasses
import io
import uuid
from typing import Any, Iterable, Iterator

import apache_beam as beam
import numpy as np
from apache_beam.transforms.window import GlobalWindows

from activations.export_plan import ExportPlan, permuted
from activations.flat_layout import LAYOUT, PROVENANCE, SPILL_DIR, array_file, shard_name, write_manifest, write_shard
from activations.reader import storage_dtype
from activations.stored_tokens import read_stored_tokens
from common.cli import UserError
from common.files import delete_tree, join, read_range, write_bytes

# A worker's chunks are gathered over its bundle's units and spilled together past an output shard's
# bytes, at most this many (and at the bundle's end): fewer, larger sections than one file a unit (a
# unit spreads its tokens over every output shard), for a worker's memory of about a shard more.
FLUSH_BYTES = 64 << 20
Section = tuple[str, int, int]  # a spill file's path, a chunk's offset and length in it


def spilled(root: str, chunks: dict[int, dict[str, np.ndarray]]) -> Iterator[tuple[int, Section]]:
    """Writes one unit's chunks (by output shard) into one new spill file under ``root``; yields
    (output shard, its section)."""
    path = join(root, SPILL_DIR, f"{uuid.uuid4().hex}.npz-sections")
    data, sections = io.BytesIO(), []
    for shard, chunk in chunks.items():
        start = data.tell()  # bfloat16 as its bits (.npy does not know it); WriteShard views them back
        np.savez(data, **{name: values.view(np.uint16) if values.dtype.name == "bfloat16" else values
                          for name, values in chunk.items()})
        sections.append((shard, (path, start, data.tell() - start)))
    write_bytes(path, data.getvalue())
    yield from sections


def read_section(section: Section) -> dict[str, np.ndarray]:
    path, offset, length = section
    with np.load(io.BytesIO(read_range(path, offset, length))) as arrays:
        return {name: arrays[name] for name in arrays.files}


@dataclasses.dataclass(frozen=True)
class ExportTarget:
    """Where and how the export is written."""
    output_dir: str
    dtype: str                       # float32 | float16 | bfloat16
    statistics: dict[str, Any] | None = None  # per column, what it was normalised by (statistics.json)


class ReadUnit(beam.DoFn):
    """A unit of the leading store -> (output shard, chunk): the chunk's ``slot`` [n] (row in the
    shard), each column [n, width] and the provenance columns, for its tokens bound there."""

    def __init__(self, plan: ExportPlan, root: str):
        self.plan, self.root = plan, root

    def setup(self) -> None:
        from activations.token_loader import TokenLoader
        self.loaders = [TokenLoader(c) for c in self.plan.loader_configs]
        self.rows = [dict(zip(loader.stored.sample_id.tolist(), range(len(loader.stored)))) for loader in self.loaders]
        try:  # the roles of the leading store's tokens (a store from before roles has none)
            self.roles = read_stored_tokens(self.plan.stores[0].index)
        except UserError:
            self.roles = None
        self.dropped = {reason: beam.metrics.Metrics.counter("export", f"dropped_{reason}")
                        for reason in ("selection", "first_positions", "token_ids")}
        self.exported = beam.metrics.Metrics.counter("export", "tokens")

    def start_bundle(self) -> None:
        self.pending: dict[int, list[dict[str, np.ndarray]]] = {}  # output shard -> chunks not yet spilled
        self.pending_bytes = 0

    def finish_bundle(self) -> Iterator:
        for element in self._flush():  # outputs of finish_bundle carry their window: the global one
            yield GlobalWindows.windowed_value(element)

    def _flush(self) -> Iterator[tuple[int, Section]]:
        """The gathered chunks spilled into one file, a section an output shard."""
        chunks = {shard: {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
                  for shard, parts in sorted(self.pending.items())}
        self.pending, self.pending_bytes = {}, 0
        if chunks:
            yield from spilled(self.root, chunks)

    def process(self, bounds: tuple[int, int]) -> Iterator[tuple[int, Section]]:
        plan, lead = self.plan, self.loaders[0]
        block = lead.read_block(tuple(bounds))
        for reason, n in block.dropped.items():
            self.dropped[reason].inc(n)
        parts = []
        for row, piece in zip(range(*bounds), block.pieces):
            if len(piece["positions"]):
                parts.append(self._tokens(row, piece))
        if not parts:
            return
        tokens = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        slots = permuted(tokens.pop("number"), plan.total, plan.seed)
        shard, tokens["slot"] = np.divmod(slots, plan.rows_per_shard)
        order = np.argsort(shard, kind="stable")
        shard = shard[order]
        edges = np.flatnonzero(np.diff(shard)) + 1
        for lo, hi in zip([0, *edges.tolist()], [*edges.tolist(), len(shard)]):
            chunk = {name: values[order[lo:hi]] for name, values in tokens.items()}
            self.pending.setdefault(int(shard[lo]), []).append(chunk)
            self.pending_bytes += sum(values.nbytes for values in chunk.values())
        self.exported.inc(len(slots))
        if self.pending_bytes >= min(FLUSH_BYTES, plan.shard_bytes):
            yield from self._flush()

    def _tokens(self, row: int, piece: dict[Any, np.ndarray]) -> dict[str, np.ndarray]:
        """One sample's kept tokens: their canonical numbers, columns and provenance."""
        plan = self.plan
        sample_id, positions = int(piece["sample_ids"][0]), piece["positions"]
        pieces = {0: piece}
        for store in sorted({i for i, _ in plan.columns.values()} - {0}):
            other = self.loaders[store].read_block((self.rows[store][sample_id], self.rows[store][sample_id] + 1))
            pieces[store] = other.pieces[0]
            if not np.array_equal(pieces[store]["positions"], positions):
                raise ValueError(f"store {plan.stores[store].name} keeps other positions of sample {sample_id}")
        out = {name: pieces[store][key] for name, (store, key) in plan.columns.items()}
        out["number"] = plan.offsets[row] + np.arange(len(positions))
        out.update(sample_id=piece["sample_ids"], position=positions, token_id=piece["token_ids"].astype(np.int32),
                   role=self._roles(sample_id, positions))
        return out

    def _roles(self, sample_id: int, positions: np.ndarray) -> np.ndarray:
        """[n] int8: each token's role code (``common.roles``), -1 where unknown."""
        codes = None
        if self.roles is not None:
            i = int(np.searchsorted(self.roles.ids, sample_id))
            if i < len(self.roles.ids) and self.roles.ids[i] == sample_id:
                codes = self.roles.role_codes(i)
        if codes is None:
            return np.full(len(positions), -1, np.int8)
        return np.where(positions >= 0, codes[np.maximum(positions, 0)], -1).astype(np.int8)


class WriteShard(beam.DoFn):
    """(output shard, its chunks' spill sections) -> the shard written; yields (shard, rows, bytes)."""

    def __init__(self, plan: ExportPlan, target: ExportTarget):
        self.plan, self.target = plan, target

    def process(self, element: tuple[int, Iterable[Section]]) -> Iterator[tuple[int, int, int]]:
        shard, sections = element
        plan, dtype = self.plan, storage_dtype(self.target.dtype)
        rows = plan.shard_rows(shard)
        arrays = {name: np.zeros((rows, plan.widths[name]), dtype) for name in plan.columns}
        provenance = {name: np.zeros(rows, kind) for name, kind in PROVENANCE.items()}
        filled = np.zeros(rows, np.int32)
        for section in sections:
            chunk = read_section(section)
            slot = chunk["slot"]
            np.add.at(filled, slot, 1)
            for name in arrays:
                arrays[name][slot] = chunk[name].view(dtype) if dtype.name == "bfloat16" else chunk[name]
            for name in provenance:
                provenance[name][slot] = chunk[name]
        if not (filled == 1).all():
            raise ValueError(f"output shard {shard}: {int((filled == 0).sum())} rows unfilled, "
                             f"{int((filled > 1).sum())} filled twice")
        yield shard, rows, write_shard(self.target.output_dir, shard, arrays, provenance)


class WriteManifest(beam.DoFn):
    """Every shard's (shard, rows, bytes) -> ``export.json`` (and ``statistics.json``)."""

    def __init__(self, plan: ExportPlan, target: ExportTarget, description: dict[str, Any]):
        self.plan, self.target, self.description = plan, target, description

    def process(self, written: list[tuple[int, int, int]]) -> Iterator[dict[str, Any]]:
        plan = self.plan
        shards = sorted(written)
        if [s for s, _, _ in shards] != list(range(plan.shards)):
            raise ValueError(f"{len(shards)} of {plan.shards} output shards written")
        manifest = {
            "layout": LAYOUT, "rows": plan.total, "rows_per_shard": plan.rows_per_shard, "seed": plan.seed,
            "dtype": self.target.dtype, **self.description,
            "columns": [{"name": name, "file": array_file(name), "store": plan.stores[store].name,
                         "key": str(key), "width": plan.widths[name], "dtype": self.target.dtype}
                        for name, (store, key) in plan.columns.items()],
            "stores": [{"name": s.name, "index": s.index} for s in plan.stores],
            "shards": [{"directory": shard_name(s), "rows": rows, "bytes": size} for s, rows, size in shards],
        }
        write_manifest(self.target.output_dir, manifest, self.target.statistics)
        delete_tree(join(self.target.output_dir, SPILL_DIR))
        yield manifest


class ExportFlat(beam.PTransform):
    """The whole flat export of ``plan``, from the leading store's ``units`` (row ranges)."""

    def __init__(self, plan: ExportPlan, units: list[tuple[int, int]], target: ExportTarget,
                 description: dict[str, Any]):
        super().__init__()
        self.plan, self.units, self.target, self.description = plan, units, target, description

    def expand(self, pipeline):
        written = (pipeline
                   | "Units" >> beam.Create(self.units, reshuffle=True)
                   | "ReadUnits" >> beam.ParDo(ReadUnit(self.plan, self.target.output_dir))
                   | "ByOutputShard" >> beam.GroupByKey()
                   | "WriteShards" >> beam.ParDo(WriteShard(self.plan, self.target)))
        return (written
                | "AllShards" >> beam.combiners.ToList()
                | "WriteManifest" >> beam.ParDo(WriteManifest(self.plan, self.target, self.description)))
