"""What the fleet's machines have used, and cost: every incarnation of every machine (a VM, a pod,
a process: when the engine says it became active, and when it ended), kept in
``{output}/_fleet/usage.json``; and the hours, cost and tokens per hour ``status`` shows.

The commands that ask the engine anyway keep the file: ``launch`` after creating, ``supervise`` at
every look, ``teardown`` after deleting. An incarnation the engine no longer reports (deleted,
or gone with its VM) ended when it was first seen missing, which is at most one ``--interval``
late. ``status`` only reads the file: an incarnation still open there counts until now.

An hour here is one machine (one TPU VM, one slice, one pod) for one hour: what a price per
machine-hour multiplies. Chip-hours are that times the chips per machine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Collection, Mapping, Sequence

from common.files import join, read_optional, write_bytes
from fleet.backend import Backend, Incarnation, error_line
from fleet.config import FleetConfig
from fleet.machines import COMPLETED, MachineView, parse_time
from host.status import iso_time

log = logging.getLogger("runners.fleet")
USAGE_FILE = "usage.json"
SECONDS_PER_HOUR = 3600.0


@dataclasses.dataclass
class Life:
    """One incarnation as the ledger keeps it."""
    key: str
    started_at: float
    ended_at: float | None = None

    def hours(self, now: float) -> float:
        end = self.ended_at if self.ended_at is not None else now
        return max(end - self.started_at, 0.0) / SECONDS_PER_HOUR


@dataclasses.dataclass
class Ledger:
    """Every machine's incarnations, and when a completed machine was released (deleted by
    ``supervise`` so that it costs no more)."""
    lives: dict[int, list[Life]] = dataclasses.field(default_factory=dict)
    released_at: dict[int, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def read(cls, config: FleetConfig) -> "Ledger":
        data = read_optional(join(config.fleet_dir(), USAGE_FILE))
        if data is None:
            return cls()
        raw = json.loads(data)
        lives = {int(m): [Life(life["key"], parse_time(life["started_at"]), parse_time(life["ended_at"]))
                          for life in machine["incarnations"]]
                 for m, machine in raw["machines"].items()}
        released = {int(m): parse_time(machine["released_at"]) for m, machine in raw["machines"].items()
                    if machine.get("released_at")}
        return cls(lives, released)

    def write(self, config: FleetConfig) -> None:
        machines = {}
        for m in sorted(set(self.lives) | set(self.released_at)):
            machines[f"{m:03d}"] = {
                "incarnations": [{"key": life.key, "started_at": iso_time(life.started_at),
                                  "ended_at": None if life.ended_at is None else iso_time(life.ended_at)}
                                 for life in self.lives.get(m, [])],
                "released_at": iso_time(self.released_at[m]) if m in self.released_at else None}
        document = {"backend": config.backend, "machines": machines}
        write_bytes(join(config.fleet_dir(), USAGE_FILE), (json.dumps(document, indent=2) + "\n").encode())

    def observe(self, seen: Mapping[int, Sequence[Incarnation]], now: float) -> bool:
        """Adds what the engine reports; closes what ended or is no longer reported. True if
        anything changed."""
        changed = False
        for machine, incarnations in seen.items():
            known = {life.key: life for life in self.lives.setdefault(machine, [])}
            for inc in incarnations:
                life = known.get(inc.key)
                if life is None:
                    life = Life(inc.key, inc.started_at)
                    self.lives[machine].append(life)
                    changed = True
                    if inc.started_at > self.released_at.get(machine, inc.started_at):
                        del self.released_at[machine]  # up again (resumed to a larger limit)
                if life.ended_at is None and not inc.active:
                    life.ended_at = inc.ended_at if inc.ended_at is not None else now
                    changed = True
        for machine in self.lives:
            reported = {inc.key for inc in seen.get(machine, ())}
            changed |= self.close(machine, now, keep=reported)
        return changed

    def close(self, machine: int, now: float, keep: Collection[str] = ()) -> bool:
        """Ends the machine's open incarnations (but those in ``keep``) at ``now``."""
        changed = False
        for life in self.lives.get(machine, []):
            if life.ended_at is None and life.key not in keep:
                life.ended_at, changed = now, True
        return changed

    def current_start(self, machine: int) -> float | None:
        """When the machine's open incarnation started (None when none is open)."""
        return max((life.started_at for life in self.lives.get(machine, []) if life.ended_at is None),
                   default=None)

    def active(self, machine: int) -> bool:
        return any(life.ended_at is None for life in self.lives.get(machine, []))

    def hours(self, machine: int, now: float) -> float:
        return sum(life.hours(now) for life in self.lives.get(machine, []))


def record(config: FleetConfig, backend: Backend, ledger: Ledger | None = None) -> Ledger:
    """What the engine reports of the machines' incarnations, into ``_fleet/usage.json`` (written
    when it changed); returns the ledger. A refused list call is a warning: usage waits for the
    next look, the command goes on."""
    ledger = Ledger.read(config) if ledger is None else ledger
    try:
        seen = backend.incarnations()
    except Exception as e:
        log.warning("cannot list the incarnations on %s: %s", config.backend, error_line(e))
        return ledger
    if ledger.observe(seen, time.time()):
        ledger.write(config)
    return ledger


def deleted(config: FleetConfig, ledger: Ledger, machines: Sequence[int], asked_at: float) -> None:
    """The fleet deleted these machines (asked at ``asked_at``): their incarnations end then, not
    at the next look (a recreated machine's new life would overlap the old one)."""
    if any([ledger.close(machine, asked_at) for machine in machines]):  # every machine, no short cut
        ledger.write(config)


@dataclasses.dataclass(frozen=True)
class MachineUsage:
    hours: float
    active: bool          # an incarnation is up (and billed) now
    released: bool        # completed, and deleted by supervise
    cost: float | None


@dataclasses.dataclass(frozen=True)
class FleetUsage:
    hours: float
    cost: float | None
    projected_cost: float | None     # at completion, from the ETAs; None while one is unknown
    tokens_per_hour: float | None    # tokens done per machine-hour


def machine_usage(ledger: Ledger, machine: int, now: float, price: float | None) -> MachineUsage:
    hours = ledger.hours(machine, now)
    return MachineUsage(hours, ledger.active(machine), machine in ledger.released_at,
                        None if price is None else hours * price)


def fleet_usage(views: Sequence[MachineView], usage: Mapping[int, MachineUsage], price: float | None,
                fleet_eta_s: float | None) -> FleetUsage:
    """Totals, and the cost at completion: each unfinished machine runs on for its ETA; a completed
    machine that is still up (``--keep_completed``, or not yet released) until the last one ends."""
    hours = sum(u.hours for u in usage.values())
    tokens = sum(v.tokens_done for v in views)
    if price is None:
        return FleetUsage(hours, None, None, tokens / hours if hours else None)
    remaining: list[float | None] = []
    for view in views:
        if view.state != COMPLETED:
            remaining.append(view.eta_s)
        elif usage[view.machine_id].active:
            remaining.append(fleet_eta_s)
    known = None if any(r is None for r in remaining) else sum(remaining) / SECONDS_PER_HOUR
    cost = hours * price
    return FleetUsage(hours, cost, None if known is None else cost + known * price,
                      tokens / hours if hours else None)
