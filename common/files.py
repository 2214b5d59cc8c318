"""File access that works the same for local paths, ``gs://`` (google-cloud-storage, which also
honours ``STORAGE_EMULATOR_HOST``) and ``hf://`` (fsspec, for Hugging Face hub datasets)."""

from __future__ import annotations

import functools
import glob
import os
import posixpath
import re
import shutil
from typing import IO, Iterator


def gcs_client():
    """A google-cloud-storage client (credentials from the environment), one per process and
    emulator address."""
    return _client_for(os.environ.get("STORAGE_EMULATOR_HOST"))


@functools.lru_cache(maxsize=4)
def _client_for(emulator_host: str | None):
    from google.cloud import storage
    return storage.Client()


def _split_gs(path: str) -> tuple[str, str]:
    bucket, _, key = path[len("gs://"):].partition("/")
    return bucket, key


def open_read(path: str) -> IO[bytes]:
    """Opens ``path`` for binary reading (seekable for local and ``gs://``), never decompressing."""
    if path.startswith("gs://"):
        bucket, key = _split_gs(path)
        blob = gcs_client().bucket(bucket).blob(key)
        if not blob.exists():
            raise FileNotFoundError(f"no such object: {path}")
        return blob.open("rb")
    if path.startswith("hf://"):
        import fsspec
        return fsspec.open(path, "rb").open()
    return open(path, "rb")


def read_optional(path: str) -> bytes | None:
    """The bytes of ``path`` (local or ``gs://``, one request), or None if it does not exist."""
    if path.startswith("gs://"):
        from google.api_core import exceptions as gexc
        bucket, key = _split_gs(path)
        try:
            return gcs_client().bucket(bucket).blob(key).download_as_bytes()
        except gexc.NotFound:
            return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def file_size(path: str) -> int | None:
    """The size of ``path`` in bytes (local or ``gs://``: one metadata request), or None if it
    does not exist."""
    if path.startswith("gs://"):
        bucket, key = _split_gs(path)
        blob = gcs_client().bucket(bucket).get_blob(key)
        return None if blob is None else blob.size
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return None


CHUNK_BYTES = 8 << 20  # whole-file reads go in chunks this large


def binary_lines(f: IO[bytes], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The lines of an open binary file, each with its ``\\n`` (the last may lack one), read in
    large chunks: a ``gs://`` reader has no ``readline`` of its own and would be read byte by byte."""
    pending = b""
    for chunk in iter(lambda: f.read(chunk_bytes), b""):
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            yield line + b"\n"
    if pending:
        yield pending


def count_lines(path: str) -> int:
    """Lines of a text file (local or ``gs://``), read in chunks; a last line without a newline
    counts too."""
    count, last = 0, b"\n"
    with open_read(path) as f:
        for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def read_range(path: str, offset: int, length: int) -> bytes:
    """``length`` bytes of ``path`` from ``offset``: a seek locally, one ranged GET on ``gs://``."""
    if path.startswith("gs://"):
        bucket, key = _split_gs(path)
        return gcs_client().bucket(bucket).blob(key).download_as_bytes(start=offset, end=offset + length - 1)
    with open_read(path) as f:
        f.seek(offset)
        return f.read(length)


def write_bytes(path: str, data: bytes | memoryview) -> None:
    """Writes ``data`` (bytes, or any buffer: written locally without a copy) to ``path`` (local
    or ``gs://``), creating parent directories."""
    if path.startswith("gs://"):
        bucket, key = _split_gs(path)
        gcs_client().bucket(bucket).blob(key).upload_from_string(data if isinstance(data, bytes) else bytes(data))
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def write_atomically(path: str, data: bytes | list[bytes]) -> None:
    """Replaces ``path`` with ``data`` (bytes, or chunks written in order) so that readers see
    the old or the new file, never half of one."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        for chunk in ([data] if isinstance(data, bytes) else data):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def delete_tree(path: str) -> None:
    """Deletes the directory ``path`` and everything under it (on ``gs://``: every object under
    the prefix); nothing there is not an error."""
    if path.startswith("gs://"):
        bucket, key = _split_gs(path)
        blobs = list(gcs_client().list_blobs(bucket, prefix=key.rstrip("/") + "/"))
        gcs_client().bucket(bucket).delete_blobs(blobs, on_error=lambda blob: None)  # gone meanwhile: fine
        return
    shutil.rmtree(path, ignore_errors=True)


def delete_file(path: str) -> None:
    """Deletes the file ``path`` (local or ``gs://``); none there is not an error."""
    if path.startswith("gs://"):
        from google.api_core import exceptions as gexc
        bucket, key = _split_gs(path)
        try:
            gcs_client().bucket(bucket).blob(key).delete()
        except gexc.NotFound:
            pass
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def match(pattern: str) -> list[str]:
    """Sorted files matching a glob (``*``, ``?``, ``[...]``, ``**``), local or ``gs://``."""
    if pattern.startswith("gs://"):
        bucket, key = _split_gs(pattern)
        literal = key[:min([key.find(c) for c in "*?[" if c in key], default=len(key))]
        regex = re.compile(_glob_regex(key))
        return sorted(f"gs://{bucket}/{b.name}" for b in gcs_client().list_blobs(bucket, prefix=literal)
                      if regex.fullmatch(b.name))
    return sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))


def _glob_regex(pattern: str) -> str:
    """A glob as a regex over object names: ``*`` stays within a folder, ``**`` crosses them."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            out.append(pattern[i:end + 1])
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


def join(base: str, *parts: str) -> str:
    """Joins path parts with ``/`` for URLs and the local separator for local paths."""
    return posixpath.join(base, *parts) if "://" in base else os.path.join(base, *parts)
