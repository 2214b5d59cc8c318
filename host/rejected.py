"""A machine's ``rejected.jsonl``: the stream records its runs did not compute, each exactly once.

One JSON line per skipped record (``transforms.long_samples.rejection``), in stream order. New
lines are written (the whole file, atomically, then uploaded) before the checkpoint that counts
them (``total_skipped``); a resumed run keeps that many lines and drops any an interrupted run
wrote past them, since it will skip those records again.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from common.cli import UserError
from host.checkpoint import write_atomically
from host.storage import GcsStore
from transforms.streams import json_line

REJECTED_FILE = "rejected.jsonl"


class RejectedLog:
    def __init__(self, machine_dir: str, store: GcsStore | None):
        self.path = os.path.join(machine_dir, REJECTED_FILE)
        self.store = store
        self.lines: list[str] = []

    def load(self, committed: int) -> None:
        """Keeps the first ``committed`` lines (of the local file, else the uploaded one)."""
        data, where = None, self.path
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                data = f.read()
        elif self.store is not None:
            data, where = self.store.download(REJECTED_FILE), self.store.url(REJECTED_FILE)
        lines = data.decode("utf-8").splitlines(keepends=True) if data else []
        if len(lines) < committed:
            raise UserError(f"{where} has {len(lines)} lines but the checkpoint counts {committed} "
                            "skipped records (restore the file, or move the machine directory away to "
                            "start over)")
        self.lines = lines[:committed]
        if len(lines) > committed:  # written by a run that died before its checkpoint
            self._write()

    def append(self, entries: Iterable[dict[str, Any]]) -> None:
        self.lines += [json_line(e) for e in entries]
        self._write()

    def _write(self) -> None:
        if not self.lines:
            if os.path.exists(self.path):
                os.remove(self.path)
            if self.store is not None and self.store.names(REJECTED_FILE.replace(".", r"\.")):
                self.store.delete(REJECTED_FILE)
            return
        data = "".join(self.lines).encode("utf-8")
        write_atomically(self.path, data)
        if self.store is not None:
            self.store.upload(REJECTED_FILE, data)
