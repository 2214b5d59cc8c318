"""What the output says about each machine: its ``status.json`` and ``checkpoint.json`` read from
the output (local or GCS), and the state the fleet sees. (``metadata.json`` repeats the
checkpoint's counts, so it is not read.)

A machine made of several processes (a multi-host slice) has its status in the machine's
``status.json`` (written by process 0, it counts every process) and a checkpoint per process
(``process_PP/checkpoint.json``), read here as one: completed when all are, the stream records
all have passed, the shards of all.

No SSH and no cloud API: a machine is judged by the files it writes. On top of the runner's own
states (``host/status.py``) the fleet adds three: ``missing`` (no file yet), ``stalled`` (a
non-final state whose heartbeat is older than three intervals: the process is dead or frozen) and
``under_limit`` (completed under a smaller ``--max_samples`` than the runner flags ask for now:
it has more to do).

Over time (the chart's curves, ``fleet/report.py``): samples stored, from the checkpoints' shard
times; samples computed, from ``status.json``'s ``samples_history`` (a process's run; earlier runs
count as far as they stored).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import logging
import time
from typing import Any, Sequence

from common.files import join, read_optional
from fleet.config import FleetConfig
from host.checkpoint import covers
from host.config import process_folder
from common.states import COMPLETED, FAILED, IN_PROGRESS, STOPPED

log = logging.getLogger("runners.fleet")
MISSING, STALLED, UNDER_LIMIT = "missing", "stalled", "under_limit"
FINAL = (COMPLETED, FAILED, STOPPED)
STALE_HEARTBEATS = 3
# Exit codes of ``status``: scripts wait on them.
ALL_COMPLETED, STILL_RUNNING, NEEDS_ATTENTION = 0, 1, 2
NEEDS_ATTENTION_STATES = (FAILED, STALLED, MISSING, STOPPED, UNDER_LIMIT)
LAUNCH_RECORD = "fleet.json"  # in the fleet's own folder, written by ``launch`` (fleet/commands.py)
Point = tuple[float, int]     # (seconds since the epoch, samples)


class _AnyLimit:
    """The runner flags are unknown (``status`` of a fleet launched elsewhere): a completion
    under any ``--max_samples`` counts."""

    def __repr__(self) -> str:
        return "ANY_LIMIT"


ANY_LIMIT = _AnyLimit()
Limit = int | None | _AnyLimit  # the runner flags' --max_samples (None: the whole stream)


@dataclasses.dataclass(frozen=True)
class MachineFiles:
    machine_id: int
    status: dict[str, Any] | None
    checkpoint: dict[str, Any] | None
    dirs: tuple[str, ...] = ()  # where the machine's processes store (the machine directory if one)

    def checkpoint_status(self) -> str | None:
        return (self.checkpoint or {}).get("status")

    def completed(self, limit: Limit = ANY_LIMIT) -> bool:
        """Its checkpoint says completed, under a ``--max_samples`` that covers ``limit`` (the one
        the runner flags ask for now), as the runner judges it (``host.checkpoint.covers``)."""
        if self.checkpoint_status() != COMPLETED:
            return False
        return limit is ANY_LIMIT or covers(self.checkpoint.get("max_samples"),
                                            self.checkpoint["total_samples_processed"], limit)


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        data = read_optional(path)
        return None if data is None else json.loads(data)
    except Exception as e:  # unreadable counts as absent; the next look may succeed
        log.warning("cannot read %s: %s", path, str(e).splitlines()[0])
        return None


def read_machine(config: FleetConfig, machine: int) -> MachineFiles:
    base = config.machine_dir(machine)
    status = _read_json(f"{base}/status.json")
    processes = (status or {}).get("num_processes") or 1
    if processes == 1:
        return MachineFiles(machine, status, _read_json(f"{base}/checkpoint.json"), (base,))
    dirs = tuple(f"{base}/{process_folder(p)}" for p in range(processes))
    return MachineFiles(machine, status, combined_checkpoint([_read_json(f"{d}/checkpoint.json") for d in dirs]),
                        dirs)


def combined_checkpoint(checkpoints: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The processes' checkpoints as the machine's (None until every process has one)."""
    if any(c is None for c in checkpoints):
        return None
    return {"status": COMPLETED if all(c["status"] == COMPLETED for c in checkpoints) else IN_PROGRESS,
            "total_samples_processed": min(c["total_samples_processed"] for c in checkpoints),
            "max_samples": checkpoints[0].get("max_samples"),  # one command: one limit
            **{k: sum(c.get(k) or 0 for c in checkpoints)
               for k in ("total_shards", "total_tokens", "total_truncated", "total_skipped")},
            "shards": [s for c in checkpoints for s in c.get("shards", [])]}


def read_fleet(config: FleetConfig) -> list[MachineFiles]:
    """Every machine's files, read in parallel (two small reads per machine)."""
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda i: read_machine(config, i), range(config.num_machines)))


def parse_time(text: str | None) -> float | None:
    return datetime.datetime.fromisoformat(text).timestamp() if text else None


def read_launched_at(config: FleetConfig) -> float | None:
    """When ``launch`` last launched the fleet (None: no record, e.g. machines started by hand)."""
    record = _read_json(join(config.fleet_dir(), LAUNCH_RECORD))
    try:
        return parse_time((record or {}).get("launched_at"))
    except (TypeError, ValueError):
        log.warning("%s: launched_at is not a time: %r", LAUNCH_RECORD, record.get("launched_at"))
        return None


def stored_curve(files: MachineFiles) -> list[Point]:
    """Samples the machine had stored at each shard's ``stored_at`` (shards stored before the
    checkpoint kept the time are left out)."""
    shards = sorted((parse_time(s["stored_at"]), s["total_samples_in_shard"])
                    for s in (files.checkpoint or {}).get("shards", []) if s.get("stored_at"))
    points, running = [], 0
    for at, count in shards:
        running += count
        points.append((at, running))
    return points


def computed_curve(files: MachineFiles) -> list[Point]:
    """Samples the machine had computed over time: its status's ``samples_history`` and its newest
    count (all an older ``status.json`` has), never under what it had stored by then (the history
    is the newest process's: a restarted machine's earlier runs count as far as they stored), never
    decreasing."""
    status = files.status or {}
    points = _history(status)
    newest = status.get("samples_computed", status.get("samples_done"))  # (older files: done only)
    if status.get("updated_at") and newest is not None:
        points.append((parse_time(status["updated_at"]), newest))
    curve, top = [], 0
    for at, count in sorted(points + stored_curve(files)):
        top = max(top, count)
        curve.append((at, top))
    return curve


def _history(status: dict[str, Any]) -> list[Point]:
    try:
        return [(parse_time(at), int(count)) for at, count in status.get("samples_history") or []]
    except (TypeError, ValueError):  # a hand-edited file, say: the newest count still shows
        log.warning("machine %s: unreadable samples_history in status.json", status.get("machine_id"))
        return []


@dataclasses.dataclass(frozen=True)
class MachineView:
    """One row of the status table."""
    machine_id: int
    state: str
    samples_done: int
    samples_total: int | None
    shards: int
    tokens_per_s: float
    heartbeat_age_s: float | None
    updated_at: float | None      # the status's own time (seconds since the epoch)
    heartbeat_s: float | None
    error: str | None
    eta_s: float | None
    tokens_done: int = 0          # tokens of the samples done (stored, when completed)

    @property
    def fraction(self) -> float | None:
        if self.state == COMPLETED:
            return 1.0
        return self.samples_done / self.samples_total if self.samples_total else None


def machine_view(files: MachineFiles, now: float, expected_samples: int | None = None,
                 limit: Limit = ANY_LIMIT) -> MachineView:
    """``limit``: the ``--max_samples`` of the runner flags (a completion under a smaller one is
    ``under_limit``)."""
    status, checkpoint = files.status or {}, files.checkpoint or {}
    updated = parse_time(status.get("updated_at"))
    age = now - updated if updated is not None else None
    heartbeat = status.get("heartbeat_s")
    # Completed under a smaller limit, until a runner resumes it with the new one (its status
    # then runs while the checkpoint still says completed, until the next shard).
    under_limit = files.checkpoint_status() == COMPLETED and not files.completed(limit)
    running = files.status is not None and status.get("state") not in FINAL
    if files.status is None and files.checkpoint is None:
        state = MISSING
    elif under_limit and not running:
        state = UNDER_LIMIT
    elif not under_limit and COMPLETED in (files.checkpoint_status(), status.get("state")):
        state = COMPLETED
    elif files.status is None:
        state = MISSING  # a checkpoint without a health file: nothing says the machine is alive
    elif status["state"] not in FINAL and age is not None and age > STALE_HEARTBEATS * heartbeat:
        state = STALLED
    else:
        state = status["state"]
    done = max(status.get("samples_done") or 0, checkpoint.get("total_samples_processed") or 0)
    tokens = max(status.get("tokens_done") or 0, checkpoint.get("total_tokens") or 0)
    total = expected_samples if expected_samples is not None else status.get("samples_total")
    if total is not None and isinstance(limit, int):
        total = min(total, limit)
    if state == COMPLETED and files.checkpoint:
        done, tokens = checkpoint["total_samples_processed"], checkpoint.get("total_tokens") or tokens
    rates = status.get("tokens_per_s") or {}
    idle = state in FINAL + (STALLED, UNDER_LIMIT)
    rate = 0.0 if idle else rates.get("last_minute") or rates.get("since_start") or 0.0
    return MachineView(files.machine_id, state, done, total,
                       max(status.get("shards") or 0, checkpoint.get("total_shards") or 0), rate, age,
                       updated, heartbeat, status.get("error") if state == FAILED else None,
                       _eta(done, total, status.get("tokens_done") or 0, rate), tokens)


def _eta(done: int, total: int | None, tokens_done: int, rate: float) -> float | None:
    """Seconds left at the current rate, from the tokens per sample so far."""
    if total is None or not done or not rate:
        return None
    return max(total - done, 0) * (tokens_done / done) / rate


def fleet_views(files: Sequence[MachineFiles], manifest: dict[str, Any] | None = None,
                now: float | None = None, limit: Limit = ANY_LIMIT) -> list[MachineView]:
    now = time.time() if now is None else now
    counts = {m["machine"]: m["samples"] for m in manifest["machines"]} if manifest else {}
    return [machine_view(f, now, counts.get(f.machine_id, 0) if manifest else None, limit) for f in files]


def exit_code(views: Sequence[MachineView]) -> int:
    """0: every machine completed; 2: any failed, stalled, stopped or missing; else 1."""
    if all(v.state == COMPLETED for v in views):
        return ALL_COMPLETED
    if any(v.state in NEEDS_ATTENTION_STATES for v in views):
        return NEEDS_ATTENTION
    return STILL_RUNNING


@dataclasses.dataclass(frozen=True)
class FleetTotals:
    machines: int
    completed: int
    samples_done: int
    samples_total: int | None
    shards: int
    tokens_per_s: float
    eta_s: float | None    # the slowest machine's


def totals(views: Sequence[MachineView]) -> FleetTotals:
    known = [v.samples_total for v in views]
    pending = [v for v in views if v.state != COMPLETED]
    etas = [v.eta_s for v in pending]
    return FleetTotals(len(views), sum(v.state == COMPLETED for v in views),
                       sum(v.samples_done for v in views),
                       None if any(t is None for t in known) else sum(known),
                       sum(v.shards for v in views), sum(v.tokens_per_s for v in views),
                       0.0 if not pending else (None if any(e is None for e in etas) else max(etas)))
