"""Shuffled token batches from stored activations: ``[batch, width]`` arrays drawn across every
shard, for training sparse autoencoders, transcoders and probes.

    loader = TokenLoader(LoaderConfig(index="index.parquet", layers=(12,), batch_tokens=4096, seed=0))
    for batch in loader:                 # one epoch: every kept token exactly once
        batch.activations[12]            # np.ndarray [batch, hidden], float32
    sae_data = loader.arrays(as_torch=True)  # endless torch tensors, reshuffled each epoch

``layers`` holds array keys (``model.sites``): a layer number for block outputs, or the hook name
of any stored site (``"blocks.12.hook_mlp_out"``, ``"blocks.12.attn.hook_z"``), each at its own
width; ``"blocks.12.hook_resid_post"`` is key 12. A pattern site (``attn.hook_pattern``,
``attn.hook_attn_scores``), whose rows' width is the sample's heads x tokens, is refused in one
line (``activations.reader.read_activations`` returns its arrays as stored). ``normalize``
scales each key by the run's statistics (``index_stats.parquet``): ``mean_norm`` or
``standardize``. ``tokens`` reads only the tokens of a selection (``activations.selection``:
``assistant,-special``, ``last``, ...), from what the index's tokens table says each stored row
is (``activations.stored_tokens``); a pooled one (``mean:assistant``) gives one row a sample,
the mean of its selected tokens.

How: the epoch's blocks (runs of neighbouring arrays, one ranged read per key: see
``token_plan``) are read in a random order by a pool of threads, ``read_ahead`` blocks ahead of
the consumer, each array's gzip member decompressed alone and CRC-checked. Their tokens pass
the filters and enter a shuffle buffer of ``buffer_tokens`` rows; whenever it is full, a batch of
random rows leaves it. The result depends only on the seed and the epoch, never on thread
timing. With ``seed=None`` nothing is shuffled: tokens come in storage order (shard by shard,
position by position; see ``token_plan``).

Memory: the buffer (``buffer_tokens`` x (the keys' widths summed x 4 + 20) bytes, allocated
once) plus ``read_ahead + 1`` blocks (each at most ``block_bytes`` of shard, or one array if
larger, held compressed, decoded and, from float16 / bfloat16, converted, from float8
dequantized), plus the plan (~50 bytes a sample and 16 a key) and, when token ids are used, 4
bytes a token; with a selection
(read or stored), the index's tokens table as flat arrays (about 9 bytes a role run, 4 a special
token and 4 a stored position).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from activations.index import store_moments
from activations.reader import CorruptShardError, decode_array, storage_dtype
from activations.token_buffer import TokenBuffer
from activations.token_ids import TokenIds, load_token_ids, machine_streams
from activations.selection import parse_selection, pooled_row
from activations.site_stats import Moments
from activations.stored_tokens import NO_POSITION, kept_rows, read_stored_tokens
from activations.token_plan import StoredArrays, blocks, stored_arrays
from common.cli import UserError
from common.files import read_range
from model.config import QUANTIZED_DTYPES, STORED_DTYPES
from model.quantize import dequantize
from model.sites import ArrayKey, describe_key, normalized_key

T = TypeVar("T")
NORMALIZATIONS = ("none", "mean_norm", "standardize")


# Why a stored token is not read: outside the selection, among the first positions left out, an excluded id.
DROP_REASONS = ("selection", "first_positions", "token_ids")


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """What a ``TokenLoader`` reads, and how it batches and shuffles."""
    index: str                     # merged index.parquet (local or gs://); index_arrays.parquet beside it
    layers: tuple[ArrayKey, ...]   # array keys to read: layers, or hook names (model.sites); a batch
                                   # holds the same tokens of each
    batch_tokens: int = 4096       # tokens per batch (the last of an epoch may be short, see drop_last)
    seed: int | None = 0           # shuffle seed (>= 0); None: no shuffle (storage order)
    buffer_tokens: int = 1 << 18   # shuffle buffer rows: a batch is drawn from this many tokens
    exclude_first_positions: int = 0           # drop each sample's first k tokens (attention sinks)
    exclude_token_ids: tuple[int, ...] = ()    # drop tokens with these ids (e.g. special tokens)
    with_token_ids: bool = False   # each batch carries its tokens' ids (read from the streams)
    streams_dir: str | None = None  # streams holding the token ids (default: those the runs recorded)
    dtype: str = "float32"         # dtype of the returned activations (stored ones are converted)
    drop_last: bool = False        # drop an epoch's last, short batch
    max_tokens: int | None = None  # stop an epoch after this many tokens
    read_threads: int = 4          # threads reading and decompressing blocks
    read_ahead: int = 6            # blocks read ahead of the consumer
    block_bytes: int = 8 << 20     # a read covers neighbouring arrays up to this many bytes
    normalize: str = "none"        # none | mean_norm | standardize, per key by the stored statistics
    tokens: str | None = None      # a token selection (activations.selection), e.g. assistant,-special;
                                   # pooled (mean): one row a sample, position -1

    def validate(self) -> None:
        if isinstance(self.layers, (str, int)):
            raise UserError(f"layers is a tuple of layers or hook names, got {self.layers!r}")
        if not self.layers:
            raise UserError("name at least one layer to load")
        if len(set(self.keys)) != len(self.keys):
            raise UserError(f"a layer is named twice in {list(self.layers)}")
        if self.normalize not in NORMALIZATIONS:
            raise UserError(f"normalize must be one of {', '.join(NORMALIZATIONS)}, got {self.normalize!r}")
        if self.seed is not None and self.seed < 0:
            raise UserError(f"the seed must be >= 0, got {self.seed}")
        for name in ("batch_tokens", "buffer_tokens", "read_threads", "read_ahead", "block_bytes"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.seed is not None and self.buffer_tokens < self.batch_tokens:
            raise UserError(f"the shuffle buffer ({self.buffer_tokens} tokens) must hold at least "
                            f"one batch ({self.batch_tokens} tokens)")
        if self.exclude_first_positions < 0:
            raise UserError(f"exclude_first_positions must be >= 0, got {self.exclude_first_positions}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UserError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.dtype in QUANTIZED_DTYPES:
            raise UserError(f"dtype {self.dtype}: the token loader returns rows of one dtype, and float8 rows need "
                            "their scales: it reads a float8 store dequantized (dtype float32, float16 or bfloat16); "
                            "activations.reader.read_activations(..., dequantize=False) returns them as stored")
        if self.dtype not in STORED_DTYPES:
            raise UserError(f"dtype must be one of {', '.join(STORED_DTYPES)}, got {self.dtype!r}")
        parse_selection(self.tokens)

    @property
    def keys(self) -> tuple[ArrayKey, ...]:
        """``layers`` as canonical array keys (``blocks.6.hook_resid_post`` -> 6)."""
        return tuple(normalized_key(k) for k in self.layers)

    @property
    def needs_token_ids(self) -> bool:
        return self.with_token_ids or bool(self.exclude_token_ids)


def row_bytes(widths: Iterable[int], dtype: str = "float32", with_token_ids: bool = True) -> int:
    """Bytes one token takes in the shuffle buffer: its activations (one of each width), sample id
    and position (8 bytes each) and token id (4)."""
    return sum(widths) * storage_dtype(dtype).itemsize + 16 + 4 * with_token_ids


def scaling(moments: Moments, how: str) -> tuple[np.ndarray, np.ndarray]:
    """(shift, scale), each [width] float32: ``(x - shift) * scale`` normalises ``x`` by ``how``.

    ``mean_norm``: x * sqrt(width) / mean_norm, tokens of norm sqrt(width) on average (how CLT and
    crosscoder trainers scale each site, and SAELens's ``expected_average_only_in``);
    ``standardize``: (x - mean) / std per dimension (a dimension of zero variance only centred)."""
    width = len(moments.mean)
    if how == "mean_norm":
        factor = np.sqrt(width) / moments.mean_norm if moments.mean_norm > 0 else 1.0
        return np.zeros(width, np.float32), np.full(width, factor, np.float32)
    std = np.sqrt(moments.variance)
    return moments.mean.astype(np.float32), (1 / np.where(std > 0, std, 1.0)).astype(np.float32)


@dataclasses.dataclass
class TokenBatch:
    """Tokens drawn together: row ``i`` of every array is the same token."""
    activations: dict[ArrayKey, np.ndarray]   # key -> [batch, width of the key]
    sample_ids: np.ndarray                    # [batch] int64
    positions: np.ndarray                     # [batch] int64: the token's place in its sample
    token_ids: np.ndarray | None              # [batch] int32, with with_token_ids

    def __len__(self) -> int:
        return len(self.sample_ids)


@dataclasses.dataclass
class LoaderStats:
    """Counters over every epoch read so far; each dropped token counted under its reason."""
    blocks_read: int = 0
    bytes_read: int = 0              # shard bytes fetched (compressed)
    tokens_read: int = 0             # tokens stored in the samples read, before the filters
    tokens_returned: int = 0
    dropped: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    peak_buffered_tokens: int = 0    # the most tokens the shuffle buffer ever held


@dataclasses.dataclass
class Block:
    """One block's tokens, filtered, and what reading it cost."""
    pieces: list[dict[Any, np.ndarray]]   # per sample: {key: [k, width], "sample_ids", ...}
    bytes_read: int
    tokens_read: int
    dropped: dict[str, int]


class TokenLoader:
    """Batches of tokens from a merged index; iterating it reads one epoch (epoch 0)."""

    def __init__(self, config: LoaderConfig, stored: StoredArrays | None = None, token_ids: TokenIds | None = None):
        """``stored``: ``stored_arrays(config.index, config.keys)``, if already read; ``token_ids``:
        the samples' token ids, if already read (or, for ``read_block`` alone, those of the rows
        about to be read: ``use_token_ids``), instead of the streams'."""
        config.validate()  # before reading anything
        self.config = config
        self.stored = stored if stored is not None else stored_arrays(config.index, config.keys)
        self.selection = parse_selection(config.tokens)
        self.pooled_store = self.stored.selection is not None and self.stored.selection.pooled
        if self.pooled_store and (config.exclude_first_positions or config.exclude_token_ids):
            raise UserError(f"the store holds one pooled row a sample (--tokens {self.stored.selection}): it has no "
                            "token positions or ids to leave out")
        # What each stored row is, where the store or the read selects tokens.
        self.tokens = self.stored.tokens or (read_stored_tokens(config.index) if self.selection else None)
        self.token_ids = token_ids
        if token_ids is None and config.needs_token_ids:
            self.token_ids = self._token_ids(self.stored)
        self.scaling = {}  # key -> (shift, scale), when normalising
        if config.normalize != "none":
            moments = store_moments(config.index, config.keys)  # refused where not of every stored row
            self.scaling = {key: scaling(m, config.normalize) for key, m in moments.items()}
        self.stats = LoaderStats()

    @property
    def metadata(self) -> dict[str, Any]:
        """``merged_metadata.json`` beside the index ({} if absent)."""
        return self.stored.metadata

    @property
    def total_tokens(self) -> int:
        """Tokens one epoch returns (after the filters, ``max_tokens`` and ``drop_last``)."""
        total = int(self.kept_tokens.sum())
        if self.config.max_tokens is not None:
            total = min(total, self.config.max_tokens)
        if self.config.drop_last:
            total -= total % self.config.batch_tokens
        return total

    def __iter__(self) -> Iterator[TokenBatch]:
        return self.batches()

    def batches(self, epoch: int = 0) -> Iterator[TokenBatch]:
        """One epoch: every kept token once, shuffled by (seed, epoch)."""
        c = self.config
        rng = None if c.seed is None else np.random.default_rng([c.seed, epoch])
        plan = blocks(self.stored, rng, c.block_bytes)
        # Unshuffled, one batch of room is all a buffer needs; never more than the epoch holds.
        room = c.buffer_tokens if rng is not None else c.batch_tokens
        buffer = TokenBuffer(max(1, min(room, int(self.kept_tokens.sum()))), self._layout(), rng)
        remaining = self.total_tokens
        try:
            for block in in_order(self.read_block, plan, c.read_threads, c.read_ahead):
                self._count(block)
                for piece in block.pieces:
                    for part in _split(piece, buffer):
                        buffer.put(part)
                        while buffer.free == 0 and remaining:
                            batch = buffer.take(min(c.batch_tokens, remaining))
                            remaining -= len(batch["positions"])
                            yield self._batch(batch)
                        if not remaining:
                            return
            while remaining and buffer.size:
                batch = buffer.take(min(c.batch_tokens, buffer.size, remaining))
                remaining -= len(batch["positions"])
                yield self._batch(batch)
        finally:
            self.stats.peak_buffered_tokens = max(self.stats.peak_buffered_tokens, buffer.peak)

    def arrays(self, layer: ArrayKey | None = None, epochs: int | None = None,
               as_torch: bool = False) -> Iterator[Any]:
        """``[batch, width]`` arrays of one key (a layer or hook name; default: the only one
        loaded), numpy or torch tensors, over ``epochs`` epochs (None: without end, reshuffled
        each epoch): e.g. SAELens's ``data_provider=loader.arrays(as_torch=True)``."""
        keys = self.config.keys
        if layer is None:
            if len(keys) != 1:
                raise UserError(f"name the layer to yield: the loader reads {list(self.config.layers)}")
            layer = keys[0]
        key = normalized_key(layer)
        if key not in keys:
            raise UserError(f"{describe_key(key)} is not among the loaded keys "
                            f"({', '.join(map(describe_key, keys))})")
        convert = _torch_from_numpy() if as_torch else (lambda array: array)
        for epoch in itertools.count() if epochs is None else range(epochs):
            for batch in self.batches(epoch):
                yield convert(batch.activations[key])

    def _token_ids(self, stored: StoredArrays) -> TokenIds:
        machines = sorted(set(stored.machine_id.tolist()))
        streams = machine_streams(machines, stored.metadata.get("machines", []), self.config.streams_dir)
        return load_token_ids(stored.sample_id, stored.machine_id, stored.sample_tokens, streams)

    @property
    def pools(self) -> bool:
        """Whether the read pools each sample's selected rows into one."""
        return self.selection is not None and self.selection.pooled

    def use_token_ids(self, token_ids: TokenIds) -> None:
        """Reads with these token ids from now on (an export's worker: those of its unit's samples)."""
        self.token_ids = token_ids

    @functools.cached_property
    def kept_tokens(self) -> np.ndarray:
        """[samples] rows of each stored sample left after the selection and filters."""
        return self._kept_tokens(self.stored)

    def _kept_tokens(self, arrays: StoredArrays) -> np.ndarray:
        if self.tokens is None and not self.config.exclude_token_ids:
            return np.maximum(arrays.num_tokens - self.config.exclude_first_positions, 0)
        kept = np.array([len(self.kept(row)[0]) for row in range(len(arrays))], dtype=np.int64)
        return np.minimum(kept, 1) if self.pools else kept

    def kept(self, row: int) -> tuple[np.ndarray | slice, np.ndarray, dict[str, int]]:
        """(which of a stored sample's rows pass the selection and the filters: a slice where only
        leading ones go, their token positions, how many went for each reason)."""
        a, c = self.stored, self.config
        sample_id, rows = int(a.sample_id[row]), int(a.num_tokens[row])
        if self.tokens is None and not c.exclude_token_ids:
            first = min(c.exclude_first_positions, rows)
            return slice(first, rows), np.arange(first, rows), {"first_positions": first}
        if self.tokens is None:
            kept, positions = np.arange(rows), np.arange(rows)
        else:
            kept, positions = kept_rows(self.selection, self.tokens, sample_id)
        dropped = {"selection": rows - len(kept)}
        if self.pooled_store:  # rows without positions (the filters are refused for them)
            return kept, positions, dropped
        late = positions >= c.exclude_first_positions
        dropped["first_positions"] = int((~late).sum())
        kept, positions = kept[late], positions[late]
        if c.exclude_token_ids:
            allowed = ~np.isin(self.token_ids[sample_id][positions], c.exclude_token_ids)
            dropped["token_ids"] = int((~allowed).sum())
            kept, positions = kept[allowed], positions[allowed]
        return kept, positions, dropped

    def _layout(self) -> dict[Any, tuple[tuple[int, ...], np.dtype]]:
        out_dtype = storage_dtype(self.config.dtype)
        layout = {key: ((self.stored.width[key],), out_dtype) for key in self.config.keys}
        layout.update(sample_ids=((), np.dtype(np.int64)), positions=((), np.dtype(np.int64)))
        if self.config.with_token_ids:
            layout["token_ids"] = ((), np.dtype(np.int32))
        return layout

    def read_block(self, bounds: tuple[int, int]) -> Block:
        """Reads and decodes rows ``start..stop-1`` (one ranged read per key) and filters
        their tokens (in a reader thread of ``batches``, or for an export's worker)."""
        start, stop = bounds
        a, c = self.stored, self.config
        path = a.shard_paths[a.shard[start]]
        per_key, fetched = {}, 0
        for key in c.keys:
            offsets, lengths = a.offset[key], a.length[key]
            first, span = int(offsets[start]), int(offsets[stop - 1] + a.extent[key][stop - 1] - offsets[start])
            try:
                data = memoryview(read_range(path, first, span))
            except Exception as e:  # a missing shard, GCS out of reach after its retries
                raise UserError(f"cannot read {path} (bytes {first}..{first + span - 1}): "
                                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
            fetched += len(data)
            if len(data) != span:
                raise CorruptShardError(f"shard truncated: {path}: got {len(data)} of {span} bytes "
                                        f"from byte {first}")
            per_key[key] = [
                decode_array(data[offsets[i] - first:offsets[i] - first + lengths[i]], a.dtype[key],
                             (a.num_tokens[i], a.width[key]), path.endswith(".gz"),
                             f"{path} at byte {offsets[i]} (sample {a.sample_id[i]}, {describe_key(key)})")
                for i in range(start, stop)]
            if key in a.scale_offset:  # float8 rows, dequantized with their scales
                at, size = a.scale_offset[key], a.scale_length[key]
                per_key[key] = [dequantize(values, decode_array(
                    data[at[i] - first:at[i] - first + size[i]], "float32", (a.num_tokens[i],), path.endswith(".gz"),
                    f"{path} at byte {at[i]} (the scales of sample {a.sample_id[i]}, {describe_key(key)})"))
                    for i, values in zip(range(start, stop), per_key[key])]
        pieces, dropped = [], dict.fromkeys(LoaderStats().dropped, 0)
        for k, row in enumerate(range(start, stop)):
            sample_id = int(a.sample_id[row])
            rows, positions, gone = self.kept(row)  # rows: a slice where only leading ones go (a view)
            for reason, n in gone.items():
                dropped[reason] += n
            piece = {key: self._converted(key, per_key[key][k][rows]) for key in c.keys}
            if self.pools:  # the mean of the selected rows: one row, or none
                piece = {key: pooled_row(values) for key, values in piece.items()}
                positions = np.full(min(1, len(positions)), NO_POSITION, np.int64)
            piece["positions"] = positions
            piece["sample_ids"] = np.full(len(positions), sample_id, dtype=np.int64)
            if c.with_token_ids:
                ids = self.token_ids[sample_id]  # a pooled row's: NO_POSITION
                piece["token_ids"] = np.where(positions >= 0, ids[np.maximum(positions, 0)], NO_POSITION)
            pieces.append(piece)
        return Block(pieces, fetched, int(a.num_tokens[start:stop].sum()), dropped)

    def _converted(self, key: ArrayKey, values: np.ndarray) -> np.ndarray:
        """[k, width] stored values in the output dtype, normalised if asked (in float32)."""
        if self.scaling:
            shift, scale = self.scaling[key]
            values = (values.astype(np.float32) - shift) * scale
        return values.astype(storage_dtype(self.config.dtype), copy=False)

    def _count(self, block: Block) -> None:
        self.stats.blocks_read += 1
        self.stats.bytes_read += block.bytes_read
        self.stats.tokens_read += block.tokens_read
        for reason, n in block.dropped.items():
            self.stats.dropped[reason] += n

    def _batch(self, rows: dict[Any, np.ndarray]) -> TokenBatch:
        self.stats.tokens_returned += len(rows["positions"])
        return TokenBatch({key: rows[key] for key in self.config.keys}, rows["sample_ids"],
                          rows["positions"], rows.get("token_ids"))


def _torch_from_numpy() -> Callable[[np.ndarray], Any]:
    """numpy -> torch without a copy; bfloat16 (ml_dtypes, which torch does not know) by its bits."""
    import torch

    def convert(array: np.ndarray):
        if array.dtype == storage_dtype("bfloat16"):
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
    return convert


def _split(piece: dict[Any, np.ndarray], buffer: TokenBuffer) -> Iterator[dict[Any, np.ndarray]]:
    """A sample's rows in parts that fit the buffer's free room as it is emptied between them."""
    n, done = len(piece["positions"]), 0
    while done < n:
        k = min(buffer.free, n - done)
        yield {name: column[done:done + k] for name, column in piece.items()}
        done += k


def in_order(fn: Callable[[T], Any], items: Sequence[T], threads: int, ahead: int) -> Iterator[Any]:
    """``fn(item)`` for each item, computed by ``threads`` threads at most ``ahead`` items ahead of
    the consumer, yielded in the items' order. Closing the iterator cancels what has not started."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="token-reader")
    pending: collections.deque = collections.deque()
    todo = iter(items)
    try:
        for item in itertools.islice(todo, ahead):
            pending.append(pool.submit(fn, item))
        while pending:
            result = pending.popleft().result()
            for item in itertools.islice(todo, 1):
                pending.append(pool.submit(fn, item))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
