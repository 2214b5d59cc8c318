"""One attempt at a machine at a time, when an engine may run two (``--lease_s``): Beam's retries
and speculative copies on Dataflow (``pipeline.extract``).

The machine's ``lease.json`` on GCS names the attempt that holds it; the holder rewrites it every
``lease_s / 3`` seconds, each write conditional on the generation of its last one (GCS
preconditions), and deletes it when it ends. An attempt that finds the lease:

* absent: creates it (conditional on its absence) and holds the machine;
* renewed while it watches (for up to the holder's ``lease_s``): another attempt is alive, and
  this one stops with ``LeaseHeld`` before writing anything;
* not renewed for ``lease_s``: the holder is dead (a crashed worker), and this attempt takes the
  lease over (conditional on the generation it watched).

A holder counts its lease from before each renewal was sent and gives it up (``LeaseLost``) after
two thirds of ``lease_s`` without one, so it stops writing before any watcher may take over. That
is a bound on delays, not a proof against a process that stalls for longer between a check and a
write; so the commit point, ``checkpoint.json``, is also *fenced*: on taking the lease the attempt
rewrites it under its own name (the object's ``owner`` metadata; a new empty checkpoint where
there is none), conditional on the generation it read, and every later write of it is conditional
on this attempt's own last generation. A stale attempt's next commit is refused, whatever it
stalled on. ``metadata.json`` is fenced the same way. The argument in full, with what is left:
docs/fleet.md#exactly-once-on-dataflow.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable

from common.cli import UserError
from host.status import utc_now
from host.storage import GcsStore, PreconditionFailed, StorageError

log = logging.getLogger(__name__)
LEASE_FILE = "lease.json"
MIN_LEASE_S = 3.0  # renewed every lease_s / 3: GCS takes about one write per second per object
HELD_FRACTION = 2 / 3  # of lease_s since its last renewal was sent, a holder still writes


class LeaseHeld(UserError):
    """Another attempt holds the machine and is alive: this one must not touch it."""


class LeaseLost(UserError):
    """This attempt's lease was taken over: it must not write again."""


def lease_store(bucket: str, prefix: str, lease_s: float) -> GcsStore:
    """The store of the lease's own requests: short timeouts, so that a slow request cannot
    outlast the lease it renews."""
    return GcsStore(bucket, prefix, retries=3, backoff_s=0.2, timeout_s=max(1.0, lease_s / 6))


class MachineLease:
    """This attempt's claim on one machine's GCS prefix (``store``)."""

    def __init__(self, store: GcsStore, machine_id: int, lease_s: float,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.store = store
        self.machine_id = machine_id
        self.lease_s = lease_s
        self.attempt = uuid.uuid4().hex[:12]
        self.clock, self.sleep = clock, sleep
        self.generation: int | None = None          # of lease.json, as this attempt last wrote it
        self.commit_file: str | None = None         # the first file fenced
        self.fenced: dict[str, int] = {}            # fenced file -> its generation (0: absent)
        self.lost: str | None = None                # why this attempt may no longer write
        self.on_lost: list[Callable[[], None]] = []  # called once, when the loss is found
        self._renewed_at = clock()                   # when the last successful renewal was sent
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._lock = threading.Lock()

    def _document(self) -> bytes:
        return (json.dumps({"attempt": self.attempt, "host": socket.gethostname(), "pid": os.getpid(),
                            "lease_s": self.lease_s, "renewed_at": utc_now()}) + "\n").encode()

    # -- taking it -------------------------------------------------------------------------------
    def acquire(self) -> None:
        """Holds the lease, after waiting out a dead holder's; ``LeaseHeld`` if a live one has it."""
        watched: tuple[int, float] | None = None  # (generation seen, when first seen)
        while True:
            current = self.store.read_with_generation(LEASE_FILE)
            if current is None:
                if self._write_lease(0):
                    return
                continue  # another attempt created it first: watch it
            data, generation = current
            holder = _holder(data)
            if watched is not None and watched[0] != generation:
                raise LeaseHeld(f"machine {self.machine_id:03d} is held by another attempt ({holder['attempt']} "
                                f"on {holder['host']}, pid {holder['pid']}), which renewed its lease while this "
                                "one waited: this copy stops and leaves it alone")
            if watched is None:
                watched = (generation, self.clock())
                log.info("machine %03d: lease held by attempt %s on %s; waiting up to %.0f s for it to be "
                         "renewed, released or to expire", self.machine_id, holder["attempt"], holder["host"],
                         holder["lease_s"])
            elif self.clock() - watched[1] >= holder["lease_s"]:
                if self._write_lease(generation):
                    log.warning("machine %03d: took over from attempt %s on %s (its lease was not renewed "
                                "for %.0f s)", self.machine_id, holder["attempt"], holder["host"], holder["lease_s"])
                    return
                continue  # it came back (or another attempt took it): the next look says which
            self.sleep(max(0.05, min(holder["lease_s"] / 6, 10.0)))

    def _write_lease(self, generation: int) -> bool:
        sent = self.clock()  # the lease runs from the request, not from its answer
        try:
            self.generation = self.store.put_if_generation(LEASE_FILE, self._document(), generation, self.attempt)
        except PreconditionFailed:
            return False
        self._renewed_at = sent
        return True

    def fence(self, name: str, initial: bytes | None) -> bytes | None:
        """Takes file ``name`` over: rewrites it as it is under this attempt's name (or creates it
        as ``initial``; ``None``: leaves it absent), conditional on the generation read, so that no
        earlier attempt's next conditional write of it succeeds; returns the bytes it held (None:
        it did not exist). The first file fenced is the commit point. Call once the lease is held,
        before reading or removing anything else."""
        self.check()
        self.commit_file = self.commit_file or name
        current = self.store.read_with_generation(name)
        data, generation = current if current is not None else (None, 0)
        if data is None and initial is None:
            self.fenced[name] = 0
            return None
        try:
            self.fenced[name] = self.store.put_if_generation(name, data if data is not None else initial,
                                                             generation, self.attempt)
        except PreconditionFailed:
            self._lose(f"{name} changed while this attempt took the machine over")
            self.check()
        return data

    # -- holding it ------------------------------------------------------------------------------
    def write(self, name: str, data: bytes) -> None:
        """Writes a fenced file, conditional on this attempt's last generation of it. Refused on
        the commit file: another attempt committed, this one has lost. Refused on another fenced
        file: a stale attempt wrote it, and if the commit file is still this attempt's, this
        write replaces that one."""
        self.check()
        try:
            self.fenced[name] = self.store.put_if_generation(name, data, self.fenced[name], self.attempt)
            return
        except PreconditionFailed:
            if name == self.commit_file:
                self._lose(f"{name} was written by another attempt")
                self.check()
        self.verify()
        self.fenced[name] = self.store.put_if_generation(name, data, self.store.generation(name), self.attempt)

    def verify(self) -> None:
        """``check``, then asks GCS: the commit file must still be at this attempt's generation."""
        self.check()
        if self.store.generation(self.commit_file) != self.fenced[self.commit_file]:
            self._lose(f"{self.commit_file} was written by another attempt")
            self.check()

    def check(self) -> None:
        """Raises ``LeaseLost`` once this attempt may no longer write: the lease was taken over,
        or its last renewal was sent too long ago for a watcher not to have taken it."""
        if self.lost is None and self.clock() - self._renewed_at > HELD_FRACTION * self.lease_s:
            self._lose(f"its lease was not renewed for {HELD_FRACTION * self.lease_s:.0f} s")
        if self.lost is not None:
            raise LeaseLost(f"machine {self.machine_id:03d}: this attempt ({self.attempt}) lost the machine "
                            f"({self.lost}); it stops, and what it wrote past the checkpoint is removed by "
                            "the attempt that holds it")

    def _lose(self, why: str) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = why
        for callback in self.on_lost:
            callback()

    def start_renewing(self) -> None:
        self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                         name=f"lease-{self.machine_id:03d}")
        self._renewer.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3) and self.lost is None:
            try:
                if not self._write_lease(self.generation):
                    self._lose("another attempt took its lease over")
            except StorageError as e:  # ``check`` gives up once the lease may have gone
                log.warning("machine %03d: lease renewal failed (%s); retrying", self.machine_id, e)

    def release(self) -> None:
        """Stops renewing and deletes the lease if it is still this attempt's (a retry may then
        take the machine at once instead of waiting ``lease_s``)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self.lost is None and self.generation is not None:
            try:
                self.store.delete_if_generation(LEASE_FILE, self.generation)
            except StorageError as e:
                log.warning("machine %03d: could not release the lease (%s); the next attempt waits %.0f s "
                            "for it to expire", self.machine_id, e, self.lease_s)


def _holder(data: bytes) -> dict:
    """The lease document (a damaged one counts as a holder that never renews)."""
    try:
        holder = json.loads(data)
        return {"attempt": str(holder["attempt"]), "host": str(holder.get("host", "?")),
                "pid": holder.get("pid", "?"), "lease_s": float(holder["lease_s"])}
    except (ValueError, KeyError, TypeError):
        return {"attempt": "?", "host": "?", "pid": "?", "lease_s": MIN_LEASE_S}
