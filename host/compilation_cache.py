"""The persistent XLA compilation cache: a restarted host loads its compiled buckets instead of
compiling them again (minutes for a large model on a TPU).

JAX keys each entry by the computation, the devices and the compiler options, so one cache
directory (local, or ``gs://`` shared by a fleet of identical hosts) serves every run of the same
model, layers and batch shapes. It saves XLA's compile, not the tracing and lowering before it:
the cache key is a hash of the lowered module. ``CompileStats`` says what each part cost.
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger("runners.tpu_host")
_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
_HIT = "/jax/compilation_cache/cache_hits"
_PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "backend"}  # XLA, or the cache's copy


def enable_compilation_cache(path: str) -> str | None:
    """Caches every compile of this process under ``path`` (local or ``gs://``); returns the
    directory used, or None when ``path`` is empty or the local directory cannot be made (then
    the run compiles as usual). Must come before the process's first compile."""
    if path and "://" not in path:
        path = os.path.abspath(os.path.expanduser(path))
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            log.warning("compilation cache off: cannot create %s (%s)", path, e.strerror)
            path = ""
    # Off means off, also where JAX would take a directory from JAX_COMPILATION_CACHE_DIR itself.
    jax.config.update("jax_enable_compilation_cache", bool(path))
    if not path:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    # Cache every compile, however small or quick (JAX skips compiles under 1 s by default).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    log.info("compilation cache: %s", path)
    return path


class CompileStats:
    """What compiling cost this process, from JAX's monitoring events: persistent-cache lookups
    and hits, and seconds spent tracing, lowering, and in the backend (XLA's compile, or loading
    its result from the cache)."""

    def __init__(self):
        self.lookups = self.hits = 0
        self.seconds = dict.fromkeys(_PHASES.values(), 0.0)
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_event(self, event: str, **kwargs) -> None:
        if event == _REQUEST:
            self.lookups += 1
        elif event == _HIT:
            self.hits += 1

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event in _PHASES:
            self.seconds[_PHASES[event]] += duration

    def close(self) -> None:
        """Stops listening (JAX's listeners are process-wide)."""
        jax.monitoring.unregister_event_listener(self._on_event)
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
