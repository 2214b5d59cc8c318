"""Where every exported token goes: a seeded global permutation of the kept tokens of one or
several stores of the same streams, cut into output shards of a fixed number of rows.

The kept tokens (after the token selection and filters, ``activations.token_loader``) are
numbered in a canonical order that no store layout changes: by sample id, then by position.
Token ``t`` goes to slot ``permuted(t)`` of the export: output shard ``slot // rows_per_shard``,
row ``slot % rows_per_shard``. ``permuted`` is a keyed bijection of ``[0, n)`` computed token by
token (a Feistel network over the next power of four, walked back into range), so any worker
places any token without a global sort: the output depends on the seed and the data only, never
on how the work was split. Each output shard is a uniform draw from the whole export; without a
seed, slots are the canonical order. Tokens at slots past ``exported`` (``--max_tokens``, or short
of a format's last whole row) are left out: with a seed, a uniform draw of them.

Several stores (``name=index``, the first one leading) are joined on (sample id, position): the
same samples, the same kept positions and the same token ids, or the plan refuses them in one
line naming the first sample that differs.

What a worker needs of the plan row by row (each leading row's first canonical number, its
sample's token ids, its row in every other store) the planner writes to files under the export's
spill (``PlanFiles``); a worker reads a unit's share of them with ranged reads, so neither the job
graph nor a worker holds them for the whole store.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from activations.index import store_moments
from activations.reader import storage_dtype
from activations.token_ids import TokenIds
from activations.token_loader import LoaderConfig, TokenLoader
from common.cli import UserError
from common.files import join, read_range, write_bytes
from model.sites import ArrayKey, describe_key, key_parts

ROUNDS = 4  # Feistel rounds: 4 give a pseudo-random permutation of the domain
# The shuffle's passes (transforms.export): one pass spreads every unit over every output shard, so
# a shard gathers (export bytes / a worker's flush) sections of (shard bytes x flush / export bytes)
# each: fine up to a few hundred shards, then too many too small reads. Two passes go through
# buckets of about sqrt(shards) shards first, for sections about sqrt(shards) times larger.
SHUFFLES = ("auto", "1", "2")
TWO_PASS_SHARDS = 256
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def permuted(tokens: np.ndarray, n: int, seed: int | None) -> np.ndarray:
    """The slots [len] int64 of canonical token numbers ``tokens`` (each in [0, n)) under the
    seed's bijection of [0, n); ``seed`` None: the identity."""
    tokens = np.asarray(tokens, np.int64)
    if seed is None or n <= 1:
        return tokens
    half = max(1, (int(n - 1).bit_length() + 1) // 2)  # the domain: 4^half >= n, < 4n
    low = np.uint64((1 << half) - 1)
    keys = splitmix64(np.arange(1, ROUNDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
                  ^ splitmix64(np.full(ROUNDS, seed, np.uint64)))

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & low
        for key in keys:
            left, right = right, left ^ (splitmix64(right ^ key) & low)
        return (left << np.uint64(half)) | right

    out = encrypt(tokens.astype(np.uint64))
    outside = out >= np.uint64(n)
    while outside.any():  # cycle-walking: each value leaves the range at most a few times
        out[outside] = encrypt(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """One store of an export: its name (the column prefix where there are several) and index."""
    name: str
    index: str


def parse_stores(text: str) -> tuple[StoreSpec, ...]:
    """``--store base=gs://.../index.parquet,chat=...``: named stores, the first one leading."""
    stores = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, index = part.partition("=")
        if not sep or not name or not index or not name.replace("_", "").isalnum():
            raise UserError(f"--store {part!r}: NAME=INDEX, NAME of letters, digits and _")
        stores.append(StoreSpec(name, index))
    if len({s.name for s in stores}) != len(stores):
        raise UserError(f"--store names a store twice: {text}")
    return tuple(stores)


def column_name(store: str | None, key: ArrayKey) -> str:
    """A column's name: the key's hook name (``blocks.12.hook_resid_post``), after its store's name
    where several stores are joined (``chat/blocks.12.hook_resid_post``)."""
    site, layer = key_parts(key)
    hook = f"blocks.{layer}.{site}"
    return hook if store is None else f"{store}/{hook}"


@dataclasses.dataclass(frozen=True)
class UnitPlan:
    """A unit's share of the plan (rows ``start..stop-1`` of the leading store)."""
    offsets: np.ndarray            # [rows] int64: each row's first kept token's canonical number
    token_ids: TokenIds            # the rows' samples' token ids
    rows: dict[int, np.ndarray]    # other store -> [rows] int64: the same samples' rows there


@dataclasses.dataclass(frozen=True)
class PlanFiles:
    """The plan's per-row arrays as raw little-endian files under ``root`` (written once by the
    planner, read by ranged reads): ``offsets.bin`` int64 [rows]; ``token_starts.bin`` int64
    [rows + 1] and ``token_ids.bin`` int32, each row's sample's token ids in row order;
    ``rows_S.bin`` int64 [rows] for each other store S."""
    root: str
    others: tuple[int, ...]        # the other stores' numbers

    def write(self, offsets: np.ndarray, loaders: Sequence[TokenLoader]) -> None:
        lead = loaders[0]
        table, sample_ids = lead.token_ids, lead.stored.sample_id
        where = np.searchsorted(table.ids, sample_ids)  # each leading row's sample in the token ids
        lengths = table.lengths[where]
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype("<i8")
        ids = np.empty(int(starts[-1]), "<i4")  # in row order: one more copy of the ids, no more
        for row, (first, length) in enumerate(zip(table.starts[where].tolist(), lengths.tolist())):
            ids[starts[row]:starts[row] + length] = table.flat[first:first + length]
        write_bytes(join(self.root, "offsets.bin"), memoryview(np.ascontiguousarray(offsets, "<i8")))
        write_bytes(join(self.root, "token_starts.bin"), memoryview(starts))
        write_bytes(join(self.root, "token_ids.bin"), memoryview(ids))
        for store in self.others:
            theirs = loaders[store].stored.sample_id
            order = np.argsort(theirs, kind="stable")
            rows = order[np.searchsorted(theirs, sample_ids, sorter=order)]  # the planner checked they are there
            write_bytes(join(self.root, f"rows_{store}.bin"), memoryview(np.ascontiguousarray(rows, "<i8")))

    def unit(self, bounds: tuple[int, int], sample_ids: np.ndarray) -> UnitPlan:
        """The share of rows ``bounds`` (whose samples are ``sample_ids`` [rows])."""
        start, stop = bounds
        starts = self._read("token_starts.bin", "<i8", start, stop + 1)
        flat = self._read("token_ids.bin", "<i4", int(starts[0]), int(starts[-1])).astype(np.int32)
        order = np.argsort(sample_ids, kind="stable")  # TokenIds looks samples up by sorted id
        token_ids = TokenIds(np.asarray(sample_ids, np.int64)[order], (starts[:-1] - starts[0])[order],
                             np.diff(starts)[order], flat)
        return UnitPlan(self._read("offsets.bin", "<i8", start, stop), token_ids,
                        {store: self._read(f"rows_{store}.bin", "<i8", start, stop) for store in self.others})

    def _read(self, name: str, dtype: str, start: int, stop: int) -> np.ndarray:
        size = np.dtype(dtype).itemsize
        data = read_range(join(self.root, name), start * size, (stop - start) * size) if stop > start else b""
        return np.frombuffer(data, dtype).astype(np.int64 if dtype == "<i8" else np.int32)


@dataclasses.dataclass
class ExportPlan:
    """An export's tokens and their slots: ``loaders`` (one per store, the first leading) read the
    kept tokens, numbered canonically (``files``: each leading row's first number); of their
    ``total``, the tokens at slots below ``exported`` go to ``shards`` shards of ``rows_per_shard``
    rows (the last one shorter), the others are left out (a uniform draw of them when shuffled)."""
    stores: tuple[StoreSpec, ...]
    loader_configs: tuple[LoaderConfig, ...]
    files: PlanFiles
    total: int                 # kept tokens (after the selection and filters)
    exported: int              # <= total: --max_tokens, whole rows of a format's row (SAELens's context)
    rows_per_shard: int
    shards_per_bucket: int     # 1: one shuffle pass; more: a first pass to buckets of this many shards (SHUFFLES)
    seed: int | None
    columns: dict[str, tuple[int, ArrayKey]]  # column name -> (store number, key)
    widths: dict[str, int]                    # column name -> width

    @property
    def shards(self) -> int:
        return max(1, -(-self.exported // self.rows_per_shard))

    @property
    def passes(self) -> int:
        return 1 if self.shards_per_bucket == 1 else 2

    def routed(self, slots: np.ndarray, first_pass: bool) -> np.ndarray:
        """[n] where tokens at ``slots`` go next: their bucket in a two-pass shuffle's first pass,
        else their output shard."""
        shards = slots // self.rows_per_shard
        return shards // self.shards_per_bucket if first_pass and self.passes == 2 else shards

    @property
    def shard_bytes(self) -> int:
        """An output shard's arrays, in bytes (its last one's fewer)."""
        itemsize = storage_dtype(self.loader_configs[0].dtype).itemsize
        return self.rows_per_shard * sum(self.widths.values()) * itemsize

    def shard_rows(self, shard: int) -> int:
        """Rows of output shard ``shard``."""
        return min(self.rows_per_shard, self.exported - shard * self.rows_per_shard)


def shards_per_bucket(shards: int, passes: str) -> int:
    """How many output shards a first pass's bucket holds (1: one pass). ``auto``: two passes past
    ``TWO_PASS_SHARDS`` shards, buckets of about sqrt(shards) shards, so that both passes' spill
    sections are about sqrt(shards) times a one-pass section."""
    if passes == "1" or (passes == "auto" and shards <= TWO_PASS_SHARDS):
        return 1
    return max(1, math.isqrt(shards - 1) + 1)


def make_plan(stores: Sequence[StoreSpec], keys: Sequence[ArrayKey], shard_bytes: int, seed: int | None,
              files: str, max_tokens: int | None = None, row_tokens: int = 1, passes: str = "auto",
              **loader_settings) -> tuple[ExportPlan, list[TokenLoader], np.ndarray]:
    """The plan of an export of ``keys`` of every store, its output shards of about
    ``shard_bytes`` of arrays each, in whole rows of ``row_tokens`` tokens, at most ``max_tokens``
    tokens, shuffled in ``passes`` (``SHUFFLES``); the loaders it read them with (to reuse on this
    process) and the leading rows' offsets, for ``plan.files.write`` (under ``files``):
    ``loader_settings`` go to every store's ``LoaderConfig`` (``tokens``,
    ``exclude_first_positions``, ``exclude_token_ids``, ``normalize``, ``dtype``, ...)."""
    if seed is not None and not 0 <= seed < 2**63:
        raise UserError(f"--seed must be below 2^63 for an export, got {seed}")
    configs = tuple(LoaderConfig(index=s.index, layers=tuple(keys), seed=None, with_token_ids=True,
                                 **loader_settings) for s in stores)
    loaders = [TokenLoader(c) for c in configs]
    lead = loaders[0]
    order = np.argsort(lead.stored.sample_id, kind="stable")  # canonical: by sample id
    counts = lead.kept_tokens[order]
    offsets = np.empty(len(order), np.int64)
    offsets[order] = np.cumsum(counts) - counts
    for spec, loader in zip(stores[1:], loaders[1:]):
        _check_joinable(stores[0], lead, spec, loader)
    several = len(stores) > 1
    columns = {column_name(s.name if several else None, key): (i, key)
               for i, s in enumerate(stores) for key in loaders[i].config.keys}
    widths = {name: loaders[i].stored.width[key] for name, (i, key) in columns.items()}
    row_bytes = sum(widths.values()) * storage_dtype(configs[0].dtype).itemsize
    rows_per_shard = max(row_tokens, shard_bytes // row_bytes // row_tokens * row_tokens)
    total = int(counts.sum())
    if total == 0:
        raise UserError(f"{stores[0].index}: no token is left to export (after the selection and filters)")
    exported = min(total, total if max_tokens is None else max_tokens)
    exported -= exported % row_tokens
    if exported == 0:
        raise UserError(f"{min(total, max_tokens or total)} tokens selected: fewer than one row of "
                        f"--context_size {row_tokens}")
    plan_files = PlanFiles(files, tuple(range(1, len(stores))))
    per_bucket = shards_per_bucket(-(-exported // rows_per_shard), passes)
    return (ExportPlan(tuple(stores), configs, plan_files, total, exported, rows_per_shard, per_bucket, seed,
                       columns, widths), loaders, offsets)


def _check_joinable(lead_spec: StoreSpec, lead: TokenLoader, spec: StoreSpec, other: TokenLoader) -> None:
    """The second store holds the leading store's samples with the same tokens (ids) and the
    same kept rows, or ``UserError`` naming the first sample that differs."""
    ids, theirs = lead.stored.sample_id, other.stored.sample_id
    missing = np.setdiff1d(ids, theirs)
    if len(missing) or len(theirs) != len(ids):
        example = missing[0] if len(missing) else np.setdiff1d(theirs, ids)[0]
        raise UserError(f"stores {lead_spec.name} and {spec.name} hold different samples (e.g. sample {example}): "
                        "export stores of the same streams")
    where = dict(zip(theirs.tolist(), range(len(theirs))))
    for row, sample_id in enumerate(ids.tolist()):
        mine, other_row = lead.token_ids[sample_id], where[sample_id]
        if not np.array_equal(mine, other.token_ids[sample_id]):
            raise UserError(f"stores {lead_spec.name} and {spec.name} differ in sample {sample_id}'s tokens: "
                            "a different tokenizer or stream")
        if not np.array_equal(lead.kept(row)[1], other.kept(other_row)[1]):
            raise UserError(f"stores {lead_spec.name} and {spec.name} keep different tokens of sample {sample_id} "
                            f"({lead.kept_tokens[row]} and {other.kept_tokens[other_row]}): one was stored with a "
                            "token selection, or truncated otherwise")


def column_statistics(plan: ExportPlan, normalize: str) -> dict[str, Any] | None:
    """Per column, its store's statistics (what ``normalize`` scales by), for ``statistics.json``;
    None where a store has none, or none of every row it stores (``store_moments``), unless they are needed."""
    out = {}
    for store, spec in enumerate(plan.stores):
        keys = {name: key for name, (i, key) in plan.columns.items() if i == store}
        try:
            moments = store_moments(spec.index, list(keys.values()))
        except UserError:
            if normalize != "none":
                raise
            return None
        for name, key in keys.items():
            m = moments[key]
            out[name] = {"count": m.count, "mean_norm": m.mean_norm, "mean": m.mean.tolist(),
                         "variance": m.variance.tolist(), "applied": normalize}
    return {name: out[name] for name in plan.columns}


def describe_columns(plan: ExportPlan) -> str:
    return ", ".join(f"{name} ({describe_key(key)}, {plan.widths[name]})" for name, (_, key) in plan.columns.items())
