"""``supervise``: look at the fleet every ``--interval`` seconds, bring back machines that are
gone, until every machine has completed.

A machine is (re)created when its backend says it is gone (a process that exited or was killed,
a queued resource FAILED or SUSPENDED, a node PREEMPTED or TERMINATED), when its own files say
it failed or stopped, or when it has been STALLED for ``--stall_timeout``. Its files only count
once they are newer than the last action on it: a recreated host needs time to write its first
heartbeat; one still queued for capacity (pending) is not timed. At most ``--max_restarts``
restarts in a row without progress per machine. Every action is one log line. A self-healing
backend (gke) is only watched.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from fleet.backend import ABSENT, GONE, PENDING, Backend
from fleet.config import FleetConfig
from fleet.machines import (COMPLETED, FAILED, STALE_HEARTBEATS, STOPPED, MachineView, fleet_views,
                            read_fleet, read_machine)

log = logging.getLogger("runners.fleet")


@dataclasses.dataclass
class MachineRecord:
    restarts: int = 0
    acted_at: float = 0.0          # when we last created it (its older files do not count)
    done_at_action: int = 0        # samples done then: restarts count only while nothing moves
    gave_up: str | None = None     # why it is no longer restarted


def reason_to_restart(view: MachineView, health, acted_at: float, now: float,
                      stall_timeout: float) -> str | None:
    """Why this (not completed) machine needs recreating, or None."""
    if health.kind == GONE:
        return health.detail
    if health.kind in (ABSENT, PENDING):
        return None
    fresh = view.updated_at is not None and view.updated_at > acted_at
    if fresh and view.state == FAILED:
        return f"failed: {view.error}"
    if fresh and view.state == STOPPED:
        return "stopped by a signal"
    # A final state from before our last action says nothing of the new incarnation: it has
    # until the stall limit, from that action, to write its first heartbeat.
    running = view.state not in (COMPLETED, FAILED, STOPPED)
    since = max(view.updated_at or 0.0, acted_at) if running else acted_at
    limit = STALE_HEARTBEATS * ((view.heartbeat_s or 0.0) if running else 0.0) + stall_timeout
    if acted_at and now - since > limit:
        return f"stalled: no heartbeat for {now - since:.0f} s"
    return None


class Supervisor:
    def __init__(self, config: FleetConfig, backend: Backend, manifest: dict | None = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep):
        self.config, self.backend, self.manifest = config, backend, manifest
        self.clock, self.sleep = clock, sleep
        self.machines = {i: MachineRecord() for i in range(config.num_machines)}

    def tick(self) -> list[MachineView]:
        """One look at the fleet, and the actions it calls for."""
        views = fleet_views(read_fleet(self.config), self.manifest, self.clock())
        waiting = []
        for view in views:
            record = self.machines[view.machine_id]
            if view.state == COMPLETED or record.gave_up:
                continue
            try:
                health = self.backend.health(view.machine_id)
            except Exception as e:  # a transient API error: look again next time
                log.warning("machine %03d: cannot ask %s: %s", view.machine_id, self.config.backend,
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
                continue
            if self.backend.self_healing:  # the engine restarts it; only its giving up is ours to see
                if health.kind in (GONE, ABSENT) and read_machine(self.config, view.machine_id) \
                        .checkpoint_status() != COMPLETED:
                    record.gave_up = health.detail or f"not found ({self.backend.where})"
                    log.error("machine %03d: %s", view.machine_id, record.gave_up)
                continue
            if health.kind == ABSENT:
                waiting.append(view.machine_id)
                continue
            if health.kind == PENDING:  # queued for capacity: its stall clock starts when it runs
                record.acted_at = self.clock()
                continue
            if view.samples_done > record.done_at_action:
                record.restarts, record.done_at_action = 0, view.samples_done  # it progressed
            reason = reason_to_restart(view, health, record.acted_at, self.clock(), self.config.stall_timeout)
            if reason is None:
                if not record.acted_at:
                    record.acted_at = self.clock()  # created before we looked: time its heartbeat from now
                continue
            if read_machine(self.config, view.machine_id).checkpoint_status() == COMPLETED:
                continue  # it finished between our reading its files and asking the backend
            if record.restarts >= self.config.max_restarts:
                record.gave_up = reason
                log.error("machine %03d: %s; giving up on it (%d restarts without progress)",
                          view.machine_id, reason, record.restarts)
                continue
            record.restarts += 1
            log.warning("machine %03d: %s; recreating it (restart %d of %d)", view.machine_id, reason,
                        record.restarts, self.config.max_restarts)
            self.backend.recreate(view.machine_id)
            record.acted_at = self.clock()
        if waiting:
            for machine in self.backend.create(waiting):
                log.info("machine %03d: started", machine)
                self.machines[machine].acted_at = self.clock()
        return views

    def run(self) -> list[int]:
        """Until every machine completed or was given up on; returns those given up on."""
        while True:
            views = self.tick()
            gave_up = [i for i, r in self.machines.items() if r.gave_up]
            if all(v.state == COMPLETED or v.machine_id in gave_up for v in views):
                return gave_up
            self.sleep(self.config.interval)
