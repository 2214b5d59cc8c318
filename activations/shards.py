"""The shard format, readable by plain ``pickle.load(gzip.open(path))``, with random access.

    {layer_idx: [{"sample_idx": id, "sample_id": id, "activation": np.ndarray [num_tokens, hidden],
                  "shape": (num_tokens, hidden), "text_preview": str, "source": str}, ...], ...}

Every layer's list holds the same samples in the same order (a sample's ``position``), with no
padding rows.

Random access by construction: the document is pickled with protocol 3, which has no framing, so
each array's raw bytes are one contiguous ``BINBYTES`` payload. A compressed shard is a
multi-member gzip file: every array payload is a gzip member of its own, and the pickle opcodes
between payloads are members too. A gzip reader concatenates members, so the standard loader sees
one ordinary pickle; and the byte range of every array's member, known at write time, goes into
the index (``ArrayLocation``) so one array can be read and decompressed alone, CRC-checked.
Members are compressed in parallel threads (the compressor releases the GIL). Bytes are
deterministic: gzip headers carry no name and time stamp 0.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import pickle
import pickletools
from typing import Any, Callable, Sequence

import numpy as np

PICKLE_PROTOCOL = 3  # no frames: array payloads stay contiguous and locatable
COMPRESSORS = ("isal", "zlib-ng", "zlib")
DEFAULT_COMPRESSOR, DEFAULT_COMPRESSION_LEVEL = "isal", 1  # chosen by benchmarks/shard_access.py
_BYTES_OPCODES = {"SHORT_BINBYTES": 1, "BINBYTES": 4, "BINBYTES8": 8}  # opcode -> length bytes


@dataclasses.dataclass(frozen=True)
class ArrayLocation:
    """Where one activation array lives inside its shard file."""
    sample_id: int
    layer: int
    position: int
    byte_offset: int   # of its gzip member (compressed shard) or raw bytes (.pkl)
    byte_length: int
    dtype: str
    shape: tuple[int, ...]


def shard_filename(shard_id: int, compressed: bool = True) -> str:
    return f"shard_{shard_id:04d}.pkl" + (".gz" if compressed else "")


def shard_dict(samples: Sequence[dict[str, Any]], layers: Sequence[int]) -> dict[int, list[dict]]:
    """The shard document for extracted samples (``sample_id``, ``source``, ``text_preview``,
    ``activations: {layer: array}``), in the given order."""
    return {layer: [{"sample_idx": s["sample_id"], "sample_id": s["sample_id"],
                     "activation": np.ascontiguousarray(s["activations"][layer]),
                     "shape": tuple(s["activations"][layer].shape),
                     "text_preview": s["text_preview"], "source": s["source"]} for s in samples]
            for layer in layers}


def gzip_member_compressor(name: str, level: int) -> Callable[[bytes], bytes]:
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


def _array_payloads(payload: bytes, arrays: list[np.ndarray]) -> list[int]:
    """Start offset of each array's raw bytes in the pickle, in pickling order."""
    starts, i = [], 0
    for op, arg, pos in pickletools.genops(payload):
        if i < len(arrays) and op.name in _BYTES_OPCODES and len(arg) == arrays[i].nbytes:
            start = pos + 1 + _BYTES_OPCODES[op.name]
            head = min(16, arrays[i].nbytes)  # a spot check that this is the array's payload
            if payload[start:start + head] != arrays[i].tobytes()[:head]:
                raise AssertionError("array payload not where the pickle puts it")
            starts.append(start)
            i += 1
    if i != len(arrays):
        raise AssertionError(f"located {i} of {len(arrays)} array payloads in the pickle")
    return starts


@dataclasses.dataclass
class EncodedShard:
    """A shard's file content as consecutive chunks (written one after another, never joined
    in memory by the writer) and the location of every array in it."""
    chunks: list[bytes]
    locations: list[ArrayLocation]

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)

    @property
    def size(self) -> int:
        return sum(len(c) for c in self.chunks)


def encode_shard(shard: dict[int, list[dict]], compress: bool, level: int = DEFAULT_COMPRESSION_LEVEL,
                 compressor: str = DEFAULT_COMPRESSOR, threads: int = 4) -> EncodedShard:
    """The file content of a shard and the location of every array in it."""
    payload = pickle.dumps(shard, protocol=PICKLE_PROTOCOL)
    entries = [(layer, position, entry["sample_id"], entry["activation"]) for layer, items in shard.items()
               for position, entry in enumerate(items)]
    starts = _array_payloads(payload, [array for *_, array in entries])
    # Segments alternate: opcodes, array, opcodes, array, ..., opcodes.
    bounds, cursor = [], 0
    for (*_, array), start in zip(entries, starts):
        bounds += [(cursor, start), (start, start + array.nbytes)]
        cursor = start + array.nbytes
    bounds.append((cursor, len(payload)))
    if compress:
        compress_member = gzip_member_compressor(compressor, level)
        view = memoryview(payload)
        with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
            chunks = list(pool.map(lambda b: compress_member(view[b[0]:b[1]]), bounds))
        view.release()
    else:
        chunks = [payload]
    sizes = [len(c) for c in chunks] if compress else [b - a for a, b in bounds]
    offsets = list(itertools.accumulate([0] + sizes))  # segment j starts at offsets[j]
    locations = [ArrayLocation(sample_id, layer, position, offsets[2 * k + 1], sizes[2 * k + 1],
                               str(array.dtype), tuple(array.shape))
                 for k, (layer, position, sample_id, array) in enumerate(entries)]
    return EncodedShard(chunks, locations)


def activation_bytes(sample: dict[str, Any]) -> int:
    """What a sample adds to a shard (its arrays' bytes), for size-triggered finalisation."""
    return sum(np.asarray(a).nbytes for a in sample["activations"].values())
