"""Where a host's time goes between the forward and a stored shard: the store path's timers.

Each stage is timed where it runs (the main thread, the shard writer, the compression and upload
pools) and summed over its threads, so a stage that runs in 8 threads for 1 s counts 8 s. The
forward's own wait for the store (the memory budget full, ``host/writer.py``) is timed apart: as a
fraction of the wall time it is the share of the run the accelerator stood idle because of the
store path. The figures go into ``status.json`` (its ``store`` section, docs/runner.md) and each
timed span into the profiler trace (``--profile_dir``) as ``store/<stage>``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, ContextManager, Iterator

import jax

# In the order a batch's activations meet them.
STAGES = ("device_to_host",  # copying the batch's activations off the devices
          "split",           # cutting them per sample (views, no copy)
          "stats",           # each array's float64 moments (activations.site_stats), in the compression threads
          "encode",          # the shard's pickle around its arrays (shard_segments)
          "compress",        # gzip members, in the compression threads
          "write",           # into the local file
          "fsync",           # until the file is durable
          "index",           # building and writing the shard's index and statistics files
          "upload",          # sending the shard and its indexes to GCS
          "verify",          # the checksum of the written bytes and the object's read back
          "commit")          # metadata.json and checkpoint.json
COUNTED = ("activations", "written", "uploaded")  # bytes: handed to the writer, in files, sent to GCS


class StoreStats:
    """Thread-safe timers and byte counts of one run's store path."""

    def __init__(self):
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.bytes = dict.fromkeys(COUNTED, 0)
        # Waits on the store path: the forward's (its memory budget full), and the run's at its end.
        self.waits = {"forward_waited_s": 0.0, "final_flush_s": 0.0}
        self.settings: dict[str, Any] = {}  # the writer's threads and budget, for the report
        self.in_flight = lambda: {"shards": 0, "bytes": 0}  # the writer's, once there is one

    def stage(self, name: str) -> ContextManager[None]:
        return self._timed(f"store/{name}", self.seconds, name)

    def forward_waiting(self) -> ContextManager[None]:
        """The main thread blocked on the store: the devices get no new batch meanwhile."""
        return self._timed("store/forward_waited", self.waits, "forward_waited_s")

    def final_flush(self) -> ContextManager[None]:
        """The end of the run waiting for the shards still in flight."""
        return self._timed("store/final_flush", self.waits, "final_flush_s")

    @contextlib.contextmanager
    def _timed(self, span: str, totals: dict[str, float], key: str) -> Iterator[None]:
        """Adds the body's seconds to ``totals[key]``, and marks it as ``span`` in the trace."""
        with jax.profiler.TraceAnnotation(span):
            start = time.perf_counter()
            try:
                yield
            finally:
                with self._lock:
                    totals[key] += time.perf_counter() - start

    def count(self, what: str, size: int) -> None:
        with self._lock:
            self.bytes[what] += size

    def snapshot(self) -> dict[str, Any]:
        """The ``store`` section of ``status.json``."""
        wall = max(time.monotonic() - self._start, 1e-9)
        with self._lock:
            seconds, counted, waits = dict(self.seconds), dict(self.bytes), dict(self.waits)
        in_flight = self.in_flight()
        return {"stage_s": {stage: round(s, 3) for stage, s in seconds.items()},
                "forward_waited_s": round(waits["forward_waited_s"], 3),
                "forward_waited_fraction": round(waits["forward_waited_s"] / wall, 4),
                "final_flush_s": round(waits["final_flush_s"], 3),
                "wall_s": round(wall, 3), **{f"{what}_gb": round(n / 1e9, 4) for what, n in counted.items()},
                "in_flight_shards": in_flight["shards"], "in_flight_gb": round(in_flight["bytes"] / 1e9, 4),
                **self.settings}
