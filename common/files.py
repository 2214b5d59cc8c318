"""File access that works the same for local paths, ``gs://`` (through Beam's FileSystems) and
``hf://`` (through fsspec, for Hugging Face hub datasets)."""

from __future__ import annotations

import posixpath
from typing import IO

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems


def open_read(path: str) -> IO[bytes]:
    """Opens ``path`` for binary reading, never decompressing behind the caller's back."""
    if path.startswith("hf://"):
        import fsspec
        return fsspec.open(path, "rb").open()
    return FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)


def write_bytes(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` (local or ``gs://``), creating parent directories."""
    with FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        f.write(data)


def join(base: str, *parts: str) -> str:
    """Joins path parts with ``/`` for URLs and the local separator for local paths."""
    return FileSystems.join(base, *parts) if "://" not in base else posixpath.join(base, *parts)
