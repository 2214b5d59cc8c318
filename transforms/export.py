"""The export as Beam transforms: ``ExportShards`` writes an ``activations.export_plan.ExportPlan``
in a ``ShardFormat``: the flat layout (``activations.flat_layout.FlatFormat``) or SAELens's
cached-activations directory (``activations.saelens_export.SaeLensFormat``).

    units of the leading store (runs of neighbouring samples of one shard: one ranged read per key)
      -> ReadUnit: every kept token of the unit, its columns from every store (joined on sample id
         and position), its slot from the plan's permutation (slots past the plan's ``exported``
         left out); one chunk per output shard (first pass of two: per bucket of shards), spilled;
         the tokens dropped, counted by reason
     [-> GroupByKey(bucket) -> units of a bucket's sections -> RouteBucketUnit: their tokens, one
         chunk per output shard, spilled again: a two-pass shuffle only]
      -> GroupByKey(output shard): references to the chunks only
      -> WriteShard: the shard's rows read and placed at their slots (each slot filled exactly
         once), written by the format
      -> the format's manifest, once every shard is written; the spill deleted

The chunks go to spill files (``{output_dir}/_spill/``, one per output shard's bytes of a worker's
bundle, a section a key), and only (path, offset, length) travels through the shuffle, as
``transforms.spill`` does for ``pipeline.prepare``: the local runner would hold every element
between stages in memory. One pass gives each output shard (export bytes / flush) sections of
(shard bytes x flush / export bytes) each, too small past a few hundred shards; two passes
(``activations.export_plan.SHUFFLES``) make both passes' sections about sqrt(shards) times larger
for one more write and read of every byte. A worker holds one unit's arrays (``block_bytes`` of
shard, decoded), its share of the plan (its rows' offsets and token ids, read from ``PlanFiles``)
and about an output shard of chunks while reading (a second pass: a unit of about a shard of
sections, and as much gathered), and one output shard (``rows_per_shard`` rows of every column,
and its bytes as written) while writing, beside each store's index (``stored_arrays``: about 44
bytes a sample and 16 a sample and key) and the leading store's tokens table (roles; with a
selection stored, each stored row's position). Neither the job graph
nor a worker holds the whole store's token ids. The bytes written depend on the plan only: the
same for any number of workers or passes, any bundling, any retry (a retried bundle spills to new
files).
"""

from __future__ import annotations

import collections
import io
import uuid
from typing import Any, Iterable, Iterator, Protocol

import apache_beam as beam
import numpy as np
from apache_beam.transforms.window import GlobalWindows

from activations.export_plan import ExportPlan, UnitPlan, permuted
from activations.flat_layout import PROVENANCE, SPILL_DIR
from activations.reader import CorruptShardError, storage_dtype
from activations.token_ids import TokenIds
from activations.token_loader import DROP_REASONS, Block, TokenLoader
from activations.stored_tokens import read_stored_tokens
from common.cli import UserError
from common.files import delete_tree, join, read_range, write_bytes

# A worker's chunks are gathered over its bundle's units and spilled together past an output shard's
# bytes, at most this many (and at the bundle's end): fewer, larger sections than one file a unit (a
# unit spreads its tokens over every output shard), for a worker's memory of about a shard more.
FLUSH_BYTES = 64 << 20
Section = tuple[str, int, int]  # a spill file's path, a chunk's offset and length in it


def spilled(root: str, chunks: dict[int, dict[str, np.ndarray]]) -> Iterator[tuple[int, Section]]:
    """Writes a worker's gathered chunks (by where they go next: an output shard, or a first
    pass's bucket) into one new spill file under ``root``; yields (key, its section)."""
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


class Gatherer:
    """A worker's chunks by where they go next (a bucket or an output shard), spilled together
    once past ``flush_bytes`` (and at the bundle's end: ``flush``)."""

    def __init__(self, root: str, flush_bytes: int):
        self.root, self.flush_bytes = root, flush_bytes
        self.pending: dict[int, list[dict[str, np.ndarray]]] = {}
        self.pending_bytes = 0

    def add(self, keys: np.ndarray, tokens: dict[str, np.ndarray]) -> Iterator[tuple[int, Section]]:
        """Gathers ``tokens`` (columns [n, ...]) by ``keys`` [n]; yields sections when it spills."""
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        edges = np.flatnonzero(np.diff(keys)) + 1
        for lo, hi in zip([0, *edges.tolist()], [*edges.tolist(), len(keys)]):
            chunk = {name: values[order[lo:hi]] for name, values in tokens.items()}
            self.pending.setdefault(int(keys[lo]), []).append(chunk)
            self.pending_bytes += sum(values.nbytes for values in chunk.values())
        if self.pending_bytes >= self.flush_bytes:
            yield from self.flush()

    def flush(self) -> Iterator[tuple[int, Section]]:
        """The gathered chunks spilled into one file, a section a key."""
        chunks = {key: {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
                  for key, parts in sorted(self.pending.items())}
        self.pending, self.pending_bytes = {}, 0
        if chunks:
            yield from spilled(self.root, chunks)


DROPPED = "dropped"  # ReadUnit's second output: {reason: tokens} of a unit


class ShardFormat(Protocol):
    """How an export's output shards and its manifest are written (picklable: it travels to the
    workers). ``dtype`` is the arrays' (float32 | float16 | bfloat16)."""
    output_dir: str
    dtype: str

    def write_shard(self, plan: ExportPlan, shard: int, arrays: dict[str, np.ndarray],
                    provenance: dict[str, np.ndarray]) -> int:
        """Writes output shard ``shard`` (each column [rows, width], each provenance column
        [rows]); returns the bytes written. The same bytes for the same rows, whoever writes."""

    def finish(self, plan: ExportPlan, shards: list[tuple[int, int, int]], dropped: dict[str, int]) -> dict[str, Any]:
        """Writes what marks the export complete, from every shard's (shard, rows, bytes) and
        the tokens dropped by reason; returns the manifest."""


def sum_counts(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    return dict(sum(map(collections.Counter, counts), collections.Counter()))


class ReadUnit(beam.DoFn):
    """A unit of the leading store -> (output shard, or first-pass bucket; a chunk's spill section):
    the chunk's ``slot`` [n] (in the whole export), each column [n, width] and the provenance
    columns, for its tokens bound there; and, tagged ``DROPPED``, its tokens left out by reason."""

    def __init__(self, plan: ExportPlan, root: str):
        self.plan, self.root = plan, root

    def setup(self) -> None:
        # Token ids come unit by unit from the plan's files, never from the streams.
        self.loaders = [TokenLoader(c, token_ids=TokenIds.empty()) for c in self.plan.loader_configs]
        try:  # the roles of the leading store's tokens (a store from before roles has none)
            self.roles = self.loaders[0].tokens or read_stored_tokens(self.plan.stores[0].index)
        except UserError:
            self.roles = None
        self.dropped = {reason: beam.metrics.Metrics.counter("export", f"dropped_{reason}")
                        for reason in DROP_REASONS}
        self.exported = beam.metrics.Metrics.counter("export", "tokens")

    def start_bundle(self) -> None:
        self.gather = Gatherer(self.root, min(FLUSH_BYTES, self.plan.shard_bytes))

    def finish_bundle(self) -> Iterator:
        for element in self.gather.flush():  # outputs of finish_bundle carry their window: the global one
            yield GlobalWindows.windowed_value(element)

    def process(self, bounds: tuple[int, int]) -> Iterator[tuple[int, Section]]:
        plan, lead = self.plan, self.loaders[0]
        start, stop = bounds
        unit = plan.files.unit((start, stop), lead.stored.sample_id[start:stop])
        for loader in self.loaders:
            loader.use_token_ids(unit.token_ids)  # the stores' token ids are the same (planned)
        block = _read_block(lead, (start, stop))
        for reason, n in block.dropped.items():
            self.dropped[reason].inc(n)
        others = {store: self._joined(store, unit.rows[store]) for store in plan.files.others}
        parts = []
        for k, piece in enumerate(block.pieces):
            if len(piece["positions"]):
                parts.append(self._tokens(unit, k, piece, {store: pieces[k] for store, pieces in others.items()}))
        yield beam.pvalue.TaggedOutput(DROPPED, dict(block.dropped))
        if not parts:
            return
        tokens = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        slots = permuted(tokens.pop("number"), plan.total, plan.seed)
        inside = slots < plan.exported  # the others: past --max_tokens, or short of a last whole row
        if not inside.all():
            tokens, slots = {name: values[inside] for name, values in tokens.items()}, slots[inside]
        if not len(slots):
            return
        tokens["slot"] = slots
        self.exported.inc(len(slots))
        yield from self.gather.add(plan.routed(slots, first_pass=True), tokens)

    def _joined(self, store: int, rows: np.ndarray) -> list[dict[Any, np.ndarray]]:
        """Another store's pieces of the unit's samples (at ``rows`` there), in the unit's order:
        read by runs of consecutive rows of one shard (one ranged read per run and key)."""
        if not len(rows):
            return []
        shard, order = self.loaders[store].stored.shard, np.argsort(rows, kind="stable")
        ordered = rows[order]
        # A run ends where the next row is not the next one of the same shard.
        ends = [i + 1 for i in range(len(ordered) - 1)
                if ordered[i + 1] != ordered[i] + 1 or shard[ordered[i + 1]] != shard[ordered[i]]] + [len(ordered)]
        pieces: list[dict[Any, np.ndarray]] = [{}] * len(rows)
        for start, stop in zip([0, *ends[:-1]], ends):
            block = _read_block(self.loaders[store], (int(ordered[start]), int(ordered[stop - 1]) + 1))
            for j, piece in zip(order[start:stop], block.pieces):
                pieces[j] = piece
        return pieces

    def _tokens(self, unit: UnitPlan, k: int, piece: dict[Any, np.ndarray], others: dict[int, dict[Any, np.ndarray]],
                ) -> dict[str, np.ndarray]:
        """The kept tokens of the unit's ``k``-th sample (``others``: its pieces in the other
        stores): their canonical numbers, columns and provenance."""
        plan = self.plan
        sample_id, positions = int(piece["sample_ids"][0]), piece["positions"]
        pieces = {0: piece, **others}
        for store, other in others.items():
            if not np.array_equal(other["positions"], positions):
                raise ValueError(f"store {plan.stores[store].name} keeps other positions of sample {sample_id}")
        out = {name: pieces[store][key] for name, (store, key) in plan.columns.items()}
        out["number"] = unit.offsets[k] + np.arange(len(positions))
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


def _read_block(loader: TokenLoader, bounds: tuple[int, int]) -> Block:
    """``loader.read_block``, a corrupt shard as the user's one line."""
    try:
        return loader.read_block(bounds)
    except CorruptShardError as e:  # one line for the user, through the runner
        raise UserError(str(e)) from None


def bucket_units(element: tuple[int, Iterable[Section]], unit_bytes: int) -> Iterator[list[Section]]:
    """A first-pass bucket's sections, in units of about ``unit_bytes`` (a second pass reads one at a time)."""
    _, sections = element
    unit, size = [], 0
    for section in sections:
        unit.append(section)
        size += section[2]
        if size >= unit_bytes:
            yield unit
            unit, size = [], 0
    if unit:
        yield unit


class RouteBucketUnit(beam.DoFn):
    """A two-pass shuffle's second pass: a unit of a bucket's sections -> (output shard, chunk
    section), gathered and spilled as ``ReadUnit`` does."""

    def __init__(self, plan: ExportPlan, root: str):
        self.plan, self.root = plan, root

    def start_bundle(self) -> None:
        self.gather = Gatherer(self.root, min(FLUSH_BYTES, self.plan.shard_bytes))

    def finish_bundle(self) -> Iterator:
        for element in self.gather.flush():
            yield GlobalWindows.windowed_value(element)

    def process(self, sections: list[Section]) -> Iterator[tuple[int, Section]]:
        chunks = [read_section(section) for section in sections]
        tokens = {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0]}
        yield from self.gather.add(self.plan.routed(tokens["slot"], first_pass=False), tokens)


class WriteShard(beam.DoFn):
    """(output shard, its chunks' spill sections) -> the shard written; yields (shard, rows, bytes)."""

    def __init__(self, plan: ExportPlan, form: ShardFormat):
        self.plan, self.form = plan, form

    def process(self, element: tuple[int, Iterable[Section]]) -> Iterator[tuple[int, int, int]]:
        shard, sections = element
        plan, dtype = self.plan, storage_dtype(self.form.dtype)
        rows = plan.shard_rows(shard)
        arrays = {name: np.zeros((rows, plan.widths[name]), dtype) for name in plan.columns}
        provenance = {name: np.zeros(rows, kind) for name, kind in PROVENANCE.items()}
        filled = np.zeros(rows, np.int32)
        for section in sections:
            chunk = read_section(section)
            slot = chunk["slot"] - shard * plan.rows_per_shard  # its row
            np.add.at(filled, slot, 1)
            for name in arrays:
                arrays[name][slot] = chunk[name].view(dtype) if dtype.name == "bfloat16" else chunk[name]
            for name in provenance:
                provenance[name][slot] = chunk[name]
        if not (filled == 1).all():
            raise ValueError(f"output shard {shard}: {int((filled == 0).sum())} rows unfilled, "
                             f"{int((filled > 1).sum())} filled twice")
        yield shard, rows, self.form.write_shard(plan, shard, arrays, provenance)


class WriteManifest(beam.DoFn):
    """Every shard's (shard, rows, bytes) and the tokens dropped -> the format's manifest; the
    spill deleted."""

    def __init__(self, plan: ExportPlan, form: ShardFormat):
        self.plan, self.form = plan, form

    def process(self, written: list[tuple[int, int, int]], dropped: dict[str, int]) -> Iterator[dict[str, Any]]:
        shards = sorted(written)
        if [s for s, _, _ in shards] != list(range(self.plan.shards)):
            raise ValueError(f"{len(shards)} of {self.plan.shards} output shards written")
        delete_tree(join(self.form.output_dir, SPILL_DIR))  # first: a finished export holds no spill
        yield self.form.finish(self.plan, shards, {**dict.fromkeys(DROP_REASONS, 0), **dropped})


class ExportShards(beam.PTransform):
    """The whole export of ``plan`` in ``form``, from the leading store's ``units`` (row ranges)."""

    def __init__(self, plan: ExportPlan, units: list[tuple[int, int]], form: ShardFormat):
        super().__init__()
        self.plan, self.units, self.form = plan, units, form

    def expand(self, pipeline):
        read = (pipeline
                | "Units" >> beam.Create(self.units, reshuffle=True)
                | "ReadUnits" >> beam.ParDo(ReadUnit(self.plan, self.form.output_dir)).with_outputs(
                    DROPPED, main="chunks"))
        dropped = read[DROPPED] | "CountDropped" >> beam.CombineGlobally(sum_counts)
        chunks = read.chunks
        if self.plan.passes == 2:
            chunks = (chunks
                      | "ByBucket" >> beam.GroupByKey()
                      | "BucketUnits" >> beam.FlatMap(bucket_units, min(FLUSH_BYTES, self.plan.shard_bytes))
                      | "SpreadBucketUnits" >> beam.Reshuffle()
                      | "RouteBucketUnits" >> beam.ParDo(RouteBucketUnit(self.plan, self.form.output_dir)))
        written = (chunks
                   | "ByOutputShard" >> beam.GroupByKey()
                   | "WriteShards" >> beam.ParDo(WriteShard(self.plan, self.form)))
        return (written
                | "AllShards" >> beam.combiners.ToList()
                | "WriteManifest" >> beam.ParDo(WriteManifest(self.plan, self.form),
                                                beam.pvalue.AsSingleton(dropped)))
