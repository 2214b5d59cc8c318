"""A process of a multi-host machine runs under a watchdog: a parent that only waits for it.

When one process of a JAX distributed runtime dies, the runtime ends the others from native code
(an abort, once ``--distributed_timeout_s`` passes without the dead one's heartbeat, at once if
the coordinator died): no Python runs in them after that, so none could record why it ended. The
parent, which never starts a JAX backend, sees its child end by a signal and writes ``failed``
with a one-line error into the process's and the machine's ``status.json``, then exits non-zero.

The child is spawned fresh (no JAX state is inherited); it dies with the parent (Linux
``PR_SET_PDEATHSIG``), so killing the command kills the process. SIGTERM is forwarded (SIGINT from
a terminal reaches both already, as they share its process group).
"""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing
import os
import signal
import sys
from typing import Callable

from common.cli import UserError, run_main
from host.config import HostConfig

UNKNOWN = -1


def run_watched(config: HostConfig, target: Callable[[HostConfig, Placement], int],
                on_death: Callable[[HostConfig, str], None]) -> int:
    """Runs ``target(config, placement)`` in a child; returns its exit code. The child records its
    process index and count in ``placement`` once it knows them. If it ends by a signal,
    ``on_death(config with that placement, signal name)`` records it, and a ``UserError`` says so."""
    context = multiprocessing.get_context("spawn")
    placement = Placement(context.Array("i", [UNKNOWN, UNKNOWN]))
    child = context.Process(target=_child, args=(target, config, placement, os.getpid()),
                            name="tpu-host")
    child.start()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: os.kill(child.pid, signum))
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    if child.exitcode >= 0:
        return child.exitcode
    name = signal.Signals(-child.exitcode).name
    process_id, num_processes = placement.values[0], placement.values[1]
    if process_id != UNKNOWN:
        config = dataclasses.replace(config, process_id=process_id, num_processes=num_processes)
    on_death(config, name)
    who = f"process {process_id}" if process_id != UNKNOWN else "the process"
    raise UserError(f"{who} of machine {config.machine_id} ended by {name}: the JAX distributed runtime "
                    "ends every process of a machine when one stops answering (see the other "
                    "processes' logs); re-run the same command on every host to resume")


class Placement:
    """The child's process index and count, shared with the watchdog."""

    def __init__(self, values):
        self.values = values

    def set(self, process_id: int, num_processes: int) -> None:
        self.values[0], self.values[1] = process_id, num_processes


def _child(target: Callable, config: HostConfig, placement: Placement, parent: int) -> None:
    _die_with_parent(parent)
    run_main("runners.tpu_host", lambda argv: target(config, placement), argv=[])


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)
