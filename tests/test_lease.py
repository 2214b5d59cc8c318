"""The machine lease (host/lease.py) against the GCS emulator with generation preconditions: a dead
holder is taken over after ``lease_s``, a released lease at once; a holder that stalled past its
lease (it believes it still holds it) can neither commit, nor write metadata, nor clean up once
another attempt took the checkpoint over, even when a lost answer makes it retry a write the other
attempt rewrote byte for byte. Time is a fake clock here; tests/test_pipeline_extract.py runs the
real thing."""

import pytest

from host.lease import LEASE_FILE, LeaseLost, MachineLease
from host.storage import GcsStore, PreconditionFailed

CHECKPOINT, METADATA = "checkpoint.json", "metadata.json"


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


def test_a_write_whose_answer_was_lost_counts_as_done(gcs):
    store = GcsStore("acts", "job/machine_001", retries=2, backoff_s=0.0)
    gcs.fault("POST", r"job/machine_001/checkpoint\.json", action="apply_then_fail")
    generation = store.put_if_generation(CHECKPOINT, b"shard 1", 0, "attempt-a")  # retried: 412, then read back
    assert store.read_with_generation(CHECKPOINT) == (b"shard 1", generation)


def test_the_same_bytes_under_another_owner_are_not_this_writers(store):
    first = store.put_if_generation(CHECKPOINT, b"shard 1", 0, "attempt-a")
    assert store.put_if_generation(CHECKPOINT, b"shard 1", 0, "attempt-a") == first  # its own: done
    store.put_if_generation(CHECKPOINT, b"shard 1", first, "attempt-b")  # b fences: same bytes, b's
    with pytest.raises(PreconditionFailed):
        store.put_if_generation(CHECKPOINT, b"shard 1", 0, "attempt-a")  # a's retry finds b's, not its own


def test_metadata_is_fenced_too_and_a_stale_attempt_cannot_clean_up(store):
    stalled_clock, clock = Clock(), Clock()
    stalled = lease(store, stalled_clock)
    stalled.acquire()
    stalled.fence(CHECKPOINT, b"new")
    stalled.fence(METADATA, None)
    holder = lease(store, clock)
    holder.acquire()
    holder.fence(CHECKPOINT, b"new")
    holder.fence(METADATA, None)
    stalled.write(METADATA, b"stale totals")  # absent when the holder fenced it: this one lands...
    holder.write(METADATA, b"holder totals")  # ...and the holder's, its commit point still its own, replaces it
    assert store.read_with_generation(METADATA)[0] == b"holder totals"
    with pytest.raises(LeaseLost):
        stalled.write(METADATA, b"stale again")
    with pytest.raises(LeaseLost):
        stalled.verify()  # what it would run before removing files past its checkpoint


def test_a_holder_gives_up_before_a_watcher_may_take_over(store):
    clock = Clock()
    holder = lease(store, clock)
    holder.acquire()
    clock.now = 2.1  # over two thirds of its 3 s lease since the last renewal was sent
    with pytest.raises(LeaseLost, match="not renewed for 2 s"):
        holder.check()
