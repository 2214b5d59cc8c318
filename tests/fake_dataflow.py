"""A local server of the Dataflow v1b3 REST API, so the tests run Beam's ``DataflowRunner`` and
``google-cloud-dataflow-client`` against the far side of the wire (``tests/cloud_fakes.py``'s
``Server``).

It serves ``projects.locations.jobs`` create / get / list / update and ``jobs.messages`` list, the
paths of ``google/cloud/dataflow_v1beta3/services/*/transports/rest_base.py``. It keeps what it
was sent (each created job's body: environment, service options, worker pool, steps; each update)
and can be scripted: the states a job goes through (``script``), its error messages (``error``).
No job runs here. The endpoint names ``localhost``: Beam talks REST only to an endpoint that does.
"""

from __future__ import annotations

import datetime
import itertools
import re
from typing import Any

from tests.cloud_fakes import Server

# The API's enums as its JSON carries them: by name, or (the client asks ``enum-encoding=int``)
# by number, the index here.
JOB_STATES = ("JOB_STATE_UNKNOWN", "JOB_STATE_STOPPED", "JOB_STATE_RUNNING", "JOB_STATE_DONE",
              "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_UPDATED", "JOB_STATE_DRAINING",
              "JOB_STATE_DRAINED", "JOB_STATE_PENDING", "JOB_STATE_CANCELLING", "JOB_STATE_QUEUED",
              "JOB_STATE_RESOURCE_CLEANING_UP", "JOB_STATE_PAUSING", "JOB_STATE_PAUSED")
TERMINAL = ("JOB_STATE_DONE", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_UPDATED",
            "JOB_STATE_DRAINED")
IMPORTANCE = {1: "JOB_MESSAGE_DEBUG", 2: "JOB_MESSAGE_DETAILED", 5: "JOB_MESSAGE_BASIC",
              3: "JOB_MESSAGE_WARNING", 4: "JOB_MESSAGE_ERROR"}
SEVERITY = ("JOB_MESSAGE_DEBUG", "JOB_MESSAGE_DETAILED", "JOB_MESSAGE_BASIC", "JOB_MESSAGE_WARNING",
            "JOB_MESSAGE_ERROR")  # least to most important
JOB = re.compile(r"/v1b3/projects/([^/]+)/locations/([^/]+)/jobs(?:/([^/]+))?(/messages)?")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _name(value: Any, names: tuple[str, ...] | dict[int, str]) -> str:
    return names[int(value)] if isinstance(value, int) or str(value).isdigit() else str(value)


def _error(code: int, status: str, message: str) -> tuple[int, Any]:
    return code, {"error": {"code": code, "message": message, "status": status}}


class FakeDataflow(Server):
    """A created job is ``JOB_STATE_QUEUED``; each ``get`` of it then moves it to the next state
    that ``script`` set, if any. Cancelling makes it ``JOB_STATE_CANCELLED`` at once; a job in a
    final state refuses updates, as the service does."""

    def __init__(self):
        super().__init__()
        handler = self._http.RequestHandlerClass
        handler.do_PUT = handler.do_GET  # jobs.update is a PUT; the shared handler serves every method alike
        self.endpoint = self.endpoint.replace("127.0.0.1", "localhost")
        self.created: list[dict] = []      # the create requests' job bodies, as sent
        self.updates: list[tuple[str, str]] = []  # (job id, requested state)
        self.gets = 0
        self._jobs: dict[str, dict] = {}
        self._next: dict[str, list[str]] = {}
        self._messages: dict[str, list[dict]] = {}
        self._ids = itertools.count(1)

    def jobs(self) -> dict[str, dict]:
        with self.lock:
            return {i: dict(j) for i, j in self._jobs.items()}

    def script(self, job_id: str, *states: str) -> None:
        """The job's next states, one per ``get``; the last one stays."""
        with self.lock:
            self._next[job_id] = list(states)

    def error(self, job_id: str, text: str) -> None:
        """An error message of the job, as the service logs a worker's failure."""
        with self.lock:
            self._messages.setdefault(job_id, []).append(
                {"id": str(len(self._messages.get(job_id, [])) + 1), "time": _now(), "messageText": text,
                 "messageImportance": "JOB_MESSAGE_ERROR"})

    def handle(self, method, path, query, body):
        match = JOB.fullmatch(path)
        if match is None:
            return _error(404, "NOT_FOUND", f"{path} is not served here")
        project, location, job_id, messages = match.groups()
        if job_id is None:
            if method == "POST":
                return self._create(project, location, body)
            return 200, {"jobs": [j for j in self._jobs.values()
                                  if (j["projectId"], j["location"]) == (project, location)]}
        job = self._jobs.get(job_id)
        if job is None or (job["projectId"], job["location"]) != (project, location):
            return _error(404, "NOT_FOUND", f"(fake) job {job_id} not found in {project}/{location}")
        if messages:
            least = SEVERITY.index(_name(query.get("minimumImportance", 1), IMPORTANCE))
            return 200, {"jobMessages": [m for m in self._messages.get(job_id, [])
                                         if SEVERITY.index(m["messageImportance"]) >= least]}
        if method == "PUT":
            return self._update(job, _name(body["requestedState"], JOB_STATES))
        self.gets += 1
        if self._next.get(job_id):
            self._set(job, self._next[job_id].pop(0) if len(self._next[job_id]) > 1 else self._next[job_id][0])
        return 200, job

    def _create(self, project: str, location: str, body: dict) -> tuple[int, Any]:
        self.created.append(body)
        job_id = f"2026-11-22_00_00_00-{next(self._ids)}"
        job = {key: body[key] for key in ("name", "type", "clientRequestId", "labels") if key in body}
        self._jobs[job_id] = {**job, "id": job_id, "projectId": project, "location": location,
                              "createTime": _now(), "currentState": "JOB_STATE_QUEUED",
                              "currentStateTime": _now()}
        return 200, self._jobs[job_id]

    def _update(self, job: dict, requested: str) -> tuple[int, Any]:
        if job["currentState"] in TERMINAL:
            return _error(400, "FAILED_PRECONDITION", f"(fake) job {job['id']} is already {job['currentState']}")
        self.updates.append((job["id"], requested))
        self._set(job, {"JOB_STATE_DRAINING": "JOB_STATE_DRAINED"}.get(requested, requested))
        return 200, job

    def _set(self, job: dict, state: str) -> None:
        if state != job["currentState"]:
            job["currentState"], job["currentStateTime"] = state, _now()
