"""The backends by name (``--backend``): the one place that knows every engine a fleet can run on.

Each backend module imports the interface it implements (``fleet.backend``); only this registry
imports the backends, each when asked for (each brings its own cloud client).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from common.cli import UserError
from fleet.backend import Backend
from fleet.config import BACKENDS, FleetConfig

# How a one-job engine (dataflow) submits its job: the job's command line -> its result, once
# submitted. The job (``pipeline.extract``) runs hosts and the fleet's merge, a room above this
# one, so its entry point (``runners.fleet``) hands it in.
SubmitJob = Callable[[Sequence[str]], Any]


def backend_class(name: str) -> type[Backend]:
    """The class of ``--backend name``."""
    if name == "local":
        from fleet.local import LocalBackend
        return LocalBackend
    if name == "tpu-vm":
        from fleet.tpu_vm import TpuVmBackend
        return TpuVmBackend
    if name == "gke":
        from fleet.gke import GkeBackend
        return GkeBackend
    if name == "dataflow":
        from fleet.dataflow import DataflowBackend
        return DataflowBackend
    raise UserError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")


def make_backend(config: FleetConfig, submit_job: SubmitJob | None = None) -> Backend:
    """The backend of ``config``; ``submit_job``: how a one-job engine submits its job (needed by
    ``launch`` only)."""
    cls = backend_class(config.backend)
    return cls(config, submit_job) if cls.one_job else cls(config)
