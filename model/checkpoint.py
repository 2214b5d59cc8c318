"""Reading Hugging Face safetensors checkpoints (single or sharded), one tensor at a time.

The safetensors format is an 8-byte header length, a JSON header (dtype, shape, byte range of
each tensor) and the raw bytes. Only the headers are read up front; ``tensor(name)`` reads that
tensor's bytes (bfloat16 through ``ml_dtypes``) when asked. Not memory-mapping keeps the host's
resident memory at the placed parameters plus one tensor while loading (a mapping's touched
pages would count as a second copy of the model).

Where a checkpoint directory comes from (a local one, or a hub id at a revision): ``model.hub``.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from common.cli import UserError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": ml_dtypes.float8_e8m0fnu,  # block-FP8 weights, their
                                                                                    # scales (model.fp8)
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
class Checkpoint:
    """The tensors of a checkpoint directory, by Hugging Face name, as numpy views."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._files: dict[str, tuple[str, int, dict]] = {}  # name -> (path, data start, header)
        self._where: dict[str, str] = {}  # tensor name -> file name
        index_path = os.path.join(model_dir, INDEX_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = [SINGLE_FILE]
        for name in files:
            path = os.path.join(model_dir, name)
            if not os.path.exists(path):
                raise UserError(f"checkpoint file {name!r} is missing from {model_dir!r}")
            data_start, header = _read_header(path)
            self._files[name] = (path, data_start, header)
            self._where.update({t: name for t in header if t != "__metadata__"})

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape, from the header (nothing read); ``UserError`` if it is absent."""
        if name not in self._where:
            raise UserError(f"checkpoint {self.model_dir!r} has no tensor {name!r}")
        path, _, header = self._files[self._where[name]]
        return tuple(header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        """Tensor ``name``'s dtype, from the header."""
        path, _, header = self._files[self._where[name]]
        return np.dtype(_dtype(path, name, header[name]["dtype"]))

    def tensor(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor ``name`` read from disk, or only its ``rows`` [first, last) along axis 0 (one
        contiguous read: an expert range of a stacked tensor); ``UserError`` if the checkpoint
        lacks it."""
        if name not in self._where:
            raise UserError(f"checkpoint {self.model_dir!r} has no tensor {name!r}")
        path, data_start, header = self._files[self._where[name]]
        entry = header[name]
        start, end = entry["data_offsets"]
        shape = list(entry["shape"])
        if rows is not None:
            row_bytes = (end - start) // max(shape[0], 1)
            start, end = start + rows[0] * row_bytes, start + rows[1] * row_bytes
            shape[0] = rows[1] - rows[0]
        raw = np.fromfile(path, dtype=np.uint8, count=end - start, offset=data_start + start)
        if raw.size != end - start:
            raise UserError(f"{path} is truncated: tensor {name!r} is incomplete")
        return raw.view(_dtype(path, name, entry["dtype"])).reshape(shape)


def _dtype(path: str, name: str, stored: str):
    """The numpy dtype of a safetensors dtype name; ``UserError`` for one this reader lacks."""
    if stored not in DTYPES:
        raise UserError(f"{path}: tensor {name!r} has dtype {stored}, which is not read (read: {', '.join(DTYPES)})")
    return DTYPES[stored]


def _read_header(path: str) -> tuple[int, dict]:
    """(offset where the data section starts, parsed header) of one safetensors file."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise UserError(f"{path} is not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", raw_len)
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path} has a corrupt safetensors header") from None
    return 8 + header_len, header
