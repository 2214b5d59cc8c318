"""Machines as the work items of one Dataflow job on TPU workers: ``pipeline.extract`` submitted
by ``launch``, watched through ``google-cloud-dataflow-client``.

One job holds every machine it was given (``--machines``): Dataflow starts up to
``--max_workers`` TPU workers, runs one machine at a time on each, and retries a failed work
item itself (four times, then the job fails), so ``supervise`` only waits for the job to end,
then merges. Each machine writes ``machine_NNN/`` as on every backend; ``status`` reads those
files and the job's state. ``launch`` records each job it submits in
``{output}/_fleet/dataflow_job.json``; the job's id is how the fleet finds it again.

Dataflow's TPU workers are single-host, and its pairs of accelerator and machine type are fixed
(``OFFERS``); the accelerator goes in the service option ``worker_accelerator``. A job
can be cancelled, not drained: Dataflow drains streaming jobs only, and this one is batch
(Dataflow's "Stop a running pipeline"); a cancelled machine resumes from its checkpoint at the
next launch.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import shlex
import time
from typing import Any, Callable, Sequence

from common.cli import UserError
from common.files import join, read_optional, write_bytes
from fleet.backend import ABSENT, ALIVE, GONE, PENDING, Backend, Health, Incarnation, error_line
from fleet.machines import FINAL, parse_time, read_machine
from host.status import utc_now

log = logging.getLogger("runners.fleet")
JOB_FILE = "dataflow_job.json"
# One process, one thread may open a TPU VM's chips (a second gets "/dev/vfio/0: Device or
# resource busy"): Dataflow must run one SDK process per VM, one work item at a time.
TPU_WORKER_EXPERIMENT = "no_use_multiple_sdk_containers"
# (--tpu_type, --topology) -> (worker_accelerator type, --worker_machine_type): the single-host TPU
# workers Dataflow offers (Dataflow's "Run a pipeline with TPUs"; GKE names these slices' machine
# types alike, docs/fleet.md's GKE section).
OFFERS = {
    ("v5e", "1x1"): ("tpu-v5-lite-podslice", "ct5lp-hightpu-1t"),
    ("v5e", "2x2"): ("tpu-v5-lite-podslice", "ct5lp-hightpu-4t"),
    ("v5e", "2x4"): ("tpu-v5-lite-podslice", "ct5lp-hightpu-8t"),
    ("v6e", "1x1"): ("tpu-v6e-slice", "ct6e-standard-1t"),
    ("v6e", "2x2"): ("tpu-v6e-slice", "ct6e-standard-4t"),
    ("v6e", "2x4"): ("tpu-v6e-slice", "ct6e-standard-8t"),
    ("v5p", "2x2x1"): ("tpu-v5p-slice", "ct5p-hightpu-4t"),
}
TERMINAL = ("JOB_STATE_DONE", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_DRAINED",
            "JOB_STATE_UPDATED")
# Before its workers run: queued, pending, stopped ("not yet started"); or winding down.
NOT_RUNNING = ("JOB_STATE_UNKNOWN", "JOB_STATE_STOPPED", "JOB_STATE_PENDING", "JOB_STATE_QUEUED",
               "JOB_STATE_CANCELLING", "JOB_STATE_DRAINING", "JOB_STATE_RESOURCE_CLEANING_UP",
               "JOB_STATE_PAUSING", "JOB_STATE_PAUSED")


def dataflow_api():
    """``google.cloud.dataflow_v1beta3`` (it comes with ``apache-beam[gcp]``)."""
    from google.cloud import dataflow_v1beta3
    return dataflow_v1beta3


def _chips(topology: str) -> int | None:
    parts = topology.split("x")
    return math.prod(int(p) for p in parts) if all(p.isdigit() for p in parts) else None


def _multi_host(topology: str, offered: Sequence[str]) -> bool:
    """A topology of the TPU's dimensions (2 for v5e, v6e; 3 for v5p) with more chips than a host."""
    chips = _chips(topology)
    same = topology.count("x") == offered[0].count("x")
    return bool(same and chips and chips > max(_chips(t) for t in offered))


def worker_type(tpu_type: str, topology: str | None) -> tuple[str, str, str]:
    """(topology, accelerator type, machine type) of one worker; one line naming what Dataflow
    offers for a pair it does not."""
    offered = [t for (kind, t) in OFFERS if kind == tpu_type]
    topology = topology or offered[-1]
    if (tpu_type, topology) in OFFERS:
        return (topology, *OFFERS[tpu_type, topology])
    why = ("is a multi-host slice: Dataflow's TPU workers are single-host" if _multi_host(topology, offered)
           else "is not a TPU worker Dataflow offers")
    raise UserError(f"--tpu_type {tpu_type} --topology {topology} {why}; {tpu_type} offers --topology "
                    f"{', '.join(offered)}")


def accelerator_option(accelerator: str, topology: str, reservation: str | None) -> str:
    """The ``--dataflow_service_options`` value that gives each worker its TPU."""
    parts = [f"type:{accelerator}", f"topology:{topology}"]
    # The reservation as a third key of the option, as the team's platform notes have it: Dataflow's
    # TPU page recommends a specifically targeted reservation, but the copy read here does not show
    # how it is named; check this form against Dataflow's page before relying on it.
    if reservation:
        parts.append(f"reservation:{reservation}")
    return "worker_accelerator=" + ";".join(parts)


def job_name(fleet: str, at: float) -> str:
    """``{fleet}-YYYYMMDD-HHMMSS``: Dataflow refuses a second active job of one name."""
    return f"{fleet}-{datetime.datetime.fromtimestamp(at, datetime.timezone.utc):%Y%m%d-%H%M%S}"


def check_settings(config) -> None:
    """One line for a setting the job could not run with (the TPU pair: ``worker_type``)."""
    if not (config.project and config.region):
        raise UserError("--backend dataflow needs --project and --region")
    if config.reservation and not config.worker_zone:
        raise UserError("--reservation needs --worker_zone, the reservation's zone")
    if config.reservation and any(c in config.reservation for c in ";=,"):
        raise UserError(f"--reservation {config.reservation!r}: a reservation's name or path, without ';', '=' or ','")
    if config.temp_location and not config.temp_location.startswith("gs://"):
        raise UserError(f"--temp_location must be gs://BUCKET/PREFIX (the workers read it), "
                        f"got {config.temp_location!r}")
    endpoint = config.dataflow_endpoint or ""
    if endpoint.startswith("http://") and "localhost" not in endpoint:
        # Beam submits over REST only to an endpoint that says localhost; to any other, gRPC.
        raise UserError(f"--dataflow_endpoint {endpoint}: a local endpoint must name localhost "
                        "(http://localhost:PORT)")


class DataflowBackend(Backend):
    self_healing = True  # Dataflow retries work items itself; supervise only waits
    one_job = True
    delete_words = ("cancel", "cancelled")  # the job they are in (a batch job cannot be drained)

    def __init__(self, config, submit_job: Callable[[Sequence[str]], Any] | None = None):
        """``submit_job``: the job's command line -> its result once submitted (``pipeline.extract``'s,
        handed in by ``runners.fleet``: ``fleet.backends.SubmitJob``); only ``create`` needs it."""
        super().__init__(config)
        self.submit_job = submit_job
        check_settings(config)
        self.topology, self.accelerator, self.machine_type = worker_type(config.tpu_type, config.topology)
        self._clients: dict[str, Any] = {}

    # -- the job ---------------------------------------------------------------------------------

    @property
    def local_endpoint(self) -> bool:
        """An http:// endpoint (tests, a proxy) takes no credentials."""
        return bool(self.config.dataflow_endpoint and self.config.dataflow_endpoint.startswith("http://"))

    def temp_location(self) -> str:
        return self.config.temp_location or join(self.config.fleet_dir(), "dataflow_tmp")

    def beam_options(self, machines: Sequence[int], name: str) -> list[str]:
        """The Beam options of the job: Dataflow, the TPU workers, one process and one thread each
        (``pipeline.extract`` would add those two; here they show in the plan)."""
        c = self.config
        if not c.image:
            raise UserError("--backend dataflow needs --image (a container image with this project and "
                            "jax[tpu] installed, built on a Beam SDK image)")
        options = ["--runner", "DataflowRunner", "--project", c.project, "--region", c.region,
                   "--job_name", name, "--labels", f"fleet={c.name}",
                   "--temp_location", self.temp_location(), "--staging_location", join(self.temp_location(), "staging"),
                   "--sdk_container_image", c.image, "--sdk_location", "container",
                   "--worker_machine_type", self.machine_type,
                   "--dataflow_service_options", accelerator_option(self.accelerator, self.topology, c.reservation),
                   "--experiments", TPU_WORKER_EXPERIMENT, "--number_of_worker_harness_threads", "1",
                   # Every worker from the start (a few machine elements are little backlog to
                   # scale up on); autoscaling still lets idle ones go at the job's tail.
                   "--num_workers", str(min(c.max_workers or len(machines), len(machines))),
                   "--max_num_workers", str(c.max_workers or len(machines))]
        if c.worker_zone:
            options += ["--worker_zone", c.worker_zone]
        if c.dataflow_endpoint:
            options += ["--dataflow_endpoint", c.dataflow_endpoint]
        if self.local_endpoint:
            options.append("--no_auth")
        return options + list(c.beam_options)

    def job_argv(self, machines: Sequence[int], name: str) -> list[str]:
        """``pipeline.extract``'s command line: the job's flags, the runner's, Beam's."""
        c = self.config
        return ["--streams_dir", c.streams_dir, "--output", c.output, "--machines", ",".join(map(str, machines)),
                "--name", c.name, *c.runner, *self.beam_options(machines, name)]

    def plan(self, machines: Sequence[int]) -> str:
        argv = self.job_argv(machines, job_name(self.config.name, time.time()))
        lines, words = [], []
        for word in argv:  # one option per line
            if word.startswith("--") and words:
                lines.append(shlex.join(words))
                words = []
            words.append(word)
        lines.append(shlex.join(words))
        return (f"# one Dataflow job for machine(s) {', '.join(f'{m:03d}' for m in machines)} "
                f"(its name gets the submission time):\npython -m pipeline.extract \\\n  "
                + " \\\n  ".join(lines))

    def create(self, machines: Sequence[int]) -> list[int]:
        from apache_beam.runners.dataflow.internal.apiclient import DataflowJobAlreadyExistsError
        if self.submit_job is None:
            raise RuntimeError("the dataflow backend was made without the job's submitter (runners.fleet hands in "
                               "pipeline.extract's)")
        name = job_name(self.config.name, time.time())
        try:
            result = self.submit_job(self.job_argv(machines, name))
        except DataflowJobAlreadyExistsError as e:
            raise UserError(f"dataflow: {error_line(e)}") from None
        job = {"job_id": result.job_id(), "job_name": name, "project": self.config.project,
               "region": self.config.region, "machines": list(machines), "submitted_at": utc_now()}
        self._write_jobs(self.jobs() + [job])
        log.info("dataflow job %s (%s) submitted: %d machine(s)", job["job_id"], name, len(machines))
        return list(machines)

    # -- what launch recorded, and what Dataflow says of it ---------------------------------------

    def _record_path(self) -> str:
        return join(self.config.fleet_dir(), JOB_FILE)

    def jobs(self) -> list[dict[str, Any]]:
        """The jobs ``launch`` submitted for this fleet, oldest first."""
        data = read_optional(self._record_path())
        return json.loads(data)["jobs"] if data is not None else []

    def _write_jobs(self, jobs: list[dict[str, Any]]) -> None:
        write_bytes(self._record_path(), (json.dumps({"jobs": jobs}, indent=2) + "\n").encode())

    def client(self, kind: str):
        """The Jobs or Messages client (REST): Google's endpoint, or ``--dataflow_endpoint``."""
        if kind not in self._clients:
            from google.api_core.client_options import ClientOptions
            endpoint = self.config.dataflow_endpoint
            credentials = None
            if self.local_endpoint:
                from google.auth.credentials import AnonymousCredentials
                credentials = AnonymousCredentials()
            cls = getattr(dataflow_api(), f"{kind}V1Beta3Client")
            self._clients[kind] = cls(credentials=credentials, transport="rest",
                                      client_options=ClientOptions(api_endpoint=endpoint) if endpoint else None)
        return self._clients[kind]

    def job(self, record: dict[str, Any]):
        """The job as Dataflow has it now; None when it does not know it."""
        from google.api_core import exceptions as gexc
        try:
            return self.client("Jobs").get_job(request={"project_id": record["project"], "location": record["region"],
                                                        "job_id": record["job_id"]})
        except gexc.NotFound:
            return None

    @staticmethod
    def state(job) -> str:
        return "JOB_STATE_UNKNOWN" if job is None else dataflow_api().JobState(job.current_state).name

    def states(self) -> list[tuple[dict[str, Any], Any]]:
        """Each recorded job with Dataflow's view of it, oldest first."""
        return [(record, self.job(record)) for record in self.jobs()]

    def last_error(self, record: dict[str, Any]) -> str | None:
        """The job's newest error message, its first line."""
        api = dataflow_api()
        messages = self.client("Messages").list_job_messages(request=api.ListJobMessagesRequest(
            project_id=record["project"], location=record["region"], job_id=record["job_id"],
            minimum_importance=api.JobMessageImportance.JOB_MESSAGE_ERROR))
        # The newest; of messages logged at one instant, the last the API lists.
        newest = max(reversed(list(messages)), key=lambda m: m.time.timestamp(), default=None)
        return error_line(Exception(newest.message_text))[:300] if newest is not None else None

    @property
    def where(self) -> str:
        return f"Dataflow jobs recorded in {self._record_path()}"

    def existing(self) -> set[int]:
        """The machines of the jobs that have not ended."""
        return {m for record, job in self.states() if job is not None and self.state(job) not in TERMINAL
                for m in record["machines"]}

    def health(self, machine: int) -> Health:
        latest = [(r, j) for r, j in self.states() if machine in r["machines"]]
        if not latest:
            return Health(ABSENT)
        record, job = latest[-1]
        state = self.state(job)
        if job is None:
            return Health(GONE, f"Dataflow does not know job {record['job_id']}")
        if state in TERMINAL:
            return Health(GONE, f"job {record['job_id']} {state}")
        return Health(PENDING if state in NOT_RUNNING else ALIVE, f"job {record['job_id']} {state}")

    def incarnations(self) -> dict[int, list[Incarnation]]:
        """Dataflow does not say which worker runs which machine: a machine's incarnation is each
        run of its runner, from the ``status.json`` it wrote since its job's submission (while
        the runner runs on a TPU worker, that worker does nothing else)."""
        found: dict[int, list[Incarnation]] = {}
        latest = {m: (record, job) for record, job in self.states() for m in record["machines"]}
        for machine, (record, job) in latest.items():
            status = read_machine(self.config, machine).status or {}
            started = parse_time(status.get("started_at"))
            if started is None or started < parse_time(record["submitted_at"]):
                continue  # not yet run by this job
            ended = job is None or self.state(job) in TERMINAL
            final = status.get("state") in FINAL
            end = parse_time(status.get("updated_at")) if final else (
                job.current_state_time.timestamp() if ended and job is not None else None)
            found[machine] = [Incarnation(f"{record['job_id']}/{status.get('hostname')}@{started:.3f}", started,
                                          end, active=not (final or ended))]
        return found

    def delete(self, machines: Sequence[int]) -> None:
        """Cancels the jobs holding these machines (a job goes as a whole)."""
        api = dataflow_api()
        for record, job in self.states():
            if job is None or self.state(job) in TERMINAL or not set(machines) & set(record["machines"]):
                continue
            self.client("Jobs").update_job(request=api.UpdateJobRequest(
                project_id=record["project"], location=record["region"], job_id=record["job_id"],
                job=api.Job(requested_state=api.JobState.JOB_STATE_CANCELLED)))
            log.info("dataflow job %s (%s): cancel requested", record["job_id"], record["job_name"])

    # -- status and supervise ------------------------------------------------------------------

    def job_status(self) -> tuple[str, bool] | None:
        """The newest job in one line (its state, its newest error message), and whether every
        job has ended; None before the first launch."""
        states = self.states()
        if not states:
            return None
        record, job = states[-1]
        line = f"dataflow job {record['job_name']} ({record['job_id']}): " + (
            self.state(job) if job is not None else "unknown to Dataflow")
        error = self.last_error(record) if job is not None else None
        return line + (f"; last error: {error}" if error else ""), self._ended(states)

    def _ended(self, states: list[tuple[dict[str, Any], Any]]) -> bool:
        return all(job is None or self.state(job) in TERMINAL for _, job in states)

    def wait_for_job(self, look: Callable[[], None]) -> None:
        """Every ``--interval`` seconds: ``look`` (the usage ledger), then the jobs' states, until
        every job has ended; a newest job that did not end done is one line with its newest error."""
        said = None
        while True:
            look()
            try:
                states = self.states()
            except Exception as e:  # a transient API error: look again next time
                log.warning("cannot ask dataflow: %s", error_line(e))
                states = None
            if states == []:
                raise UserError(f"fleet {self.config.name!r} has no Dataflow job: none recorded in "
                                f"{self._record_path()}; run launch")
            if states:
                record, job = states[-1]
                if self.state(job) != said:
                    said = self.state(job)
                    log.info("dataflow job %s (%s): %s", record["job_id"], record["job_name"], said)
                if self._ended(states):
                    break
            time.sleep(self.config.interval)
        if said != "JOB_STATE_DONE":
            error = self.last_error(record) if job is not None else "Dataflow does not know it"
            raise UserError(f"dataflow job {record['job_name']} ({record['job_id']}) ended {said}"
                            + (f": {error}" if error else "") + "; fix it, then run launch (the machines "
                            "resume from their checkpoints) and supervise again")
