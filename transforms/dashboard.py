"""Feature dashboards as Beam transforms: ``FeatureDashboards`` runs a ``DashboardJob`` over the
units of a store (runs of neighbouring samples of one shard, as the export reads them).

    units -> TopOfUnit: each unit's tokens encoded (on the device) in blocks of ``block_rows``,
             each block summarized (features.top_activations), merged -> CombineGlobally: the
             store's top tokens, counts, maxima and least positive values per feature
          -> SpreadOfUnit (the first pass's ranges a side input): histograms, interval counts and
             the tokens drawn from each interval (features.spread) -> CombineGlobally
    ChosenByMachine: the chosen tokens (top and drawn), by machine -> ReadContexts: each chosen sample read once
             (its stored rows and its token ids), encoded, the feature's values around the token
          -> GroupByKey(batch file) -> WriteBatch: batch-N.json (features.neuronpedia)
    once every batch is written -> WriteSummaries: sparsity.safetensors, top_activations.parquet,
             the viewer, and dashboard.json last (it marks the output complete)

A worker holds one unit's rows and their feature activations (``block_rows`` x features at a
time), the summaries of the features (about 80 bytes x (k + 30) a feature), the store's index (as
the export's workers: about 60 bytes a sample) and, reading contexts, one machine's chosen samples
and their token ids: never the store's arrays. Every merge is associative and
ties are broken by (sample id, position), so the files do not depend on how the units were spread
over workers; each unit is read and encoded the same way wherever it runs.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
from typing import Any, Iterable, Iterator

import apache_beam as beam
import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from activations.token_ids import machine_streams
from activations.token_loader import LoaderConfig, TokenLoader
from activations.token_plan import blocks
from common.cli import UserError
from common.stream_format import parse_stream_line
from common.files import delete_tree, join, read_optional, write_bytes
from features.dashboard import Chosen, Context, LogitEffects, chosen_tokens, context_span, dashboard_feature
from features.encoders import FeatureSet, features_bytes, features_from_bytes
from features.neuronpedia import batch_json, batch_sizes
from features.spread import Spread, block_spread, merged_spread
from features.top_activations import TopActivations, block_top, merged
from model.sites import ArrayKey, hook_name, key_parts

WORK_DIR = "_work"  # the launcher's files for the workers (the logit effects), removed at the end
MANIFEST = "dashboard.json"  # written last: the output is complete
SPARSITY = "sparsity.safetensors"  # SAELens's: log10 of each feature's density
TOP_TABLE = "top_activations.parquet"
VIEWER_DIR = "viewer"


@dataclasses.dataclass(frozen=True)
class DashboardJob:
    """What the workers need, small enough to travel in the job graph: the features' weights, the
    logit effects and the token strings are files the launcher writes under ``_work/``."""
    index: str                    # the merged index
    key: ArrayKey                 # the stored array the features read
    numbers: tuple[int, ...]      # each summarized feature's number (its index in the SAE, a neuron's dimension)
    columns: tuple[int, ...] | None  # the encoder outputs summarized (a TopK SAE encodes all); None: every one
    top_k: int                    # top tokens kept per feature (parquet); the dashboards show 20
    context: int | None           # tokens each side of an example's token (None: the whole sample)
    tokens: str | None            # the token selection read
    exclude_first_positions: int  # each sample's first tokens left out
    streams_dir: str | None
    output_dir: str
    most_active: int | None       # show only this many features, those of the highest density (None: all)
    per_batch: int                # features of a batch-N.json, about (SAEDashboard's split)
    model_id: str
    layer: int
    sae_set: str
    prompts: tuple[int, int] = (0, 0)  # (samples read, the most tokens of one): the batch files' prompt counts
    block_rows: int = 1024        # rows encoded at once (one compiled shape)
    # A unit's stored bytes, at most (one array, if larger): about a block of rows of a 0.5B model's
    # float16, so a worker holds one block's rows decoded, not 8 MB of them (the export's units).
    block_bytes: int = 2 << 20

    def loader(self) -> TokenLoader:
        return TokenLoader(LoaderConfig(index=self.index, layers=(self.key,), seed=None, tokens=self.tokens,
                                        exclude_first_positions=self.exclude_first_positions,
                                        streams_dir=self.streams_dir, read_threads=1, block_bytes=self.block_bytes))

    @property
    def features_path(self) -> str:
        return join(self.output_dir, WORK_DIR, "features.npz")

    @property
    def logits_path(self) -> str:
        return join(self.output_dir, WORK_DIR, "logits.npz")

    @property
    def strings_path(self) -> str:
        return join(self.output_dir, WORK_DIR, "token_strings.json")


def shown_batches(job: DashboardJob, top: TopActivations) -> list[list[int]]:
    """The summaries' rows of each batch-N.json: every feature encoded, or the ``most_active`` of
    highest density (ties: the lower index), in index order."""
    rows = list(range(len(job.numbers)))
    if job.most_active is not None:
        rows = sorted(sorted(rows, key=lambda r: (-top.positive[r], job.numbers[r]))[:job.most_active])
    if not rows:
        return []
    parts = np.array_split(np.asarray(rows, np.int64), len(batch_sizes(len(rows), job.per_batch)))
    return [part.tolist() for part in parts]


def batch_count(job: DashboardJob) -> int:
    shown = len(job.numbers) if job.most_active is None else min(job.most_active, len(job.numbers))
    return len(batch_sizes(shown, job.per_batch)) if shown else 0


@functools.lru_cache(maxsize=2)
def job_features(job: DashboardJob) -> FeatureSet:
    """The job's features as the launcher wrote them (folded, those summarized), once per worker process."""
    return features_from_bytes(read_optional(job.features_path))


@functools.lru_cache(maxsize=2)
def job_loader(job: DashboardJob) -> TokenLoader:
    """The store's loader, once per worker process (it holds the index: ~60 bytes a sample)."""
    return job.loader()


def encoded_blocks(job: DashboardJob, rows: np.ndarray) -> Iterator[tuple[Any, slice]]:
    """(activations [block_rows, F] on the device, the real rows' slice) of rows [n, width], in
    blocks padded to ``block_rows`` (one compiled program)."""
    features = job_features(job)
    columns = None if job.columns is None else jnp.asarray(job.columns)
    for start in range(0, len(rows), job.block_rows):
        part = rows[start:start + job.block_rows]
        padded = np.zeros((job.block_rows, rows.shape[1]), np.float32)
        padded[:len(part)] = part
        activations = features.encode(padded)
        yield (activations if columns is None else activations[:, columns]), slice(start, start + len(part))


def unit_rows(loader: TokenLoader, bounds: tuple[int, int], key: ArrayKey) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows [n, width] float32, sample ids [n], positions [n]) of a unit's kept tokens."""
    pieces = loader.read_block(bounds).pieces
    if not pieces:
        return np.zeros((0, loader.stored.width[key]), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return (np.concatenate([p[key] for p in pieces]).astype(np.float32),
            np.concatenate([p["sample_ids"] for p in pieces]), np.concatenate([p["positions"] for p in pieces]))


class _UnitDoFn(beam.DoFn):
    def __init__(self, job: DashboardJob):
        self.job = job

    def setup(self):
        self.loader = job_loader(self.job)


@functools.lru_cache(maxsize=2)
def units_by_shard(job: DashboardJob) -> dict[int, list[tuple[int, int]]]:
    """The store's units (``activations.token_plan.blocks``: runs of neighbouring samples of one
    shard), by shard, once per worker process."""
    stored = job_loader(job).stored
    out: dict[int, list[tuple[int, int]]] = {}
    for start, stop in blocks(stored, None, job.block_bytes):
        out.setdefault(int(stored.shard[start]), []).append((start, stop))
    return out


class UnitsOfShard(_UnitDoFn):
    """A shard's units: the job graph holds the shards, not the (many more) units."""

    def process(self, shard: int) -> Iterator[tuple[int, int]]:
        yield from units_by_shard(self.job).get(shard, [])


class TopOfUnit(_UnitDoFn):
    def process(self, bounds: tuple[int, int]) -> Iterator[TopActivations]:
        rows, sample_ids, positions = unit_rows(self.loader, tuple(bounds), self.job.key)
        summary = TopActivations.empty(len(self.job.numbers), self.job.top_k)
        for activations, part in encoded_blocks(self.job, rows):
            summary = merged(summary, block_top(activations, sample_ids[part], positions[part], self.job.top_k))
        yield summary


class SpreadOfUnit(_UnitDoFn):
    def process(self, bounds: tuple[int, int], top: TopActivations) -> Iterator[Spread]:
        rows, sample_ids, positions = unit_rows(self.loader, tuple(bounds), self.job.key)
        spread, numbers = Spread.empty(len(self.job.numbers)), np.asarray(self.job.numbers, np.int64)
        for activations, part in encoded_blocks(self.job, rows):
            spread = merged_spread(spread, block_spread(activations, sample_ids[part], positions[part],
                                                        top.smallest, top.maximum, numbers))
        yield spread


class _Merge(beam.CombineFn):
    """A merge of summaries as a combiner: ``empty`` its start, ``merge`` its step."""

    def __init__(self, empty, merge):
        self.empty, self.merge = empty, merge

    def create_accumulator(self):
        return None

    def add_input(self, accumulator, summary):
        return summary if accumulator is None else self.merge(accumulator, summary)

    def merge_accumulators(self, accumulators):
        out = None
        for accumulator in accumulators:
            if accumulator is not None:
                out = accumulator if out is None else self.merge(out, accumulator)
        return out

    def extract_output(self, accumulator):
        return self.empty() if accumulator is None else accumulator


class ChosenByMachine(_UnitDoFn):
    """Every chosen token, grouped by the machine that stored its sample (one stream each): per
    machine, [tokens, 5] int64 (row in the summaries, group, rank, sample id, position), by sample id."""

    def process(self, top: TopActivations, spread: Spread) -> Iterator[tuple[int, np.ndarray]]:
        stored = self.loader.stored
        chosen = chosen_tokens(top, spread, [row for batch in shown_batches(self.job, top) for row in batch])
        if not len(chosen):
            return
        order = np.argsort(stored.sample_id, kind="stable")
        machines = stored.machine_id[order[np.searchsorted(stored.sample_id[order], chosen[:, 3])]]
        for machine in np.unique(machines).tolist():
            mine = chosen[machines == machine]
            yield machine, mine[np.lexsort((mine[:, 4], mine[:, 3]))]


class ReadContexts(_UnitDoFn):
    """The contexts of one machine's chosen tokens, keyed by the batch file of their feature: the
    machine's stream read once, in order, each chosen sample's stored rows read as its record
    passes, about ``block_rows`` of them encoded at a time; one sample's token ids held at a time."""

    def process(self, element: tuple[int, np.ndarray], top: TopActivations) -> Iterator[tuple[int, Context]]:
        machine, chosen = element
        stored, job = self.loader.stored, self.job
        stream = machine_streams([machine], stored.metadata.get("machines", []), job.streams_dir)[machine]
        wanted = np.unique(chosen[:, 3])
        order = np.argsort(stored.sample_id, kind="stable")
        batch_of = {row: b for b, rows_of_batch in enumerate(shown_batches(job, top)) for row in rows_of_batch}
        pending, filled, found = [], 0, 0
        for sample_id, token_ids in stream_token_ids(stream, wanted):
            found += 1
            row = int(order[np.searchsorted(stored.sample_id[order], sample_id)])
            values, _, positions = unit_rows(self.loader, (row, row + 1), job.key)
            if pending and filled + len(values) > job.block_rows:
                yield from self._contexts(pending, chosen, batch_of)
                pending, filled = [], 0
            pending.append((sample_id, token_ids[:int(stored.sample_tokens[row])], values, positions))
            filled += len(values)
        if pending:
            yield from self._contexts(pending, chosen, batch_of)
        if found != len(wanted):
            raise UserError(f"{stream.name} lacks {len(wanted) - found} stored sample(s) whose tokens a dashboard "
                            "shows: not the stream that run read")

    def _contexts(self, pending: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], chosen: np.ndarray,
                  batch_of: dict[int, int]) -> Iterator[tuple[int, Context]]:
        """The contexts of the chosen tokens of ``pending`` samples (sample id, token ids, stored
        rows, their positions), their rows encoded together; only the chosen features' values kept."""
        mine = chosen[np.isin(chosen[:, 3], [sample_id for sample_id, _, _, _ in pending])]
        needed = np.unique(mine[:, 0])
        column = {int(f): i for i, f in enumerate(needed)}
        # The chosen features' columns gathered on the device, padded to a power of two (a few compiled
        # shapes): only they come back to the host, not the block's every feature.
        width = 1 << int(np.ceil(np.log2(len(needed))))
        gather = jnp.asarray(np.concatenate([needed, np.zeros(width - len(needed), np.int64)]))
        rows = np.concatenate([values for _, _, values, _ in pending])
        encoded = [np.asarray(_columns(activations, gather))[:part.stop - part.start, :len(needed)]
                   for activations, part in encoded_blocks(self.job, rows)]
        values = np.concatenate(encoded) if encoded else np.zeros((0, len(needed)), np.float32)  # [rows, needed]
        start = 0
        for sample_id, token_ids, stored, positions in pending:
            for feature, group, rank, _, position in mine[mine[:, 3] == sample_id].tolist():
                along = np.zeros(len(token_ids), np.float32)  # the feature at every token; unread ones show 0
                along[positions] = values[start:start + len(stored), column[feature]]
                first, stop, qualifying = context_span(position, len(token_ids), self.job.context)
                yield batch_of[feature], Context(Chosen(feature, group, rank, sample_id, position),
                                                 tuple(int(t) for t in token_ids[first:stop]),
                                                 tuple(float(v) for v in along[first:stop]), qualifying)
            start += len(stored)


@jax.jit
def _columns(activations: jax.Array, columns: jax.Array) -> jax.Array:
    return activations[:, columns]


def stream_token_ids(stream: Any, wanted: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(sample id, its token ids) of the ``wanted`` (sorted) samples, in the stream's order, as
    its lines pass; stops once every one is found."""
    left = len(wanted)
    for line in stream.lines():
        if not left:
            return
        if not line.text.strip():
            continue
        record = parse_stream_line(line.text, line.where)
        i = np.searchsorted(wanted, record["sample_id"])
        if i < len(wanted) and wanted[i] == record["sample_id"]:
            left -= 1
            yield int(record["sample_id"]), np.asarray(record["input_ids"], np.int64)


def read_logits(job: DashboardJob) -> LogitEffects | None:
    data = read_optional(job.logits_path)
    if not data:
        return None
    with np.load(io.BytesIO(data)) as arrays:
        return LogitEffects(**{name: arrays[name] for name in arrays.files})


def write_work_files(job: DashboardJob, features: FeatureSet, logits: LogitEffects | None,
                     strings: list[str]) -> None:
    """What the launcher prepared once for the workers, which may not reach its paths: the features
    encoded (folded), their logit effects (an empty file: none) and the token strings by id."""
    write_bytes(job.features_path, features_bytes(features))
    data = io.BytesIO()
    if logits is not None:
        np.savez(data, **dataclasses.asdict(logits))
    write_bytes(job.logits_path, data.getvalue())
    write_bytes(job.strings_path, json.dumps(strings).encode())


@functools.lru_cache(maxsize=2)
def read_strings(job: DashboardJob) -> list[str]:
    return json.loads(read_optional(job.strings_path))


class WriteBatch(beam.DoFn):
    """One batch-N.json from its features' summaries and contexts."""

    def __init__(self, job: DashboardJob):
        self.job = job

    def process(self, element: tuple[int, Iterable[Context | None]], top: TopActivations,
                spread: Spread) -> Iterator[int]:
        batch, contexts = element
        job, logits = self.job, read_logits(self.job)
        by_feature: dict[int, list[Context]] = {}
        for context in contexts:
            if context is not None:
                by_feature.setdefault(context.chosen.feature, []).append(context)
        features = [dashboard_feature(job.numbers[row], row, top, spread, by_feature.get(row, []), read_strings(job),
                                      logits, job.prompts) for row in shown_batches(job, top)[batch]]
        write_bytes(join(job.output_dir, f"batch-{batch}.json"),
                    batch_json(job.model_id, job.layer, job.sae_set, features).encode())
        yield batch


def top_table(top: TopActivations, numbers: tuple[int, ...]) -> pa.Table:
    """(feature, rank, sample_id, position, value) of every feature's top tokens."""
    filled = top.sample_ids >= 0  # [F, k]
    feature, rank = np.nonzero(filled)
    return pa.table({"feature": np.asarray(numbers, np.int64)[feature], "rank": rank.astype(np.int32),
                     "sample_id": top.sample_ids[filled], "position": top.positions[filled],
                     "value": top.values[filled]})


def sparsity_bytes(top: TopActivations) -> bytes:
    """SAELens's ``sparsity.safetensors``: log10(density + 1e-10) per feature, float32."""
    from safetensors.numpy import save
    return save({"sparsity": np.log10(top.density + 1e-10).astype(np.float32)})


class WriteSummaries(beam.DoFn):
    """Once every batch file is written: the sparsity, the top tokens' table, the viewer, the manifest."""

    def __init__(self, job: DashboardJob, all_features: bool, manifest: dict[str, Any]):
        self.job, self.all_features, self.manifest = job, all_features, manifest

    def process(self, top: TopActivations, written: list[int]) -> Iterator[str]:
        from features.viewer import write_viewer
        job = self.job
        if self.all_features:  # SAELens reads one density per feature of the SAE
            write_bytes(join(job.output_dir, SPARSITY), sparsity_bytes(top))
        sink = io.BytesIO()
        pq.write_table(top_table(top, job.numbers), sink)
        write_bytes(join(job.output_dir, TOP_TABLE), sink.getvalue())
        features = [feature for batch in sorted(written) for feature in
                    json.loads(read_optional(join(job.output_dir, f"batch-{batch}.json")))["features"]]
        write_viewer(join(job.output_dir, VIEWER_DIR), {
            "model_id": job.model_id, "layer": job.layer, "sae_set": job.sae_set,
            "key": hook_name(*key_parts(job.key)), "features": features})
        delete_tree(join(job.output_dir, WORK_DIR))
        manifest = {**self.manifest, "batches": len(written), "features_shown": len(features),
                    "tokens_read": int(top.tokens)}
        write_bytes(join(job.output_dir, MANIFEST), json.dumps(manifest, indent=2).encode())
        yield job.output_dir


class FeatureDashboards(beam.PTransform):
    """The job over the store's ``shards`` (their units), writing its output files."""

    def __init__(self, job: DashboardJob, shards: int, all_features: bool, manifest: dict[str, Any]):
        super().__init__()
        self.job, self.shards = job, shards
        self.all_features, self.manifest = all_features, manifest

    def expand(self, pipeline):
        job, features = self.job, len(self.job.numbers)
        units = (pipeline | "Shards" >> beam.Create(range(self.shards))
                 | "UnitsOfShard" >> beam.ParDo(UnitsOfShard(job)) | "SpreadUnits" >> beam.Reshuffle())
        top = (units | "TopOfUnit" >> beam.ParDo(TopOfUnit(job))
               | "MergeTop" >> beam.CombineGlobally(_Merge(lambda: TopActivations.empty(features, job.top_k), merged)))
        spread = (units | "SpreadOfUnit" >> beam.ParDo(SpreadOfUnit(job), beam.pvalue.AsSingleton(top))
                  | "MergeSpread" >> beam.CombineGlobally(_Merge(lambda: Spread.empty(features), merged_spread)))
        contexts = (top | "ChosenByMachine" >> beam.ParDo(ChosenByMachine(job), beam.pvalue.AsSingleton(spread))
                    | "SpreadMachines" >> beam.Reshuffle()
                    | "ReadContexts" >> beam.ParDo(ReadContexts(job), beam.pvalue.AsSingleton(top)))
        every_batch = pipeline | "Batches" >> beam.Create([(b, None) for b in range(batch_count(job))])
        written = ((contexts, every_batch) | "WithEveryBatch" >> beam.Flatten()
                   | "ByBatch" >> beam.GroupByKey()
                   | "WriteBatch" >> beam.ParDo(WriteBatch(job), beam.pvalue.AsSingleton(top),
                                                beam.pvalue.AsSingleton(spread)))
        return top | "WriteSummaries" >> beam.ParDo(WriteSummaries(job, self.all_features, self.manifest),
                                                   beam.pvalue.AsList(written))
