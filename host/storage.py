"""Uploading a machine's files to GCS, with retries on transient errors and an integrity check.

Every upload is verified by reading the object's metadata back and comparing its size and checksum
with the local bytes (CRC32C for shard files, computed while they are written; MD5 for small
files); only then may the caller delete the local copy. Several uploads may run at once (one
``GcsStore`` serves the writer's upload threads). Set ``STORAGE_EMULATOR_HOST`` to point the
client at a local GCS API server (the tests do).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import time
from typing import Callable, TypeVar

from common.cli import UserError
from common.files import gcs_client

log = logging.getLogger(__name__)
T = TypeVar("T")
TIMEOUT_S = 120  # per request; retries are ours (``retries`` attempts), not the library's
# A resumable upload holds one chunk in memory per upload thread; 32 MiB keeps requests large
# (GCS wants multiples of 256 KiB, and several MiB for speed) and the memory small.
UPLOAD_CHUNK_BYTES = 32 * 2**20
CHECKSUM_SLICE = 8 * 2**20  # google-crc32c takes bytes: a memoryview is checked a slice at a time


class StorageError(UserError):
    """GCS could not be reached or refused an operation, after retries."""


class PreconditionFailed(StorageError):
    """GCS refused a conditional write or delete: the object's generation is not the one named."""


def _transient(error: Exception) -> bool:
    from google.api_core import exceptions as gexc
    import requests
    # ChunkedEncodingError: the connection broke mid-answer (a server restarting, a dropped link)
    return isinstance(error, (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                              requests.exceptions.ChunkedEncodingError, ConnectionError, TimeoutError,
                              gexc.TooManyRequests, gexc.InternalServerError, gexc.BadGateway,
                              gexc.ServiceUnavailable, gexc.GatewayTimeout))


def md5_base64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


class Crc32c:
    """A running CRC32C (Castagnoli), the checksum GCS keeps for every object, composite ones too."""

    def __init__(self):
        import google_crc32c  # a dependency of google-cloud-storage, with its C implementation
        self._checksum = google_crc32c.Checksum()

    def update(self, data: bytes | memoryview) -> None:
        if isinstance(data, bytes):
            self._checksum.update(data)
            return
        for start in range(0, len(data), CHECKSUM_SLICE):
            self._checksum.update(bytes(data[start:start + CHECKSUM_SLICE]))

    def base64(self) -> str:
        """As GCS reports it (``crc32c`` of the object's metadata)."""
        return base64.b64encode(self._checksum.digest()).decode()



class GcsStore:
    """Objects under ``gs://bucket/prefix/``; every call retried on transient failures."""

    def __init__(self, bucket: str, prefix: str, retries: int = 5, backoff_s: float = 1.0,
                 timeout_s: float = TIMEOUT_S):
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s  # per request
        self._client = gcs_client()
        self._bucket = self._client.bucket(bucket)
        if not self._call("check of the bucket", lambda: self._bucket.exists(retry=None, timeout=timeout_s)):
            raise StorageError(f"GCS bucket {bucket!r} does not exist (or is not visible to these "
                               "credentials)")

    def url(self, name: str) -> str:
        return f"gs://{self.bucket_name}/{self._key(name)}"

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        for attempt in range(1, self.retries + 1):
            try:
                return fn()
            except Exception as e:  # classified below; anything else is not ours to retry
                from google.api_core import exceptions as gexc
                if isinstance(e, gexc.PreconditionFailed):
                    raise PreconditionFailed(f"GCS {what} refused: the object changed (precondition "
                                             "failed)") from None
                if not _transient(e):
                    raise StorageError(f"GCS {what} failed: {type(e).__name__}: "
                                       f"{str(e).splitlines()[0][:200]}") from None
                if attempt == self.retries:
                    raise StorageError(f"GCS {what} failed after {self.retries} attempts: "
                                       f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
                delay = self.backoff_s * 2 ** (attempt - 1)
                log.warning("GCS %s failed (%s), retrying in %.1f s", what, type(e).__name__, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def upload(self, name: str, data: bytes) -> str:
        """Uploads and verifies (size and MD5 read back); returns the ``gs://`` URL."""
        blob = self._bucket.blob(self._key(name))
        self._call(f"upload of {self.url(name)}",
                   lambda: blob.upload_from_string(data, retry=None, timeout=self.timeout_s))
        return self.verify(name, len(data), md5=md5_base64(data))

    def put_if_generation(self, name: str, data: bytes, generation: int, owner: str) -> int:
        """Writes ``data`` as ``owner``'s (the object's ``owner`` metadata) only if the object's
        generation is still ``generation`` (0: only if it does not exist); returns the new
        generation. Raises ``PreconditionFailed`` if another writer came first. A retried request
        whose first try was applied finds the object as this call wrote it, owner included: that
        counts as done (a writer of the same bytes under another owner does not)."""
        blob = self._bucket.blob(self._key(name))
        blob.metadata = {"owner": owner}
        try:
            self._call(f"conditional upload of {self.url(name)}", lambda: blob.upload_from_string(
                data, if_generation_match=generation, retry=None, timeout=self.timeout_s))
        except PreconditionFailed:
            current = self.read_with_generation(name)
            if current is None or current[0] != data or self.owner(name, current[1]) != owner:
                raise
            return current[1]
        return int(blob.generation)

    def owner(self, name: str, generation: int) -> str | None:
        """The ``owner`` a ``put_if_generation`` gave generation ``generation`` of the object
        (None: another generation is there now, or no owner)."""
        blob = self._metadata(name)
        if blob is None or int(blob.generation) != generation:
            return None
        return (blob.metadata or {}).get("owner")

    def generation(self, name: str) -> int:
        """The object's generation (0: it does not exist): one metadata request."""
        blob = self._metadata(name)
        return 0 if blob is None else int(blob.generation)

    def _metadata(self, name: str):
        """The object with its metadata loaded (one request), or None if it does not exist."""
        from google.api_core import exceptions as gexc
        blob = self._bucket.blob(self._key(name))

        def fetch():
            try:
                blob.reload(retry=None, timeout=self.timeout_s)
            except gexc.NotFound:
                return None
            return blob
        return self._call(f"check of {self.url(name)}", fetch)

    def read_with_generation(self, name: str) -> tuple[bytes, int] | None:
        """The object's bytes and the generation they belong to, or None if it does not exist."""
        from google.api_core import exceptions as gexc
        blob = self._bucket.blob(self._key(name))

        def fetch() -> tuple[bytes, int] | None:
            while True:  # the metadata, then the bytes of that very generation (else again)
                try:
                    blob.reload(retry=None, timeout=self.timeout_s)
                    generation = int(blob.generation)
                    return blob.download_as_bytes(if_generation_match=generation, retry=None,
                                                  timeout=self.timeout_s), generation
                except gexc.NotFound:
                    return None
                except gexc.PreconditionFailed:
                    continue  # rewritten between the two requests
        return self._call(f"download of {self.url(name)}", fetch)

    def delete_if_generation(self, name: str, generation: int) -> bool:
        """Deletes the object if its generation is still ``generation``; False if it was not (or
        is gone)."""
        from google.api_core import exceptions as gexc
        blob = self._bucket.blob(self._key(name))

        def remove() -> bool:
            try:
                blob.delete(if_generation_match=generation, retry=None, timeout=self.timeout_s)
            except gexc.NotFound:
                return False
            return True
        try:
            return self._call(f"delete of {self.url(name)}", remove)
        except PreconditionFailed:
            return False

    def put_file(self, name: str, path: str) -> None:
        """Uploads a local file, streamed in ``UPLOAD_CHUNK_BYTES`` requests (``verify`` checks it)."""
        blob = self._bucket.blob(self._key(name), chunk_size=UPLOAD_CHUNK_BYTES)
        self._call(f"upload of {self.url(name)}",
                   lambda: blob.upload_from_filename(path, retry=None, timeout=self.timeout_s))

    def verify(self, name: str, size: int, md5: str | None = None, crc32c: str | None = None) -> str:
        """Reads the object's metadata back: its size and checksum must be the local bytes'."""
        remote = self._bucket.blob(self._key(name))
        self._call(f"check of {self.url(name)}", lambda: remote.reload(retry=None, timeout=self.timeout_s))
        expected = {"md5": md5, "crc32c": crc32c}
        found = {"md5": remote.md5_hash, "crc32c": remote.crc32c}
        kinds = [kind for kind, value in expected.items() if value is not None]
        if remote.size != size or any(found[kind] != expected[kind] for kind in kinds):
            raise StorageError(f"upload of {self.url(name)} did not verify: {remote.size} bytes, "
                               + ", ".join(f"{k} {found[k]}" for k in kinds) + f"; expected {size} bytes, "
                               + ", ".join(f"{k} {expected[k]}" for k in kinds))
        return self.url(name)

    def append(self, name: str, data: bytes, size_after: int) -> str:
        """Appends ``data`` to object ``name`` (made if missing) without re-sending what it holds:
        ``data`` is uploaded (and verified) as a part, composed onto the object on the server,
        and the result checked to be ``size_after`` bytes. A composite object has no MD5."""
        part = f"{name}.part"
        self.upload(part, data)
        target = self._bucket.blob(self._key(name))
        sources = ([target] if size_after > len(data) else []) + [self._bucket.blob(self._key(part))]
        self._call(f"compose of {self.url(name)}",
                   lambda: target.compose(sources, retry=None, timeout=self.timeout_s))
        self._call(f"check of {self.url(name)}", lambda: target.reload(retry=None, timeout=self.timeout_s))
        if target.size != size_after:
            raise StorageError(f"append to {self.url(name)} did not verify: {target.size} bytes, "
                               f"expected {size_after}")
        self.delete(part)
        return self.url(name)

    def size(self, name: str) -> int | None:
        """The object's size in bytes, or None if it does not exist."""
        blob = self._metadata(name)
        return None if blob is None else blob.size

    def download(self, name: str) -> bytes | None:
        """The object's bytes, or None if it does not exist."""
        from google.api_core import exceptions as gexc
        blob = self._bucket.blob(self._key(name))

        def fetch() -> bytes | None:
            try:
                return blob.download_as_bytes(retry=None, timeout=self.timeout_s)
            except gexc.NotFound:
                return None
        return self._call(f"download of {self.url(name)}", fetch)

    def names(self, pattern: str) -> list[str]:
        """Names (relative to the prefix) of the objects whose name matches ``pattern``."""
        prefix = self._key("")
        blobs = self._call("listing", lambda: list(self._client.list_blobs(
            self.bucket_name, prefix=prefix, retry=None, timeout=self.timeout_s)))
        names = [b.name[len(prefix):] for b in blobs]
        return sorted(n for n in names if re.fullmatch(pattern, n))

    def delete(self, name: str) -> None:
        """Deletes the object; one already gone counts as deleted (a retried request whose first
        try was applied, or another attempt's cleanup)."""
        from google.api_core import exceptions as gexc
        blob = self._bucket.blob(self._key(name))

        def remove() -> None:
            try:
                blob.delete(retry=None, timeout=self.timeout_s)
            except gexc.NotFound:
                pass
        self._call(f"delete of {self.url(name)}", remove)
