"""One machine made of several processes (a multi-host TPU slice): starting ``jax.distributed``
and the few things the processes agree on.

Every host of the slice runs the same ``runners.tpu_host`` command with the same machine id. The
processes form one JAX runtime: one mesh over all their devices, the same batches in the same
order (each derives the batch plan from the whole stream), each feeding and storing only the rows
on its own devices. What they must agree on goes through the runtime, in the main thread, where
every process makes the same calls in the same order:
  * where to restart: the smallest stream position every process has stored;
  * when to stop on a signal: checked at window boundaries, stopped if any process got one.

``--distributed auto`` turns this on when the TPU environment reports more than one host:
``TPU_WORKER_HOSTNAMES`` (GKE TPU pods), else, on a TPU VM, the metadata attribute
``worker-network-endpoints``; or when ``--coordinator_address`` is given.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
from typing import Mapping

import numpy as np

from common.cli import UserError
from host.config import HostConfig
from host.machine_id import metadata_attribute, metadata_url

log = logging.getLogger("runners.tpu_host")
HOSTNAMES_ENV = "TPU_WORKER_HOSTNAMES"
ENDPOINTS_ATTRIBUTE = "worker-network-endpoints"
TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")  # v2/v3, and v4 onwards
METADATA_TIMEOUT_S = 2.0


def slice_hosts(environ: Mapping[str, str] = os.environ, timeout_s: float = METADATA_TIMEOUT_S,
                tpu_present: bool | None = None) -> int:
    """How many hosts the TPU environment says this slice has (1 when it says nothing)."""
    names = environ.get(HOSTNAMES_ENV)
    if names:
        return len([n for n in names.split(",") if n.strip()])
    if tpu_present is None:
        tpu_present = any(glob.glob(pattern) for pattern in TPU_DEVICE_FILES)
    if not tpu_present:  # off a TPU VM the metadata server is not asked (nor waited for)
        return 1
    answer, _ = metadata_attribute(metadata_url(environ, ENDPOINTS_ATTRIBUTE), timeout_s)
    return len([e for e in (answer or "").split(",") if e.strip()]) or 1


def wants_distributed(config: HostConfig, environ: Mapping[str, str] = os.environ) -> bool:
    if config.distributed != "auto":
        return config.distributed == "on"
    return config.coordinator_address is not None or slice_hosts(environ) > 1


def initialize(config: HostConfig) -> HostConfig:
    """Joins the machine's runtime; the config with this process's index and the process count.

    Must run before anything touches a JAX backend."""
    import jax
    join(config.coordinator_address, config.num_processes, config.process_id, config.distributed_timeout_s,
         "pass --coordinator_address, --num_processes and --process_id, or run on every host of a TPU slice")
    log.info("process %d of %d of machine %s (%d devices here, %d in all)", jax.process_index(),
             jax.process_count(), config.machine_id, jax.local_device_count(), jax.device_count())
    return dataclasses.replace(config, num_processes=jax.process_count(), process_id=jax.process_index())


def join(coordinator_address: str | None, num_processes: int | None, process_id: int | None, timeout_s: int,
         hint: str) -> None:
    """``jax.distributed.initialize``, or one line ending with ``hint`` where it fails."""
    import jax
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   heartbeat_timeout_seconds=timeout_s)
    except (ValueError, RuntimeError, TypeError) as e:
        raise UserError(f"jax.distributed.initialize failed: {str(e).splitlines()[0]} ({hint})") from None


def gathered(value: int) -> list[int]:
    """``value`` of every process, by process index (a collective: every process must call it)."""
    from jax.experimental import multihost_utils
    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int64(value))).ravel()]


def agreed_restart(done: int) -> int:
    """The stream position every process has stored up to: the smallest of their checkpoints."""
    return min(gathered(done))


def any_process(flag: bool) -> bool:
    return max(gathered(int(flag))) > 0
