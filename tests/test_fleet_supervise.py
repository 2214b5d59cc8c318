"""When ``supervise`` recreates a machine: the rule, on literal machine views."""

import pytest

from fleet.backend import ABSENT, ALIVE, GONE, PENDING, Health
from fleet.machines import MachineView
from fleet.supervise import reason_to_restart

NOW = 10_000.0


def view(state: str, updated_at: float | None, error: str | None = None) -> MachineView:
    return MachineView(7, state, 3, 10, 1, 0.0, None, updated_at, 60.0, error, None)


@pytest.mark.parametrize("machine, health, acted_at, expected", [
    (view("running", NOW - 5), Health(ALIVE), 1.0, None),
    (view("missing", None), Health(GONE, "node PREEMPTED"), 1.0, "node PREEMPTED"),
    (view("missing", None), Health(PENDING, "queued resource PROVISIONING"), 1.0, None),
    (view("missing", None), Health(ABSENT), 0.0, None),
    # its own files: failed / stopped count only when newer than our last action on it
    (view("failed", NOW - 5, "SampleTooLong: ..."), Health(ALIVE), NOW - 60, "failed: SampleTooLong: ..."),
    (view("failed", NOW - 120, "SampleTooLong: ..."), Health(ALIVE), NOW - 60, None),
    # ... and a stale one does not stop the clock: the new incarnation never wrote a file
    (view("failed", NOW - 900, "SampleTooLong: ..."), Health(ALIVE), NOW - 101, "stalled: no heartbeat for 101 s"),
    (view("stopped", NOW - 5), Health(ALIVE), NOW - 60, "stopped by a signal"),
    # stalled: 3 heartbeats (180 s) + --stall_timeout (100 s) since the newer of heartbeat and action
    (view("stalled", NOW - 281), Health(ALIVE), NOW - 3000, "stalled: no heartbeat for 281 s"),
    (view("stalled", NOW - 279), Health(ALIVE), NOW - 3000, None),
    (view("missing", None), Health(ALIVE), NOW - 279, None),       # a new VM still booting
    (view("missing", None), Health(ALIVE), NOW - 400, "stalled: no heartbeat for 400 s"),
    # completed under a smaller --max_samples: its process is gone (local), or it may be resuming
    (view("under_limit", NOW - 5), Health(GONE, "process 12 exited with status 0"), 0.0,
     "completed under a smaller --max_samples than the runner flags ask for (process 12 exited with status 0)"),
    (view("under_limit", NOW - 900), Health(ALIVE), NOW - 60, None),
    (view("under_limit", NOW - 900), Health(ALIVE), NOW - 101, "stalled: no heartbeat for 101 s"),
])
def test_reason_to_restart(machine, health, acted_at, expected):
    assert reason_to_restart(machine, health, acted_at, NOW, stall_timeout=100.0) == expected


@pytest.mark.parametrize("idle, expected", [
    # its current VM wrote "completed" under the old limit: it is done with the old flags
    (True, "completed under a smaller --max_samples than the runner flags ask for (node READY)"),
    (False, None),  # the state is older than the VM: a runner with the new flags is starting
])
def test_an_idle_machine_under_its_limit_is_recreated_at_once(idle, expected):
    machine = view("under_limit", NOW - 900)
    assert reason_to_restart(machine, Health(ALIVE, "node READY"), 0.0, NOW, 100.0, idle) == expected
