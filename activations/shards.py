"""The shard format, readable by plain ``pickle.load(gzip.open(path))``, with random access.

    {key: [{"sample_idx": id, "sample_id": id, "activation": np.ndarray [num_tokens, width],
            "shape": (num_tokens, width), "text_preview": str, "source": str}, ...], ...}

Stored as float8 (``--activation_dtype float8_e4m3fn``, ``model.quantize``), ``"activation"`` holds
``float8_e4m3fn`` rows and each entry also holds ``"scale"`` (np.float32 [num_tokens], right after
it): a row's values are ``activation[i] * scale[i]``.

Stored with a token selection (``runners.tpu_host --tokens``), each entry also holds
``"positions"`` (np.int32: which tokens of the sample its rows are, one per row; pooled, the
tokens its one row averages) and, pooled, ``"pooled": "mean"``.

A key is a layer number ``L`` for block L's output (the residual stream, ``width`` = hidden size),
or, for another activation site, its full TransformerLens hook name, e.g. ``"blocks.12.hook_mlp_out"``
or ``"blocks.12.attn.hook_z"`` (``model.sites``), or a model-level site's name alone, e.g.
``"hook_loss"`` or ``"ln_final.hook_out"``. Every key's list holds the same samples in the
same order (a sample's ``position``), with no padding rows.

Random access by construction: the document is pickled with protocol 3, which has no framing, so
each array's raw bytes are one contiguous ``BINBYTES`` payload. A compressed shard is a
multi-member gzip file: every array payload is a gzip member of its own, and the pickle opcodes
between payloads are members too. A gzip reader concatenates members, so the standard loader sees
one ordinary pickle; and the byte range of every array's member, known at write time, goes into
the index (``ArrayLocation``) so one array can be read and decompressed alone, CRC-checked.
Bytes are deterministic: gzip headers carry no name and time stamp 0.

No copy of an activation is made to encode it: the document is pickled with each array's bytes
replaced by a short marker (``shard_segments``), and the file is that pickle with every marker
swapped for the array's ``BINBYTES`` header and its memory, exactly the bytes ``pickle.dumps``
would give. Writers stream the segments to the file (``stored_segments``), compressing members in
a thread pool (the compressor releases the GIL). A member only depends on its array's bytes, so a
writer may compress an array as soon as it has it, and put a ``CompressedArray`` (its shape,
dtype and the future member) in the document in its place.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import io
import itertools
import os
import pickle
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from model.sites import ArrayKey

PICKLE_PROTOCOL = 3  # no frames: array payloads stay contiguous and locatable
COMPRESSORS = ("isal", "zlib-ng", "zlib")
DEFAULT_COMPRESSOR, DEFAULT_COMPRESSION_LEVEL = "isal", 1  # chosen by benchmarks/shard_compression.py
_MARKER_TAG = b"\x00activation-bytes\x00"
Segment = bytes | memoryview  # pickle opcodes, or an array's memory


@dataclasses.dataclass(frozen=True)
class ArrayLocation:
    """Where one activation array lives inside its shard file."""
    sample_id: int
    key: ArrayKey      # the shard document's key: a layer, or a site's hook name (``model.sites``)
    position: int
    byte_offset: int   # of its gzip member (compressed shard) or raw bytes (.pkl)
    byte_length: int
    dtype: str
    shape: tuple[int, ...]
    part: str = "activation"  # or "scale": the float8 rows' scales (the entry's key of that name)


@dataclasses.dataclass(frozen=True, eq=False)
class CompressedArray:
    """An array in a shard document whose gzip member is made (or being made) already; its memory
    may be gone. ``dtype`` is the array's own dtype object and ``shape`` a new tuple at each use,
    as an array's are: the pickle memoises objects by identity, and must meet the same ones."""
    dims: list[int]
    dtype: np.dtype
    nbytes: int
    member: concurrent.futures.Future  # -> bytes: the gzip member of the array's bytes

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.dims)

    @classmethod
    def of(cls, array: np.ndarray, compress_member: Callable[[Segment], bytes],
           pool: concurrent.futures.Executor) -> "CompressedArray":
        array = np.ascontiguousarray(array)
        return cls(list(array.shape), array.dtype, array.nbytes, pool.submit(compress_member, _memory(array)))


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One array of a shard document, in pickling order."""
    key: ArrayKey
    position: int
    sample_id: int
    array: np.ndarray | CompressedArray
    part: str = "activation"  # the document entry's key that holds it: activation | scale


def shard_filename(shard_id: int, compressed: bool = True) -> str:
    return f"shard_{shard_id:04d}.pkl" + (".gz" if compressed else "")


def shard_dict(samples: Sequence[dict[str, Any]], keys: Sequence[ArrayKey],
               pooled: str | None = None) -> dict[ArrayKey, list[dict]]:
    """The shard document for extracted samples (``sample_id``, ``source``, ``text_preview``,
    ``activations: {key: array}``), keyed in the given order. Arrays that are already contiguous
    (the extractor's are) go in as they are, not copied. A sample stored with a token selection
    (its ``positions``) says which tokens its rows are (``positions``: int32, one array for every
    key), and with ``pooled`` that its one row is their mean (``pooled``: ``"mean"``). A sample the
    model continued (``runners.tpu_host --generate``) carries its ``generation``: ``prompt_tokens``,
    ``token_ids`` (the continuation), ``num_tokens``, ``finish``, ``text`` and, for an ARC task
    it was scored on, ``answer_correct``, ``answer_rows`` and ``answer_cols``. Stored as float8, a
    sample's ``scales`` (``{key: [rows] float32}``) go beside each array (``scale``)."""
    def selection(s: dict[str, Any]) -> dict[str, Any]:
        if s.get("positions") is None:
            return {}
        return {"positions": s["positions"], **({"pooled": pooled} if pooled else {})}

    def scale(s: dict[str, Any], key: ArrayKey) -> dict[str, Any]:
        scales = s.get("scales")
        return {} if not scales or key not in scales else {"scale": _contiguous(scales[key])}
    return {key: [{"sample_idx": s["sample_id"], "sample_id": s["sample_id"],
                   "activation": _contiguous(s["activations"][key]), **scale(s, key),
                   "shape": tuple(s["activations"][key].shape),
                   "text_preview": s["text_preview"], "source": s["source"], **selection(s),
                   **({"generation": s["generation"]} if s.get("generation") else {})} for s in samples]
            for key in keys}


def _contiguous(array: np.ndarray | CompressedArray) -> np.ndarray | CompressedArray:
    return array if isinstance(array, CompressedArray) else np.ascontiguousarray(array)


def _memory(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy (any dtype, bfloat16 included)."""
    return memoryview(array.reshape(-1).view(np.uint8))


def gzip_member_compressor(name: str, level: int) -> Callable[[Segment], bytes]:
    """bytes -> one complete gzip member (time stamp 0), with the named gzip-compatible library."""
    if name == "isal":
        from isal import igzip
        return lambda data: igzip.compress(data, level, mtime=0)
    if name == "zlib-ng":
        from zlib_ng import gzip_ng
        return lambda data: gzip_ng.compress(data, level, mtime=0)
    if name == "zlib":
        import gzip
        return lambda data: gzip.compress(data, level, mtime=0)
    raise ValueError(f"unknown compressor {name!r} (choose from {', '.join(COMPRESSORS)})")


class _SkeletonPickler(pickle.Pickler):
    """Pickles a document with each listed array's bytes replaced by its marker. numpy reduces an
    array (protocol < 5) to ``_reconstruct`` and the state ``(1, shape, dtype, is_fortran, data)``;
    only ``data`` differs here, so every other opcode and memo index is the real pickle's."""

    def __init__(self, file, markers: dict[int, bytes]):
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self._markers = markers  # id(array) -> marker

    def reducer_override(self, obj):
        marker = self._markers.get(id(obj))  # only the document's arrays (or their stand-ins)
        if marker is None:
            return NotImplemented
        function, args, state = np.empty(0, obj.dtype).__reduce_ex__(PICKLE_PROTOCOL)
        return function, args, (state[0], obj.shape, obj.dtype, False, marker)  # C order: not fortran


def _bytes_opcode(size: int) -> bytes:
    """The opcode and length that precede a bytes payload of ``size`` in a protocol-3 pickle."""
    if size <= 0xFF:
        return b"C" + size.to_bytes(1, "little")   # SHORT_BINBYTES
    if size <= 0xFFFFFFFF:
        return b"B" + size.to_bytes(4, "little")   # BINBYTES
    raise ValueError(f"an array of {size} bytes: protocol {PICKLE_PROTOCOL} pickles at most 4 GiB per array")


def shard_entries(shard: dict[int, list[dict]]) -> list[ShardEntry]:
    """The document's arrays in pickling order: each entry's activation, then its scale if any."""
    return [ShardEntry(key, position, item["sample_id"], item[part], part)
            for key, items in shard.items() for position, item in enumerate(items)
            for part in ("activation", "scale") if part in item]


def shard_segments(shard: dict[int, list[dict]]) -> tuple[list[Segment | CompressedArray], list[ShardEntry]]:
    """The pickle of ``shard`` as segments that alternate opcodes, array, opcodes, array, ...,
    opcodes (arrays as views of their own memory, or the ``CompressedArray`` standing in for one),
    and the arrays in that order. Joined, the segments are ``pickle.dumps(shard, protocol=3)``."""
    entries = shard_entries(shard)
    if len({id(e.array) for e in entries}) != len(entries):
        raise ValueError("the same array object twice in a shard: each entry needs its own array")
    nonce = os.urandom(8)  # markers no text of the document can hold
    markers = {id(e.array): _MARKER_TAG + nonce + k.to_bytes(4, "little") for k, e in enumerate(entries)}
    out = io.BytesIO()
    _SkeletonPickler(out, markers).dump(shard)
    skeleton = out.getvalue()
    segments: list[Segment | CompressedArray] = []
    cursor = 0
    for entry in entries:
        array = entry.array
        if isinstance(array, np.ndarray) and not array.flags.c_contiguous:
            raise ValueError("shard arrays must be C-contiguous (shard_dict makes them so)")
        marker = markers[id(array)]
        at = skeleton.index(marker, cursor)
        opcode = at - 2  # SHORT_BINBYTES, the marker's length
        assert skeleton[opcode:at] == _bytes_opcode(len(marker)), "marker not where the pickle puts it"
        segments.append(skeleton[cursor:opcode] + _bytes_opcode(array.nbytes))
        segments.append(array if isinstance(array, CompressedArray) else _memory(array))
        cursor = at + len(marker)
    segments.append(skeleton[cursor:])
    return segments, entries


def stored_segments(segments: Iterable[Segment | CompressedArray],
                    compress_member: Callable[[Segment], bytes] | None,
                    pool: concurrent.futures.Executor | None = None, ahead: int = 8) -> Iterator[Segment]:
    """Each segment as the file holds it, in order: as it is, or as one gzip member. Arrays are
    compressed in ``pool`` (at most ``ahead`` of them beyond the one handed out), the small opcode
    segments in the calling thread, and a ``CompressedArray`` gives its own member."""
    if compress_member is None:
        yield from segments
        return
    queue: collections.deque[concurrent.futures.Future] = collections.deque()
    for segment in segments:
        if isinstance(segment, CompressedArray):
            queue.append(segment.member)
        elif isinstance(segment, bytes) or pool is None:
            queue.append(_done(compress_member(segment)))
        else:
            queue.append(pool.submit(compress_member, segment))
        if len(queue) > ahead:
            yield queue.popleft().result()
    while queue:
        yield queue.popleft().result()


def _done(value: Any) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


def array_locations(entries: Sequence[ShardEntry], sizes: Sequence[int]) -> list[ArrayLocation]:
    """The location of every array, from the stored size of each segment (``shard_segments``'s
    order: segment ``2k + 1`` is array ``k``)."""
    offsets = list(itertools.accumulate([0, *sizes]))  # segment j starts at offsets[j]
    return [ArrayLocation(e.sample_id, e.key, e.position, offsets[2 * k + 1], sizes[2 * k + 1],
                          str(e.array.dtype), tuple(e.array.shape), e.part) for k, e in enumerate(entries)]


@dataclasses.dataclass
class EncodedShard:
    """A shard's file content as consecutive chunks and the location of every array in it (the
    in-memory form, for tests and benchmarks; the host writer streams to its file instead)."""
    chunks: list[Segment]
    locations: list[ArrayLocation]

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


def encode_shard(shard: dict[int, list[dict]], compress: bool, level: int = DEFAULT_COMPRESSION_LEVEL,
                 compressor: str = DEFAULT_COMPRESSOR, threads: int = 4) -> EncodedShard:
    """The file content of a shard and the location of every array in it."""
    segments, entries = shard_segments(shard)
    compress_member = gzip_member_compressor(compressor, level) if compress else None
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        chunks = list(stored_segments(segments, compress_member, pool, ahead=2 * threads))
    return EncodedShard(chunks, array_locations(entries, [len(c) for c in chunks]))


def activation_bytes(sample: dict[str, Any]) -> int:
    """What a sample adds to a shard (its arrays' bytes, float8 scales included), for
    size-triggered finalisation."""
    return sum(a.nbytes for arrays in (sample["activations"], sample.get("scales") or {}) for a in arrays.values())
