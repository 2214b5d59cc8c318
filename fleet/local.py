"""Machines as ``runners.tpu_host`` processes on this computer (demos, tests, one large box).

Each process runs in a session of its own, so it outlives the ``launch`` that started it; its
pid (and start time, against pid reuse) is recorded in ``{output}/_fleet/local/machine_NNN.json``,
so a later ``supervise`` or ``teardown`` finds it. Output goes to ``{output}/logs/machine_NNN.log``.
At most ``--max_parallel`` run at once: ``create`` starts those it has room for.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import time
from typing import Sequence

from fleet.backend import ABSENT, ALIVE, GONE, Backend, Health, Incarnation
from fleet.machines import parse_time
from fleet.runner import local_command
from common.files import write_atomically
from host.status import utc_now

log = logging.getLogger("runners.fleet")
STOP_GRACE_S = 60.0  # SIGTERM stores a final shard; a frozen process gets SIGKILL after this


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks) of a live process, None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], fields[19]


def _running(pid: int, started: str | None) -> bool:
    stat = _proc_stat(pid)
    if stat is None:  # no /proc (not Linux): ask the kernel directly
        if os.path.isdir("/proc"):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    state, start = stat
    return state != "Z" and (started is None or start == started)  # a zombie has exited


class LocalBackend(Backend):
    def __init__(self, config):
        super().__init__(config)
        self.record_dir = os.path.join(config.fleet_dir(), "local")
        self.log_dir = os.path.join(config.output, "logs")
        self._children: dict[int, subprocess.Popen] = {}  # started by this process: exit codes known

    def _record_path(self, machine: int) -> str:
        return os.path.join(self.record_dir, f"machine_{machine:03d}.json")

    def _record(self, machine: int) -> dict | None:
        try:
            with open(self._record_path(machine)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def log_path(self, machine: int) -> str:
        return os.path.join(self.log_dir, f"machine_{machine:03d}.log")

    @property
    def where(self) -> str:
        return f"runner processes recorded in {self.record_dir}"

    def plan(self, machines: Sequence[int]) -> str:
        lines = [f"# at most {self.config.max_parallel} at once; each logs to {self.log_dir}/machine_NNN.log"]
        lines += [shlex.join(local_command(self.config, i)) for i in machines]
        return "\n".join(lines)

    def _alive_count(self) -> int:
        return sum(self.health(i).kind == ALIVE for i in self.existing())

    def create(self, machines: Sequence[int]) -> list[int]:
        room = max(self.config.max_parallel - self._alive_count(), 0)
        started = list(machines[:room])
        for machine in started:
            self._start(machine)
        return started

    def _start(self, machine: int) -> None:
        os.makedirs(self.record_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        command = local_command(self.config, machine)
        with open(self.log_path(machine), "ab") as log_file:
            log_file.write(f"=== {utc_now()} {shlex.join(command)}\n".encode())
            log_file.flush()
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self._children[machine] = process
        stat = _proc_stat(process.pid)
        record = {"machine_id": machine, "pid": process.pid, "proc_start": stat[1] if stat else None,
                  "started_at": utc_now(), "command": command, "log": self.log_path(machine)}
        write_atomically(self._record_path(machine), (json.dumps(record, indent=2) + "\n").encode())

    def existing(self) -> set[int]:
        if not os.path.isdir(self.record_dir):
            return set()
        return {int(name[len("machine_"):-len(".json")]) for name in os.listdir(self.record_dir)
                if name.startswith("machine_") and name.endswith(".json")}

    def health(self, machine: int) -> Health:
        record = self._record(machine)
        if record is None:
            return Health(ABSENT)
        child = self._children.get(machine)
        if child is not None and child.pid == record["pid"]:
            code = child.poll()  # also reaps it
            if code is None:
                return Health(ALIVE)
            how = (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}")
            return Health(GONE, f"process {child.pid} {how}")
        if _running(record["pid"], record.get("proc_start")):
            return Health(ALIVE)
        return Health(GONE, f"process {record['pid']} is gone")

    def incarnations(self) -> dict[int, list[Incarnation]]:
        """The process each machine's record names, from its start (a process that has exited
        ended at some time the record does not know)."""
        found = {}
        for machine in self.existing():
            record = self._record(machine)
            if record is not None:
                found[machine] = [Incarnation(f"pid {record['pid']} {record.get('proc_start')}",
                                              parse_time(record["started_at"]),
                                              active=self.health(machine).kind == ALIVE)]
        return found

    def delete(self, machines: Sequence[int]) -> None:
        for machine in machines:
            record = self._record(machine)
            if record is None:
                continue
            if self.health(machine).kind == ALIVE:
                self._stop(machine, record["pid"])
            os.remove(self._record_path(machine))
            self._children.pop(machine, None)

    def _stop(self, machine: int, pid: int) -> None:
        """SIGTERM to the runner's process group (it stores a final shard), SIGKILL if it is
        still there after ``STOP_GRACE_S``."""
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if self.health(machine).kind != ALIVE:
                    return
                time.sleep(0.2)
