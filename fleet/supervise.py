"""``supervise``: look at the fleet every ``--interval`` seconds, bring back machines that are
gone, until every machine has completed.

A machine is (re)created when its backend says it is gone (a process that exited or was killed,
a queued resource FAILED or SUSPENDED, a node PREEMPTED or TERMINATED), when its own files say
it failed or stopped, or when it has been STALLED for ``--stall_timeout``. Its files only count
once they are newer than the last action on it: a recreated host needs time to write its first
heartbeat; one still queued for capacity (pending) is not timed. At most ``--max_restarts``
restarts in a row without progress per machine. A machine that completed under a smaller
``--max_samples`` than the runner flags ask for is recreated to do the rest. Every action is one
log line. A self-healing backend (gke) is only watched.

At every look it also records what the engine reports of each machine's incarnations
(``fleet/usage.py``), and, on a backend whose completed machines stay up and billed (tpu-vm),
deletes each machine as soon as its completed checkpoint is in the output (unless
``--keep_completed``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from fleet import usage
from fleet.backend import ABSENT, ALIVE, GONE, PENDING, Backend, Health, error_line
from fleet.config import FleetConfig
from fleet.machines import (ANY_LIMIT, COMPLETED, FAILED, STALE_HEARTBEATS, STOPPED, UNDER_LIMIT, Limit,
                            MachineFiles, MachineView, fleet_views, read_fleet, read_machine)
from fleet.usage import Ledger

log = logging.getLogger("runners.fleet")


@dataclasses.dataclass
class MachineRecord:
    restarts: int = 0
    acted_at: float = 0.0          # when we last created it (its older files do not count)
    done_at_action: int = 0        # samples done then: restarts count only while nothing moves
    gave_up: str | None = None     # why it is no longer restarted
    released: bool = False         # completed, and no longer on the engine (deleted, or never kept)


def reason_to_restart(view: MachineView, health: Health, acted_at: float, now: float,
                      stall_timeout: float, idle_under_limit: bool = False) -> str | None:
    """Why this (not completed) machine needs recreating, or None. ``idle_under_limit``: it is
    ``under_limit`` and its current incarnation wrote that itself (it ran the old flags and is
    done with them)."""
    if view.state == UNDER_LIMIT and (health.kind == GONE or (health.kind == ALIVE and idle_under_limit)):
        detail = f" ({health.detail})" if health.detail else ""
        return f"completed under a smaller --max_samples than the runner flags ask for{detail}"
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
    running = view.state not in (COMPLETED, FAILED, STOPPED, UNDER_LIMIT)
    since = max(view.updated_at or 0.0, acted_at) if running else acted_at
    limit = STALE_HEARTBEATS * ((view.heartbeat_s or 0.0) if running else 0.0) + stall_timeout
    if acted_at and now - since > limit:
        return f"stalled: no heartbeat for {now - since:.0f} s"
    return None


class Supervisor:
    # Looks in a row at which completed machines could not be released before giving up on that
    # (they are billed until teardown: the last words say so).
    RELEASE_ATTEMPTS = 3

    def __init__(self, config: FleetConfig, backend: Backend, manifest: dict | None = None,
                 limit: Limit = ANY_LIMIT, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep):
        """``limit``: the runner flags' ``--max_samples``."""
        self.config, self.backend, self.manifest, self.limit = config, backend, manifest, limit
        self.clock, self.sleep = clock, sleep
        self.machines = {i: MachineRecord() for i in range(config.num_machines)}
        self.ledger = Ledger.read(config)
        self.release_failures = 0

    @property
    def releases(self) -> bool:
        return self.backend.release_completed and not self.config.keep_completed

    def tick(self) -> list[MachineView]:
        """One look at the fleet, and the actions it calls for."""
        files = read_fleet(self.config)
        views = fleet_views(files, self.manifest, self.clock(), self.limit)
        usage.record(self.config, self.backend, self.ledger)
        if self.releases:
            try:
                self.release_completed(files)
                self.release_failures = 0
            except Exception as e:  # a transient API error: look again next time
                self.release_failures += 1
                log.warning("cannot release the completed machines on %s: %s", self.config.backend,
                            error_line(e))
        pending = [v for v in views if v.state != COMPLETED and not self.machines[v.machine_id].gave_up]
        try:
            healths = self.backend.healths([v.machine_id for v in pending]) if pending else {}
        except Exception as e:  # a transient API error: look again next time
            log.warning("cannot ask %s: %s", self.config.backend, error_line(e))
            return views
        waiting = [v.machine_id for v in pending if self.act(v, healths[v.machine_id])]
        if waiting:
            for machine in self.backend.create(waiting):
                log.info("machine %03d: started", machine)
                self.machines[machine].acted_at = self.clock()
        return views

    def act(self, view: MachineView, health: Health) -> bool:
        """What one unfinished machine calls for; True when it is to be created."""
        record = self.machines[view.machine_id]
        if self.backend.self_healing:  # the engine restarts it; only its giving up is ours to see
            if view.state == UNDER_LIMIT:
                record.gave_up = ("completed under a smaller --max_samples than the runner flags ask for: "
                                  "run teardown (the output stays), then launch")
                log.error("machine %03d: %s", view.machine_id, record.gave_up)
            elif health.kind in (GONE, ABSENT) and not read_machine(self.config, view.machine_id) \
                    .completed(self.limit):
                record.gave_up = health.detail or f"not found ({self.backend.where})"
                log.error("machine %03d: %s", view.machine_id, record.gave_up)
            return False
        if health.kind == ABSENT:
            return True
        if health.kind == PENDING:  # queued for capacity: its stall clock starts when it runs
            record.acted_at = self.clock()
            return False
        if view.samples_done > record.done_at_action:
            record.restarts, record.done_at_action = 0, view.samples_done  # it progressed
        # Under its limit and up: idle if its current incarnation wrote that state (it ran the old
        # flags); if the state is older, a runner with the new flags is starting.
        started = self.ledger.current_start(view.machine_id)
        idle = started is not None and view.updated_at is not None and view.updated_at > started
        reason = reason_to_restart(view, health, record.acted_at, self.clock(), self.config.stall_timeout, idle)
        if reason is None:
            if not record.acted_at:
                record.acted_at = self.clock()  # created before we looked: time its heartbeat from now
            return False
        if read_machine(self.config, view.machine_id).completed(self.limit):
            return False  # it finished between our reading its files and asking the backend
        if record.restarts >= self.config.max_restarts:
            record.gave_up = reason
            log.error("machine %03d: %s; giving up on it (%d restarts without progress)",
                      view.machine_id, reason, record.restarts)
            return False
        record.restarts += 1
        log.warning("machine %03d: %s; recreating it (restart %d of %d)", view.machine_id, reason,
                    record.restarts, self.config.max_restarts)
        asked_at = self.clock()
        self.backend.recreate(view.machine_id)
        usage.deleted(self.config, self.ledger, [view.machine_id], asked_at)
        record.acted_at = self.clock()
        return False

    def release_completed(self, files: list[MachineFiles]) -> None:
        """Deletes the machines whose completed checkpoint is stored in the output: once it is
        there nothing on the machine is needed, and the engine bills it until it is deleted."""
        done = [f.machine_id for f in files if f.completed(self.limit) and not self.machines[f.machine_id].released]
        if not done:
            return
        existing = self.backend.existing()
        release = [m for m in done if m in existing]
        asked_at = self.clock()  # its billing ends as the deletion is asked for
        if release:
            self.backend.delete(release)
        for machine in done:
            self.machines[machine].released = True
        for machine in release:
            log.info("machine %03d: completed and stored; deleted, so that it costs no more "
                     "(--keep_completed keeps completed machines)", machine)
            self.ledger.released_at[machine] = asked_at
        usage.deleted(self.config, self.ledger, release, asked_at)

    def unreleased(self, views: list[MachineView]) -> list[int]:
        """Completed machines still up that this supervisor has to delete."""
        if not self.releases:
            return []
        return [v.machine_id for v in views if v.state == COMPLETED and not self.machines[v.machine_id].released]

    def run(self) -> list[int]:
        """Until every machine completed (and, where completed machines are released, was
        deleted) or was given up on; returns those given up on."""
        while True:
            views = self.tick()
            gave_up = [i for i, r in self.machines.items() if r.gave_up]
            if all(v.state == COMPLETED or v.machine_id in gave_up for v in views):
                left = self.unreleased(views)
                if not left:
                    return gave_up
                if self.release_failures >= self.RELEASE_ATTEMPTS:
                    log.error("machine(s) %s completed but could not be deleted (see above): they are "
                              "billed until you run teardown", ", ".join(f"{m:03d}" for m in left))
                    return gave_up
            self.sleep(self.config.interval)
