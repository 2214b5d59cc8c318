"""The machine lease (host/lease.py) against the GCS emulator with generation preconditions: a dead
holder is taken over after ``lease_s``, a released lease at once, and a holder that stalled past its
lease (it believes it still holds it) cannot commit once another attempt took the checkpoint over.
Time is a fake clock here; tests/test_pipeline_extract.py runs the real thing."""

import pytest

from host.lease import LEASE_FILE, LeaseLost, MachineLease
from host.storage import GcsStore

CHECKPOINT = "checkpoint.json"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def store(gcs):
    return GcsStore("acts", "job/machine_001", retries=1)


def lease(store, clock) -> MachineLease:
    return MachineLease(store, 1, 3.0, clock=clock, sleep=clock.sleep)


def test_a_dead_holder_is_taken_over_after_its_lease(store):
    clock = Clock()
    first = lease(store, clock)
    first.acquire()
    assert first.fence(CHECKPOINT, b"new") is None  # created: no earlier attempt can create it now
    second = lease(store, clock)
    second.acquire()  # the first never renews (it died)
    assert clock.now >= 3.0
    assert second.fence(CHECKPOINT, b"new") == b"new"


def test_a_released_lease_is_taken_at_once(store):
    clock = Clock()
    first = lease(store, clock)
    first.acquire()
    first.release()
    assert store.read_with_generation(LEASE_FILE) is None
    lease(store, clock).acquire()
    assert clock.now == 0.0


def test_a_stalled_holder_cannot_commit_after_a_takeover(store):
    stalled_clock = Clock()  # the stalled holder's own view: no time passed, its lease still good
    stalled = lease(store, stalled_clock)
    stalled.acquire()
    stalled.fence(CHECKPOINT, b"new")
    stalled.write(CHECKPOINT, b"shard 1")
    clock = Clock()
    holder = lease(store, clock)
    holder.acquire()
    assert holder.fence(CHECKPOINT, b"new") == b"shard 1"
    with pytest.raises(LeaseLost, match=r"machine 001: this attempt .* lost the machine \(checkpoint.json was "
                                        r"written by another attempt\)"):
        stalled.write(CHECKPOINT, b"shard 2")
    with pytest.raises(LeaseLost):
        stalled.check()  # from now on it uploads nothing either
    holder.write(CHECKPOINT, b"shard 2, by the holder")
    assert store.read_with_generation(CHECKPOINT)[0] == b"shard 2, by the holder"
    stalled.release()  # not its lease any more: left alone
    assert store.read_with_generation(LEASE_FILE) is not None
