"""``status.json``: a host's health, readable without logging into the host.

Written atomically in the machine directory at every state change, and at least every
``heartbeat_s`` seconds by a background thread: the model never waits for it, and a long compile
or batch (XLA releases the GIL) does not stop it. A second thread uploads the newest document
beside ``checkpoint.json`` when uploading, at most one a second (GCS's rate for one object), so a
slow upload never delays a local heartbeat. A stale ``updated_at`` means a dead or frozen process.

  starting -> loading -> running <-> compiling, then completed | stopped (a signal) | failed

``failed`` carries the one-line ``error``, written before the process exits non-zero.
``samples_history`` (``host/progress.py``) is the run's samples done over time, for the fleet's
chart: ``status.json`` itself is only the newest snapshot.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

from common.cli import UserError
from common.files import write_atomically
from common.states import COMPILING, FAILED, RUNNING, STARTING, STOPPED

if TYPE_CHECKING:  # annotations only: this module needs neither JAX nor a GCS client to import
    from host.compilation_cache import CompileStats
    from host.storage import GcsStore

log = logging.getLogger("runners.tpu_host")
STATUS_FILE = "status.json"
UPLOAD_GAP_S = 1.0


class Stopped(Exception):
    """A signal ended the run before it computed anything: nothing to store, status ``stopped``."""


def utc_now() -> str:
    """ISO 8601 in UTC, e.g. ``2026-11-22T07:23:00.123+00:00``."""
    return iso_time(time.time())


def iso_time(seconds: float) -> str:
    """``seconds`` since the epoch as ``utc_now`` writes times."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(timespec="milliseconds")


def host_rss_gb() -> float:
    """This process's resident memory now (peak where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def device_report(devices: list) -> dict[str, Any]:
    """Backend, device kind and count, and memory in use / limit where the backend reports it
    (TPU and GPU do; CPU does not)."""
    memory = []
    for device in devices:
        stats = device.memory_stats() or {}
        if "bytes_in_use" in stats:
            memory.append({"id": device.id, "in_use_gb": round(stats["bytes_in_use"] / 1e9, 3),
                           "limit_gb": round(stats["bytes_limit"] / 1e9, 3) if "bytes_limit" in stats else None})
    return {"backend": devices[0].platform, "device_kind": devices[0].device_kind,
            "device_count": len(devices), "device_memory": memory}


class HealthReporter:
    """Keeps ``status.json`` current; ``compiling`` wraps each compile of the forward."""

    def __init__(self, machine_dir: str, machine_id: int, heartbeat_s: float,
                 counters: Callable[[], dict[str, Any]], compile_stats: CompileStats | None = None,
                 cache_dir: str | None = None, process: tuple[int, int] | None = None):
        self.path = os.path.join(machine_dir, STATUS_FILE)
        self.heartbeat_s = heartbeat_s
        self.counters = counters            # the run's progress (host/progress.py)
        self.compile_stats = compile_stats  # host/compilation_cache.py
        self.cache_dir = cache_dir          # the persistent compilation cache, None when off
        self.store: GcsStore | None = None  # set once the run has one
        # Called with each document written (a process of a multi-host machine publishes it).
        self.on_document: Callable[[dict[str, Any]], None] | None = None
        self.devices: list = []
        self.store_stats: Callable[[], dict[str, Any]] | None = None  # the store path's (host/store_stats.py)
        self.state = STARTING
        self.error: str | None = None
        self.compile_s = 0.0
        self.compiles = 0
        self._identity = {"machine_id": machine_id, "hostname": socket.gethostname(), "pid": os.getpid(),
                          "started_at": utc_now(), "heartbeat_s": heartbeat_s,
                          # (index, count) of this process in a machine made of several
                          **({"process_id": process[0], "num_processes": process[1]} if process else {})}
        self._history = [{"state": STARTING, "at": self._identity["started_at"]}]
        self._wake = threading.Event()
        self._closed = False
        self._write_lock = threading.Lock()  # the heartbeat and the final write never interleave
        self._thread = threading.Thread(target=self._beat, name="status-heartbeat", daemon=True)
        self._upload_lock = threading.Lock()
        self._to_upload: bytes | None = None  # the newest document not uploaded yet
        self._upload_wake = threading.Event()
        self._uploads_closed = False
        self._uploader = threading.Thread(target=self._upload, name="status-upload", daemon=True)

    def start(self) -> None:
        self.write()
        self._thread.start()
        self._uploader.start()

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """Starts the heartbeat; an exception out of the body ends the status as ``failed`` with
        its one line (a user error's message; for anything else its type too, the traceback
        going to the log as usual) before it propagates."""
        try:
            self.start()  # inside: a start-up signal may land while it starts the threads
            yield
        except Stopped:
            self.finish(STOPPED)
            raise
        except UserError as e:
            self.finish(FAILED, str(e))
            raise
        except Exception as e:
            self.finish(FAILED, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": "))
            raise

    def set_state(self, state: str) -> None:
        """A state change: recorded, and written by the heartbeat thread right away."""
        if state != self.state:
            self.state = state
            self._history.append({"state": state, "at": utc_now()})
            self._wake.set()

    @contextlib.contextmanager
    def compiling(self, rows: int, length: int) -> Iterator[None]:
        """Compiles happen while running (the first batch of each shape), and return to it."""
        self.set_state(COMPILING)
        start = time.monotonic()
        try:
            yield
        finally:
            self.compile_s += time.monotonic() - start
            self.compiles += 1
            self.set_state(RUNNING)

    def finish(self, state: str, error: str | None = None) -> None:
        """The final state, written (and uploaded, after any upload in flight) before returning."""
        self.error = error
        self.set_state(state)
        self._closed = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        self.write()
        self._uploads_closed = True
        self._upload_wake.set()
        if self._uploader.is_alive():
            self._uploader.join()

    def document(self) -> dict[str, Any]:
        stats = self.compile_stats
        counters = dict(self.counters())
        samples_history = counters.pop("samples_history", None)  # long: last, after the state history
        return {**self._identity, "state": self.state, "updated_at": utc_now(), "error": self.error,
                **counters,
                "compile_s": round(self.compile_s, 3), "compiles": self.compiles,
                "compile_phases_s": ({phase: round(s, 3) for phase, s in stats.seconds.items()}
                                     if stats is not None else None),
                "compilation_cache": ({"dir": self.cache_dir, "lookups": stats.lookups, "hits": stats.hits}
                                      if stats is not None and self.cache_dir else None),
                "host_rss_gb": round(host_rss_gb(), 3),
                "store": self.store_stats() if self.store_stats is not None else None,
                **(device_report(self.devices) if self.devices else
                   {"backend": None, "device_kind": None, "device_count": None, "device_memory": []}),
                "history": list(self._history),
                **({"samples_history": samples_history} if samples_history is not None else {})}

    def write(self) -> None:
        """Writes ``status.json`` locally and hands it to the uploader (which keeps the newest)."""
        with self._write_lock:
            document = self.document()
            data = (json.dumps(document, indent=2) + "\n").encode()
            write_atomically(self.path, data)
            if self.on_document is not None:
                self.on_document(document)
        if self.store is not None:
            with self._upload_lock:
                self._to_upload = data
            self._upload_wake.set()

    def _upload(self) -> None:
        """Uploads the newest document, in order, at most one per ``UPLOAD_GAP_S``. A failure is
        only logged (the next document tries again), never the run's failure."""
        while True:
            self._upload_wake.wait()
            self._upload_wake.clear()
            with self._upload_lock:
                data, self._to_upload = self._to_upload, None
            if data is not None:
                try:
                    self.store.upload(STATUS_FILE, data)
                except Exception as e:  # GCS trouble must not stop the run; shards report their own
                    log.warning("status.json upload failed: %s", str(e).splitlines()[0] if str(e) else e)
            with self._upload_lock:
                if self._uploads_closed and self._to_upload is None:
                    return
            if data is not None:
                time.sleep(UPLOAD_GAP_S)

    def _beat(self) -> None:
        next_at = time.monotonic() + self.heartbeat_s  # beats are timed from a write's start
        while True:
            self._wake.wait(max(0.0, next_at - time.monotonic()))
            self._wake.clear()
            if self._closed:
                return
            next_at = time.monotonic() + self.heartbeat_s
            try:
                self.write()
            except Exception:  # a full disk, say: the run goes on and reports its own errors
                log.exception("writing %s failed", self.path)
