"""A machine's ``rejected.jsonl``: the stream records its runs did not compute, each exactly once.

One JSON line per skipped record (``transforms.long_samples.rejection``), in stream order. New
lines are appended (locally with fsync; on GCS composed onto the object, so nothing is sent
twice) before the checkpoint that counts them (``total_skipped``). A resumed run keeps that many
lines, locally and on GCS, and drops any an interrupted run wrote past them: it will skip those
records again.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from common.cli import UserError
from common.files import write_atomically
from host.storage import GcsStore
from common.stream_format import json_line

REJECTED_FILE = "rejected.jsonl"


class RejectedLog:
    def __init__(self, machine_dir: str, store: GcsStore | None):
        self.path = os.path.join(machine_dir, REJECTED_FILE)
        self.store = store
        self.size = 0  # bytes of the committed lines

    def load(self, committed: int) -> None:
        """Keeps the first ``committed`` lines (of the local file, else the uploaded one), and makes
        the local file and the GCS object hold exactly those."""
        data, where = None, self.path
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                data = f.read()
        elif self.store is not None:
            data, where = self.store.download(REJECTED_FILE), self.store.url(REJECTED_FILE)
        lines = data.splitlines(keepends=True) if data else []
        if len(lines) < committed:
            raise UserError(f"{where} has {len(lines)} lines but the checkpoint counts {committed} "
                            "skipped records (restore the file, or move the machine directory away to "
                            "start over)")
        kept = b"".join(lines[:committed])
        self.size = len(kept)
        if kept != (data or b""):  # lines of an interrupted run, or a lost local disk
            self._replace_local(kept)
        if self.store is not None and self.store.size(REJECTED_FILE) != (self.size or None):
            if kept:
                self.store.upload(REJECTED_FILE, kept)
            else:
                self.store.delete(REJECTED_FILE)

    def append(self, entries: Iterable[dict[str, Any]]) -> None:
        data = "".join(json_line(e) for e in entries).encode("utf-8")
        with open(self.path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.size += len(data)
        if self.store is not None:
            self.store.append(REJECTED_FILE, data, self.size)

    def _replace_local(self, data: bytes) -> None:
        if data:
            write_atomically(self.path, data)
        elif os.path.exists(self.path):
            os.remove(self.path)
