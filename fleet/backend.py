"""The one small interface every place machines run behind: create, exists, is it alive, delete.

``launch``, ``supervise`` and ``teardown`` are written once against it; a backend module only
knows its engine (local processes, Cloud TPU queued resources, a Kubernetes Indexed Job, a
Dataflow job).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import Callable, Iterator, Sequence

from common.cli import UserError
from fleet.config import FleetConfig

# What a backend says of one machine.
ABSENT = "absent"      # never created, or deleted: create it
PENDING = "pending"    # being created, queued for capacity, booting: wait
ALIVE = "alive"        # running (its files tell how it is doing)
GONE = "gone"          # exited, killed, preempted, failed: recreate it


@dataclasses.dataclass(frozen=True)
class Health:
    kind: str
    detail: str = ""    # why, in a few words: "exited with status 1", "node PREEMPTED"


@dataclasses.dataclass(frozen=True)
class Incarnation:
    """One life of a machine on its engine (a VM, a pod, a process), as the engine records it:
    what the fleet pays for. ``fleet/usage.py`` keeps them in ``{output}/_fleet/usage.json``."""
    key: str                        # the engine's own id of it: a node and its creation time, a pod's uid
    started_at: float               # when it became active, seconds since the epoch
    ended_at: float | None = None   # when it ended, where the engine says
    active: bool = True             # False: it ended (at ``ended_at``, or, unknown, when first seen ended)


class Backend(abc.ABC):
    """Machines of one fleet on one engine."""

    self_healing = False  # True: the engine restarts machines itself; supervise only watches
    # True: a machine whose runner completed is still up, and billed, until it is deleted:
    # ``supervise`` deletes it once its completion is stored (unless ``--keep_completed``).
    release_completed = False
    # True: ``launch`` writes the user's files and creates machines only when asked (``--apply``),
    # since the user may submit those files with the engine's own tools instead.
    creates_on_request = False
    # True: the engine runs the machines as one job that retries their work itself (dataflow):
    # ``supervise`` waits for the job to end (``wait_for_job``), then merges; ``status`` shows the
    # job (``job_status``).
    one_job = False
    delete_words = ("delete", "deleted")  # what ``teardown`` says it does to the machines

    def __init__(self, config: FleetConfig):
        self.config = config

    @property
    @abc.abstractmethod
    def where(self) -> str:
        """Where this fleet's machines are looked for, in words (for messages)."""

    @abc.abstractmethod
    def plan(self, machines: Sequence[int]) -> str:
        """Exactly what ``create(machines)`` would create (requests, manifest, commands)."""

    def write_for_user(self, path: str | None) -> str | None:
        """Writes what this backend gives the user to read or submit (e.g. a manifest) to ``path``
        or its default; returns one line saying what was written and what to do with it, or None
        when the backend writes nothing."""
        return None

    def prepare(self) -> None:  # noqa: B027  (a hook: most backends have nothing to prepare)
        """Once per launch, before the first ``create`` (e.g. upload what the hosts install)."""

    @abc.abstractmethod
    def create(self, machines: Sequence[int]) -> list[int]:
        """Creates these machines (those it has room for); returns the ones created."""

    @abc.abstractmethod
    def existing(self) -> set[int]:
        """Machines of this fleet that exist now, alive or not."""

    @abc.abstractmethod
    def health(self, machine: int) -> Health:
        """Is it alive?"""

    def healths(self, machines: Sequence[int]) -> dict[int, Health]:
        """``health`` of several machines (a backend that can answer in one call overrides it)."""
        return {machine: self.health(machine) for machine in machines}

    def incarnations(self) -> dict[int, list[Incarnation]]:
        """The lives of each machine the engine knows of now (past ones too, where it keeps them).
        One or two list calls, however many machines: ``supervise`` asks at every look."""
        return {}

    @abc.abstractmethod
    def delete(self, machines: Sequence[int]) -> None:
        """Deletes these machines and whatever of them the engine holds; never their output."""

    def recreate(self, machine: int) -> None:
        self.delete([machine])
        self.create([machine])

    def job_status(self) -> tuple[str, bool] | None:
        """Where ``one_job``: the job in one line, and whether it has ended (None: no job yet)."""
        return None

    def wait_for_job(self, look: Callable[[], None]) -> None:
        """Where ``one_job``: calls ``look`` at every look until the job ends; ``UserError`` if it
        did not end done."""
        raise NotImplementedError


def error_line(e: BaseException) -> str:
    """An exception as one short line (its message's first line, or its type)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _cloud_error_types() -> tuple[type, ...]:
    """What the cloud clients raise for a refused, failed or unreachable call."""
    import concurrent.futures
    import requests
    import urllib3
    from google.api_core.exceptions import GoogleAPIError
    from google.auth.exceptions import GoogleAuthError
    errors = (GoogleAPIError, GoogleAuthError, urllib3.exceptions.HTTPError,
              requests.exceptions.RequestException, concurrent.futures.TimeoutError)
    try:  # the gke extra
        from kubernetes.client.exceptions import OpenApiException
    except ImportError:
        return errors
    return (*errors, OpenApiException)


@contextlib.contextmanager
def cloud_errors(backend: str) -> Iterator[None]:
    """A cloud API's refusal (credentials, permissions, quota, a timeout) as one line."""
    try:
        yield
    except _cloud_error_types() as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""  # (the type comes first here)
        raise UserError(f"{backend}: {type(e).__name__}: {first[:300]}".rstrip(": ")) from None
