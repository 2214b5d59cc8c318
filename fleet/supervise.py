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

from fleet.backend import ABSENT, GONE, PENDING, Backend
from fleet.config import FleetConfig
from fleet.machines import (COMPLETED, FAILED, STALE_HEARTBEATS, STOPPED, UNDER_LIMIT, MachineFiles,
                            MachineView, fleet_views, read_fleet, read_machine)
from fleet.usage import Ledger

log = logging.getLogger("runners.fleet")


@dataclasses.dataclass
class MachineRecord:
    restarts: int = 0
    acted_at: float = 0.0          # when we last created it (its older files do not count)
    done_at_action: int = 0        # samples done then: restarts count only while nothing moves
    gave_up: str | None = None     # why it is no longer restarted
    released: bool = False         # completed, and no longer on the engine (deleted, or never kept)


def reason_to_restart(view: MachineView, health, acted_at: float, now: float,
                      stall_timeout: float) -> str | None:
    """Why this (not completed) machine needs recreating, or None."""
    if health.kind == GONE and view.state == UNDER_LIMIT:
        return f"completed under a smaller --max_samples than the runner flags ask for ({health.detail})"
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
    def __init__(self, config: FleetConfig, backend: Backend, manifest: dict | None = None,
                 limit: int | None = None, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep):
        """``limit``: the runner flags' ``--max_samples``."""
        self.config, self.backend, self.manifest, self.limit = config, backend, manifest, limit
        self.clock, self.sleep = clock, sleep
        self.machines = {i: MachineRecord() for i in range(config.num_machines)}
        self.ledger = Ledger.read(config)

    def tick(self) -> list[MachineView]:
        """One look at the fleet, and the actions it calls for."""
        files = read_fleet(self.config)
        views = fleet_views(files, self.manifest, self.clock(), self.limit)
        self.record_usage()
        if self.backend.release_completed and not self.config.keep_completed:
            try:
                self.release_completed(files)
            except Exception as e:  # a transient API error: look again next time
                log.warning("cannot release the completed machines on %s: %s", self.config.backend,
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
        pending = [v for v in views if v.state != COMPLETED and not self.machines[v.machine_id].gave_up]
        try:
            healths = self.backend.healths([v.machine_id for v in pending]) if pending else {}
        except Exception as e:  # a transient API error: look again next time
            log.warning("cannot ask %s: %s", self.config.backend,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            return views
        waiting = []
        for view in pending:
            if self.act(view, healths[view.machine_id]):
                waiting.append(view.machine_id)
        if waiting:
            for machine in self.backend.create(waiting):
                log.info("machine %03d: started", machine)
                self.machines[machine].acted_at = self.clock()
        return views

    def act(self, view: MachineView, health) -> bool:
        """What one unfinished machine calls for; True when it is to be created."""
        record = self.machines[view.machine_id]
        if self.backend.self_healing:  # the engine restarts it; only its giving up is ours to see
            if health.kind in (GONE, ABSENT) and not read_machine(self.config, view.machine_id) \
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
        reason = reason_to_restart(view, health, record.acted_at, self.clock(), self.config.stall_timeout)
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
        self.backend.recreate(view.machine_id)
        record.acted_at = self.clock()
        return False

    def record_usage(self) -> None:
        """The engine's incarnations into ``{output}/_fleet/usage.json`` (written when they change)."""
        try:
            seen = self.backend.incarnations()
        except Exception as e:  # usage waits for the next look; recovery must not
            log.warning("cannot list the incarnations on %s: %s", self.config.backend,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        if self.ledger.observe(seen, self.clock()):
            self.ledger.write(self.config)

    def release_completed(self, files: list[MachineFiles]) -> None:
        """Deletes the machines whose completed checkpoint is stored in the output: once it is
        there nothing on the machine is needed, and the engine bills it until it is deleted."""
        done = [f.machine_id for f in files if f.completed(self.limit) and not self.machines[f.machine_id].released]
        if not done:
            return
        existing = self.backend.existing()
        release = [m for m in done if m in existing]
        now = self.clock()  # its billing ends as the deletion is asked for
        if release:
            self.backend.delete(release)
        for machine in done:
            self.machines[machine].released = True
        if not release:
            return
        for machine in release:
            log.info("machine %03d: completed and stored; deleted, so that it costs no more "
                     "(--keep_completed keeps completed machines)", machine)
            self.ledger.close(machine, now)
            self.ledger.released_at[machine] = now
        self.ledger.write(self.config)

    def run(self) -> list[int]:
        """Until every machine completed or was given up on; returns those given up on."""
        while True:
            views = self.tick()
            gave_up = [i for i, r in self.machines.items() if r.gave_up]
            if all(v.state == COMPLETED or v.machine_id in gave_up for v in views):
                return gave_up
            self.sleep(self.config.interval)
