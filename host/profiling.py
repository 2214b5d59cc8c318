"""Where ``host/run.py`` finds ``BatchProfiler`` until it imports it from ``common/profiling.py``."""

from common.profiling import BatchProfiler  # noqa: F401
