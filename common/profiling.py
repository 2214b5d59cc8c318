"""A ``jax.profiler`` trace of a few batches of a run (``--profile_dir``, ``--profile_batches`` of
``runners.tpu_host`` and ``runners.ablate``).

The first batch, which compiles, is left out; the next K batches are traced, each marked as a
step. The trace directory holds ``plugins/profile/<run>/<host>.xplane.pb`` (TensorBoard's profile
plugin, ``tensorboard --logdir DIR``, or ``xprof --logdir DIR``) and ``perfetto_trace.json.gz``
(open it at https://ui.perfetto.dev).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import jax

log = logging.getLogger("common.profiling")


class BatchProfiler:
    """Wraps each batch (``with profiler.batch():``); traces batches 2..K+1."""

    def __init__(self, profile_dir: str, batches: int):
        self.profile_dir = profile_dir
        self.batches = batches
        self._seen = 0       # batches completed
        self._tracing = False

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        if self._seen == 1 and not self._tracing:
            jax.profiler.start_trace(self.profile_dir, create_perfetto_trace=True)
            self._tracing = True
            log.info("profiling %d batches into %s", self.batches, self.profile_dir)
        if self._tracing:
            with jax.profiler.StepTraceAnnotation("batch", step_num=self._seen):
                yield
        else:
            yield
        self._seen += 1
        if self._tracing and self._seen > self.batches:
            self.stop()

    def stop(self) -> None:
        """Ends the trace (also when the run ends before K batches) and writes it."""
        if self._tracing:
            jax.profiler.stop_trace()
            self._tracing = False
            log.info("profile written to %s", self.profile_dir)
