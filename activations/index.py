"""The Parquet index: one row per sample telling which shard holds it and where.

Each shard gets ``index/shard_NNNN.parquet`` (its samples), ``index/shard_NNNN_arrays.parquet``
(where each array lies in it), ``index/shard_NNNN_stats.parquet`` (per-site statistics,
``activations.site_stats``) and ``index/shard_NNNN_tokens.parquet`` (what its samples' tokens
are: roles, special tokens, the stored rows' positions); ``write_merged`` joins every machine's
into one table of each kind, the samples sorted by ``sample_id``, to be queried with DuckDB,
BigQuery or pandas.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
from typing import Any, Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from activations.site_stats import STATS_SCHEMA, Moments, StatsKey, merged_moments, stats_table, table_moments
from common.cli import UserError
from common.files import delete_file, join, open_read, read_optional, write_bytes
from common.roles import ROLES, WRITTEN_ROLES, role_counts
from common.states import COMPLETED
from model.sites import RESID_POST, SITES, UNMEASURED, ArrayKey, array_key, describe_key, key_parts

log = logging.getLogger("activations.index")

GENERATION_FIELDS = (pa.field("prompt_tokens", pa.int32()), pa.field("generated_tokens", pa.int32()),
                     pa.field("finish_reason", pa.string()), pa.field("generated_text", pa.string()),
                     pa.field("answer_correct", pa.bool_()), pa.field("answer_rows", pa.int32()),
                     pa.field("answer_cols", pa.int32()))
GENERATION_KEYS = ("prompt_tokens", "num_tokens", "finish", "text", "answer_correct", "answer_rows", "answer_cols")
SCHEMA = pa.schema([
    ("sample_id", pa.int64()), ("machine_id", pa.int32()), ("shard_id", pa.int32()),
    ("shard_path", pa.string()), ("position", pa.int32()), ("num_tokens", pa.int32()),
    ("layers", pa.list_(pa.int32())), ("hidden_size", pa.int32()), ("dtype", pa.string()),
    ("source", pa.string()), ("text_preview", pa.string()),
    # Truncated by the prepare pipeline or by the runner (--long_samples truncate); the length
    # before truncation (null where the stream did not record it). Null in indexes written
    # before these columns existed.
    ("truncated", pa.bool_()), ("original_num_tokens", pa.int32()),
    # The intervention the activations were extracted under (runners.tpu_host --ablate); null for
    # the unablated model, and in indexes written before the column existed.
    ("ablation", pa.string()),
    # A continuation the model wrote (runners.tpu_host --generate): the prompt's tokens, the
    # continuation's (num_tokens is their sum), why it ended (model.generate's STOP_TOKEN | LENGTH |
    # STOP_STRING) and its text (null without a tokenizer); for an ARC task with a known output,
    # whether the continuation's first grid block is that output and the block's shape (rows and
    # columns, null where there is no grid to parse; all three null where nothing was scored:
    # transforms.arc.scored_answer). Written by generating runs only (null in other indexes, and in
    # merged ones).
    *GENERATION_FIELDS,
])


# The types a dataset's kept column may have (pipeline.prepare --keep_columns), as index columns.
KEPT_COLUMN_TYPES = {"bool": pa.bool_(), "int64": pa.int64(), "float64": pa.float64(), "string": pa.string()}

# What each stored sample's tokens are (common/roles.py), one row per sample: its tokens, ``roles`` as runs (null
# for a stream prepared before roles existed), the positions of ``special`` tokens, each role's token
# count, and which tokens the stored rows are (``positions``: null where every token is stored; the
# positions pooled where a selection is pooled into one row) and how many rows each array has.
ROLE_COUNT_COLUMNS = tuple(f"{role}_tokens" for role in ROLES)
WRITTEN_COUNT_COLUMNS = tuple(f"{role}_tokens" for role in WRITTEN_ROLES)  # generating runs only (else null)
TOKENS_SCHEMA = pa.schema([
    ("sample_id", pa.int64()), ("num_tokens", pa.int32()),
    ("roles", pa.list_(pa.struct([("role", pa.string()), ("count", pa.int32())]))),
    ("special", pa.list_(pa.int32())),
    *((name, pa.int32()) for name in ROLE_COUNT_COLUMNS), ("special_tokens", pa.int32()),
    ("positions", pa.list_(pa.int32())), ("rows", pa.int32()),
    ("selection", pa.string()),  # the runner's --tokens (activations.selection); null: every token stored
])

# One row per (sample, layer): where that activation's bytes are inside the shard file.
ARRAYS_SCHEMA = pa.schema([
    ("sample_id", pa.int64()), ("layer", pa.int32()), ("shard_path", pa.string()),
    ("position", pa.int32()), ("byte_offset", pa.int64()), ("byte_length", pa.int64()),
    ("dtype", pa.string()), ("shape", pa.list_(pa.int64())),
])
# With activation sites besides block outputs (``model.sites``): one row per (sample, site, layer).
# A shard's table has the site column only when its run stores other sites (a run of block outputs
# writes what it always did); the merged table always has it, filled with hook_resid_post.
SITES_ARRAYS_SCHEMA = ARRAYS_SCHEMA.append(pa.field("site", pa.string()))
# Stored as float8 (model.quantize): where each array's row scales lie (float32 [rows], right after
# its rows in the shard; the same kind of range as byte_offset, byte_length). Only a float8 run's
# tables have these columns.
SCALE_FIELDS = (pa.field("scale_offset", pa.int64()), pa.field("scale_length", pa.int64()))


def index_filename(shard_id: int) -> str:
    return f"index/shard_{shard_id:04d}.parquet"


def arrays_index_filename(shard_id: int) -> str:
    return f"index/shard_{shard_id:04d}_arrays.parquet"


def stats_filename(shard_id: int) -> str:
    """The shard's per-site statistics (``activations.site_stats``)."""
    return f"index/shard_{shard_id:04d}_stats.parquet"


def tokens_filename(shard_id: int) -> str:
    """What the shard's samples' tokens are (``TOKENS_SCHEMA``)."""
    return f"index/shard_{shard_id:04d}_tokens.parquet"


def generating(samples: Sequence[dict[str, Any]]) -> bool:
    """The samples were continued by the model (``runners.tpu_host --generate``: every sample of
    such a run is), so their tables carry the generation columns."""
    return any(s.get("generation") for s in samples)


def tokens_index(samples: Sequence[dict[str, Any]], rows: Sequence[int], selection: str | None = None) -> pa.Table:
    """The ``TOKENS_SCHEMA`` rows of one shard's samples, each stored with ``rows`` rows by the
    token ``selection`` (None: every token); the counts of ``generated`` and ``thinking`` tokens
    only for samples the model continued (a run that does not generate writes the table it always
    did)."""
    def runs(s):
        return None if s.get("roles") is None else [{"role": r, "count": c} for r, c in s["roles"]]
    counts = [role_counts(s["roles"]) if s.get("roles") is not None else None for s in samples]
    table = pa.table({
        "sample_id": [s["sample_id"] for s in samples], "num_tokens": [s["num_tokens"] for s in samples],
        "roles": [runs(s) for s in samples],
        "special": [None if s.get("special") is None else list(s["special"]) for s in samples],
        **{name: [None if c is None else c[role] for c in counts] for role, name in zip(ROLES, ROLE_COUNT_COLUMNS)},
        "special_tokens": [None if s.get("special") is None else len(s["special"]) for s in samples],
        "positions": [None if s.get("positions") is None else s["positions"].tolist() for s in samples],
        "rows": list(rows), "selection": [selection] * len(samples),
    }, schema=TOKENS_SCHEMA)
    return table if generating(samples) else table.drop_columns(list(WRITTEN_COUNT_COLUMNS))


def arrays_index(locations: Sequence[Any], shard_path: str) -> pa.Table:
    """The per-(sample, layer) rows of one shard from its ``ArrayLocation``s (with a ``site``
    column where an array is not a block output, and ``SCALE_FIELDS`` where it is stored as float8)."""
    scales = {(l.key, l.position): l for l in locations if l.part == "scale"}
    locations = [l for l in locations if l.part == "activation"]
    table = _arrays_table(locations, shard_path)
    if scales:
        found = [scales[l.key, l.position] for l in locations]
        for field, values in zip(SCALE_FIELDS, ([s.byte_offset for s in found], [s.byte_length for s in found])):
            table = table.append_column(field, pa.array(values, field.type))
    return table


def _arrays_table(locations: Sequence[Any], shard_path: str) -> pa.Table:
    parts = [key_parts(l.key) for l in locations]
    columns = {
        "sample_id": [l.sample_id for l in locations], "layer": [layer for _, layer in parts],
        "shard_path": [shard_path] * len(locations), "position": [l.position for l in locations],
        "byte_offset": [l.byte_offset for l in locations], "byte_length": [l.byte_length for l in locations],
        "dtype": [l.dtype for l in locations], "shape": [list(l.shape) for l in locations],
    }
    if any(site != RESID_POST for site, _ in parts):
        return pa.table({**columns, "site": [site for site, _ in parts]}, schema=SITES_ARRAYS_SCHEMA)
    return pa.table(columns, schema=ARRAYS_SCHEMA)


def shard_index(samples: Sequence[dict[str, Any]], machine_id: int, shard_id: int, shard_path: str,
                layers: Sequence[int], hidden_size: int, dtype: str, ablation: str | None = None,
                column_types: dict[str, str] | None = None) -> pa.Table:
    """The index rows of one shard; ``position`` is the sample's place in each layer's list. The
    dataset's kept columns (a sample's ``columns``, ``pipeline.prepare --keep_columns``) follow
    as columns of their own, of their ``column_types`` (``KEPT_COLUMN_TYPES`` names; a column not
    there is typed by its values, all null: Arrow's null type, which the merge gives the other
    shards' type, or the one the runs recorded)."""
    n = len(samples)
    table = pa.table({
        "sample_id": [s["sample_id"] for s in samples], "machine_id": [machine_id] * n,
        "shard_id": [shard_id] * n, "shard_path": [shard_path] * n, "position": list(range(n)),
        "num_tokens": [s["num_tokens"] for s in samples], "layers": [list(layers)] * n,
        "hidden_size": [hidden_size] * n, "dtype": [dtype] * n,
        "source": [s["source"] for s in samples], "text_preview": [s["text_preview"] for s in samples],
        "truncated": [bool(s["truncated"]) for s in samples],
        "original_num_tokens": [s["original_num_tokens"] for s in samples], "ablation": [ablation] * n,
    }, schema=pa.schema([field for field in SCHEMA if field not in GENERATION_FIELDS]))
    if generating(samples):
        generation = [s["generation"] for s in samples]
        for field, key in zip(GENERATION_FIELDS, GENERATION_KEYS):
            table = table.append_column(field, pa.array([g.get(key) for g in generation], field.type))
    names = list(dict.fromkeys(name for s in samples for name in (s.get("columns") or {})))
    for name in names:
        kind = KEPT_COLUMN_TYPES.get((column_types or {}).get(name))
        table = table.append_column(name, pa.array([(s.get("columns") or {}).get(name) for s in samples], kind))
    return table


def parquet_bytes(table: pa.Table) -> bytes:
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


def read_parquet(path: str, **kwargs) -> pa.Table:
    """A Parquet file (local or ``gs://``) read whole, ``kwargs`` to ``pq.read_table``.

    Without Arrow's thread pool: after a read from a Python file object, the pool's teardown can
    abort the interpreter at exit ("terminate called without an active exception",
    apache/arrow#34314 and #50482; half the runs here with pyarrow 25). Index files are small."""
    with open_read(path) as f:
        return pq.read_table(io.BytesIO(f.read()), use_threads=False, **kwargs)


def read_index_file(path: str, schema: pa.Schema = SCHEMA) -> pa.Table:
    """An index file read with ``schema`` (a column it lacks, from before the column existed, is
    null) and any columns of its own after them (the dataset's kept columns)."""
    with open_read(path) as f:
        data = io.BytesIO(f.read())
    extra = [field for field in pq.read_schema(data) if field.name not in schema.names]
    return pq.read_table(data, schema=pa.schema(list(schema) + extra), use_threads=False)


def read_arrays_file(path: str) -> pa.Table:
    """A per-array index file with its ``site`` column (hook_resid_post where the file has none),
    and its float8 scales' columns where it has them."""
    table = read_parquet(path)
    if "site" not in table.column_names:
        table = table.append_column("site", pa.array([RESID_POST] * table.num_rows, pa.string()))
    schema = pa.schema([*SITES_ARRAYS_SCHEMA, *(f for f in SCALE_FIELDS if f.name in table.column_names)])
    return table.select(schema.names).cast(schema)


def merge_index_files(paths: Sequence[str], schema: pa.Schema = SCHEMA) -> pa.Table:
    """All rows of the given index files, sorted by ``sample_id`` (then ``layer`` and ``site``, if
    any). Per-array files (``SITES_ARRAYS_SCHEMA``) gain their ``site`` column where they lack it."""
    arrays = schema == SITES_ARRAYS_SCHEMA
    return concat_sorted([read_arrays_file(p) if arrays else read_index_file(p, schema) for p in paths], schema)


def concat_sorted(tables: Sequence[pa.Table], schema: pa.Schema = SCHEMA) -> pa.Table:
    """Index tables read from their files as one, sorted as ``merge_index_files`` sorts."""
    try:  # kept columns: a shard's all-null column takes the others' type, an integer one a float one's
        merged = pa.concat_tables(tables, promote_options="permissive") if tables else schema.empty_table()
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise UserError(f"the index files do not agree on their columns' types: {str(e).splitlines()[0]}") from None
    keys = [("sample_id", "ascending")] + [(name, "ascending") for name in ("layer", "site") if name in schema.names]
    return merged.sort_by(keys)


def write_index(table: pa.Table, path: str) -> None:
    write_bytes(path, parquet_bytes(table))


def find_files(root: str, pattern: str) -> list[str]:
    """Files under ``root`` (local or ``gs://``) whose path relative to it matches ``pattern``."""
    from common.files import match
    base = root.rstrip("/") + "/"
    return [p for p in match(base + "**") if re.fullmatch(pattern, p[len(base):])]


def merged_metadata(machine_metadata: Sequence[dict[str, Any]], table: pa.Table) -> dict[str, Any]:
    """Totals over machines, from each ``metadata.json`` (one per machine, or per process of a
    machine made of several) and the merged index."""
    machines = sorted(machine_metadata, key=lambda m: (m["machine_id"], m.get("process_id") or 0))
    ids = sorted({m["machine_id"] for m in machines})
    completed = [i for i in ids if all(m.get("status") == COMPLETED for m in machines if m["machine_id"] == i)]
    return {"total_machines": len(ids),
            "total_shards": sum(m["total_shards"] for m in machines),
            "total_samples": table.num_rows,
            "total_tokens": int(pc.sum(table["num_tokens"]).as_py() or 0),
            "total_truncated": int(pc.sum(pc.cast(table["truncated"], "int64")).as_py() or 0),
            "total_skipped": sum(m.get("total_skipped", 0) for m in machines),
            "completed_machines": completed,
            "machines": [{k: m.get(k) for k in ("machine_id", "process_id", "status", "total_shards", "total_samples",
                                                 "layers", "sites", "dtype", "compute_dtype", "residual_dtype",
                                                 "hidden_size", "num_hidden_layers", "model", "model_type",
                                                 "stream", "ablation", "tokens", "stats_by", "statistics", "columns",
                                                 "gcs_bucket", "gcs_prefix")} for m in machines]}


MODEL_SHAPE = ("model_type", "num_hidden_layers", "hidden_size")  # a model's family, depth and width


def store_model(metadata: dict[str, Any]) -> dict[str, Any]:
    """The model of a merged store (``merged_metadata``'s): ``model`` (a name, or the names where
    machines differ), and its ``model_type``, ``num_hidden_layers`` and ``hidden_size`` where the
    machines agree (else None)."""
    machines = metadata.get("machines", [])
    models = sorted({m.get("model") for m in machines if m.get("model")})
    out: dict[str, Any] = {"model": models[0] if len(models) == 1 else (models or None)}
    for name in MODEL_SHAPE:
        found = {m.get(name) for m in machines} - {None}
        out[name] = found.pop() if len(found) == 1 else None
    return out


def model_shape(config: Any) -> dict[str, Any]:
    """A model config's (``DecoderConfig``'s) family, depth and width, named as ``store_model`` names them."""
    return {name: getattr(config, name) for name in MODEL_SHAPE}


def check_same_model(recorded: Mapping[str, Any], expected: Mapping[str, Any], what: str, theirs: str) -> None:
    """One line when ``recorded`` (``store_model``'s record: of a store, or of the store a
    directions file was found on) is of another model than ``expected``: another family, depth or
    width, each where both record it. Another model name of the same shape is only a warning: the
    same checkpoint elsewhere, or a base model's direction steering its chat model. ``what`` names
    what holds ``recorded`` ("'d.npz' holds directions"), ``theirs`` the other side ("this model")."""
    other = [f"{name} {recorded[name]} ({theirs}: {expected[name]})" for name in MODEL_SHAPE
             if recorded.get(name) is not None and expected.get(name) is not None and recorded[name] != expected[name]]
    if other:
        raise UserError(f"{what} of another model: {', '.join(other)}")
    if recorded.get("model") and expected.get("model") and recorded["model"] != expected["model"]:
        log.warning("%s of %s; %s is %s", what, recorded["model"], theirs, expected["model"])


def merged_metadata_path(output: str) -> str:
    """``index.parquet`` -> ``merged_metadata.json`` in the same folder."""
    folder = output.rsplit("/", 1)[0] if "/" in output else "."
    return join(folder, "merged_metadata.json")


def index_beside_arrays(arrays: str) -> str:
    """``index_arrays.parquet`` -> ``index.parquet``: the per-sample index an arrays table is beside."""
    if not arrays.endswith("_arrays.parquet"):
        raise UserError(f"{arrays!r} is not a per-array index (<stem>_arrays.parquet): pass the merged index too")
    return arrays[:-len("_arrays.parquet")] + ".parquet"


def arrays_path(output: str) -> str:
    """``index.parquet`` -> ``index_arrays.parquet``: the per-(sample, site, layer) table beside it."""
    return _beside(output, "arrays")


def tokens_path(output: str) -> str:
    """``index.parquet`` -> ``index_tokens.parquet``: what each sample's tokens are, beside it."""
    return _beside(output, "tokens")


def stats_path(output: str) -> str:
    """``index.parquet`` -> ``index_stats.parquet``: the per-(site, layer) statistics beside it."""
    return _beside(output, "stats")


def _beside(output: str, what: str) -> str:
    stem = output[:-len(".parquet")] if output.endswith(".parquet") else output
    return f"{stem}_{what}.parquet"


@dataclasses.dataclass
class CollectedIndex:
    """Every machine's index files under one root, merged in memory (nothing written yet)."""
    table: pa.Table                     # one row per sample, sorted by sample_id
    index_files: list[str]
    arrays_files: list[str]
    machines: list[dict[str, Any]]      # each machine's metadata.json
    stats_files: list[str] = dataclasses.field(default_factory=list)  # per shard (activations.site_stats)
    tokens_files: list[str] = dataclasses.field(default_factory=list)  # per shard (TOKENS_SCHEMA)
    file_machines: dict[str, int] = dataclasses.field(default_factory=dict)  # index file -> its rows' machine_id

    @property
    def duplicates(self) -> int:
        """Rows whose sample id another row has too."""
        ids = self.table["sample_id"]
        return len(ids) - len(pc.unique(ids))


def collect_index(activations_dir: str) -> CollectedIndex:
    """Finds and merges the per-shard indexes and metadata of every machine under the root."""
    try:
        index_files = find_files(activations_dir, r"(.*/)?index/shard_\d{4}\.parquet")
        arrays_files = find_files(activations_dir, r"(.*/)?index/shard_\d{4}_arrays\.parquet")
        stats_files = find_files(activations_dir, r"(.*/)?index/shard_\d{4}_stats\.parquet")
        tokens_files = find_files(activations_dir, r"(.*/)?index/shard_\d{4}_tokens\.parquet")
        metadata_files = find_files(activations_dir, r"(.*/)?metadata\.json")
    except Exception as e:
        raise UserError(f"cannot list {activations_dir!r}: {str(e).splitlines()[0]}") from None
    if not index_files:
        raise UserError(f"no index/shard_NNNN.parquet files under {activations_dir!r}")
    machines = []
    for path in metadata_files:
        with open_read(path) as f:
            machines.append(json.load(f))
    tables = {path: read_index_file(path, SCHEMA) for path in index_files}
    table = typed_columns(concat_sorted(list(tables.values())), machines)
    # Each file's machine from its rows, not its path: a run's --gcs_prefix may name its folder anything.
    file_machines = {path: t["machine_id"][0].as_py() for path, t in tables.items() if t.num_rows}
    return CollectedIndex(table, index_files, arrays_files, machines, stats_files, tokens_files, file_machines)


def typed_columns(table: pa.Table, machines: Sequence[dict[str, Any]]) -> pa.Table:
    """The merged index with each kept column that no shard had a value in (Arrow's null type)
    given the type its runs recorded (``metadata.json``'s ``columns``)."""
    recorded = {name: kind for m in machines for name, kind in (m.get("columns") or {}).items()}
    for i, field in enumerate(table.schema):
        if pa.types.is_null(field.type) and recorded.get(field.name) in KEPT_COLUMN_TYPES:
            kind = KEPT_COLUMN_TYPES[recorded[field.name]]
            table = table.set_column(i, pa.field(field.name, kind), table.column(i).cast(kind))
    return table


def write_merged(collected: CollectedIndex, output: str) -> dict[str, Any]:
    """Writes the index, its arrays table, its statistics (where they are of every stored row:
    ``statistics_coverage``) and tokens tables (where the shards have them) and
    ``merged_metadata.json`` beside it, the statistics' coverage in it; returns the merged metadata."""
    write_index(collected.table, output)
    arrays = merge_index_files(collected.arrays_files, SITES_ARRAYS_SCHEMA)
    write_index(arrays, arrays_path(output))
    stats = merge_stats_files(collected.stats_files) if collected.stats_files else None
    coverage = statistics_coverage(collected, arrays, stats)
    if stats is not None and coverage_problem(coverage, collected.machines) is None:
        write_index(stats, stats_path(output))
    else:  # none, or of part of the store: no file a query or a trainer could take for the whole store's
        delete_file(stats_path(output))  # an earlier merge's, of fewer shards
        if coverage["machines"]:
            log.warning("no %s: %s", stats_path(output), coverage_problem(coverage, collected.machines))
    if collected.tokens_files:
        write_index(merge_index_files(collected.tokens_files, TOKENS_SCHEMA), tokens_path(output))
    summary = {**merged_metadata(collected.machines, collected.table), "statistics": coverage}
    write_bytes(merged_metadata_path(output), (json.dumps(summary, indent=2) + "\n").encode())
    return summary


def merge_stats_files(paths: Sequence[str]) -> pa.Table:
    """The statistics of every listed shard statistics file together, merged in path order."""
    return stats_table(merged_moments(table_moments(read_index_file(p, STATS_SCHEMA)) for p in sorted(paths)))


def statistics_coverage(collected: CollectedIndex, arrays: pa.Table, stats: pa.Table | None) -> dict[str, Any]:
    """What the merged statistics are of (``merged_metadata.json``'s ``statistics``): ``machines``,
    those each shard of which has its statistics file; ``without``, those with a shard without one
    (``--statistics off``); ``mismatch``, where every shard has one, a (site, layer) whose count is
    not the rows the arrays table holds (else None)."""
    have = set(collected.stats_files)
    machines: dict[int | str, list[bool]] = {}
    for path in collected.index_files:
        machine = collected.file_machines.get(path, path.rsplit("/index/", 1)[0])  # a file of no rows: its folder
        machines.setdefault(machine, []).append(path[:-len(".parquet")] + "_stats.parquet" in have)
    without = [m for m, found in machines.items() if not all(found)]
    covered = [m for m, found in machines.items() if all(found)]
    mismatch = _count_mismatch(arrays, stats) if stats is not None and not without else None
    return {"machines": sorted(covered, key=str), "without": sorted(without, key=str), "mismatch": mismatch}


def _count_mismatch(arrays: pa.Table, stats: pa.Table) -> str | None:
    """The first (site, layer) whose statistics count other rows than its arrays hold, described;
    the sites no statistics are measured of (``model.sites.UNMEASURED``: a pattern's rows, the
    sample's heads x tokens wide; the loss, NaN at a sample's last token; token ids and ranks) left
    out, by design."""
    rows = pa.table({"site": arrays["site"], "layer": arrays["layer"], "rows": pc.list_element(arrays["shape"], 0)})
    rows = rows.filter(pc.invert(pc.is_in(rows["site"], pa.array(UNMEASURED))))
    stored = {(r["site"], r["layer"]): r["rows_sum"]
              for r in rows.group_by(["site", "layer"]).aggregate([("rows", "sum")]).to_pylist()}
    overall = stats if "group_by" not in stats.schema.names else stats.filter(pc.is_null(stats["group_by"]))
    counted = {(r["site"], r["layer"]): r["count"] for r in overall.select(["site", "layer", "count"]).to_pylist()}
    for site, layer in sorted(stored.keys() | counted.keys()):
        if stored.get((site, layer), 0) != counted.get((site, layer), 0):
            return (f"{describe_key(array_key(site, layer))}: statistics of {counted.get((site, layer), 0)} rows, "
                    f"{stored.get((site, layer), 0)} stored")
    return None


def _machines(ids: Sequence[int | str]) -> str:
    return f"machine{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"


def coverage_problem(coverage: dict[str, Any], machines: Sequence[dict[str, Any]]) -> str | None:
    """Why a store's statistics are not of every row it stores (``statistics_coverage``'s record),
    in a line's words; None where they are. ``machines``: each machine's ``metadata.json`` (its
    ``statistics`` setting)."""
    covered, without = coverage["machines"], coverage["without"]
    if not covered:
        return ("the store has no statistics (stored with --statistics off, or before statistics existed): "
                "rerun with --statistics device to get them")
    if without:
        off = {m["machine_id"] for m in machines if m.get("statistics") == "off"}
        groups = {"--statistics device": covered, "--statistics off": [m for m in without if m in off],
                  "shards without statistics files": [m for m in without if m not in off]}
        settings = "; ".join(f"{_machines(ids)}: {what}" for what, ids in groups.items() if ids)
        return (f"the statistics are of part of the store ({settings}), so nothing normalizes by them: "
                f"rerun {_machines(without)} with --statistics device (replacing its output) and merge again "
                "with pipeline.index")
    if coverage["mismatch"]:
        return (f"the statistics count other rows than the store holds ({coverage['mismatch']}): a shard's "
                "statistics file is not its shard's")
    return None


def store_moments(index: str, keys: Sequence[ArrayKey] | None = None) -> dict[StatsKey, Moments]:
    """The statistics of the whole store ``index`` was merged from (``index_stats.parquet``
    beside it), of ``keys`` (None: every key and group); one line where it has none, or they are
    not of every row it stores (``coverage_problem``; for an index merged before the coverage was
    recorded, their counts against the rows its arrays table holds). What normalises by them reads
    them here."""
    metadata = json.loads(read_optional(merged_metadata_path(index)) or b"{}")
    coverage = metadata.get("statistics")
    problem = coverage_problem(coverage, metadata.get("machines", [])) if coverage is not None else None
    if problem:
        raise UserError(f"{index!r}: {problem}")
    path = stats_path(index)
    try:
        table = read_index_file(path, STATS_SCHEMA)
    except FileNotFoundError:
        raise UserError(f"no statistics at {path!r} (its shards have none, or it was merged before they existed): "
                        "merge the index again with pipeline.index, or rerun with --statistics device") from None
    if coverage is None:
        mismatch = _count_mismatch(read_index_file(arrays_path(index), SITES_ARRAYS_SCHEMA), table)
        if mismatch:
            raise UserError(f"{index!r}: the statistics count other rows than the store holds ({mismatch}), so "
                            "nothing normalizes by them: merge the index again with pipeline.index to see which "
                            "machines lack them")
    moments = table_moments(table)  # with its groups' rows, if any
    missing = [k for k in keys or () if k not in moments]
    unmeasured = [k for k in missing if key_parts(k)[0] in UNMEASURED]
    if unmeasured:  # not of rows of varying width, NaN or ids
        site = key_parts(unmeasured[0])[0]
        raise UserError(f"{describe_key(unmeasured[0])}: no statistics are measured of {site} "
                        f"({SITES[site].meaning})")
    if missing:
        raise UserError(f"{path!r} has no statistics of {', '.join(map(describe_key, missing))}: merge the "
                        "index again with pipeline.index")
    return moments if keys is None else {k: moments[k] for k in keys}
