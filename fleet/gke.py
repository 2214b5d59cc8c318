"""Machines on GKE TPU nodes: the pods of one Kubernetes Indexed Job, or, where each machine is a
multi-host slice, one JobSet per machine.

**Single-host machines** (``fleet/tpu_topology.py`` says from ``--gke_accelerator`` and
``--gke_topology``): one Indexed Job ``{name}``. ``completionMode: Indexed`` gives pod N
``JOB_COMPLETION_INDEX=N`` (read by ``--machine_id auto``); ``completions = parallelism = N``.
Kubernetes restarts a failed index itself, up to ``backoffLimitPerIndex`` times. A preemption
costs no retry: the ``podFailurePolicy`` ignores a pod with condition ``DisruptionTarget`` and a
runner that exited ``STOPPED_EXIT_CODE`` (the fleet passes ``--stopped_exit_code``: a runner a
signal stopped stored what it had and must run again; with exit 0 Kubernetes would count the
index as done). ``podReplacementPolicy: Failed`` waits for the old pod to be gone before the new
one starts (one TPU, never two pods on it). Not a JobSet: a JobSet restarts every pod when one
fails, right for one multi-host slice, wrong for independent machines.

**Multi-host slices**: one JobSet ``{name}-NNN`` (``jobset.x-k8s.io/v1alpha2``, the JobSet
controller must be installed) per machine, of one replicated Job ``slice``: an Indexed Job of one
pod per host (``completions = parallelism = hosts``, ``backoffLimit: 0``), started and restarted
together, since a slice is all-or-nothing. A failed pod fails the Job; the JobSet's
``failurePolicy`` then recreates the whole slice, at most ``maxRestarts = --max_restarts`` times,
except after a preemption: the Job's ``podFailurePolicy`` fails it with reason ``PodFailurePolicy``
(``DisruptionTarget``, or the stopped exit code), which the JobSet rule
``RestartJobSetAndIgnoreMaxRestarts`` does not count. The runner of host p gets
``--machine_id N --num_processes H --process_id $(JOB_COMPLETION_INDEX) --coordinator_address
{name}-NNN-slice-0-0.{name}-NNN:PORT`` (``coordinator_host``), set explicitly rather than left to
JAX's GKE detection: see ``coordinator_host``.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from common.cli import UserError
from common.extras import require
from common.files import write_bytes
from fleet.backend import ABSENT, ALIVE, GONE, Backend, Health, Incarnation
from fleet.runner import flag_names, fleet_flags, slice_flags
from fleet.tpu_topology import SliceShape, slice_shape

log = logging.getLogger("runners.fleet")

# What the runner exits with when a signal stopped it (128 + SIGTERM, as a process SIGTERM killed
# would): Kubernetes runs such a pod again, and the podFailurePolicy does not count it.
STOPPED_EXIT_CODE = 143
CONTAINER = "runner"
REPLICATED_JOB = "slice"
MACHINE_LABEL = "fleet-machine"  # on a slice's JobSet and pods: the machine number
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # set by the Job controller on its pods
JOBSET_UID_LABEL = "jobset.sigs.k8s.io/jobset-uid"        # set by the JobSet controller on its pods
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"      # (where a release sets no uid label)
RESTART_LABEL = "jobset.sigs.k8s.io/restart-attempt"      # the JobSet's restarts when the pod was made
JOBSET = {"group": "jobset.x-k8s.io", "version": "v1alpha2", "plural": "jobsets"}
# The runner flags the fleet sets on each host of a slice (a user's would contradict them).
SLICE_OWNED = ("coordinator_address", "num_processes", "process_id", "distributed")
FINISHED_PHASES = ("Succeeded", "Failed")


def parse_indexes(text: str | None) -> set[int]:
    """Kubernetes' index list, ``"1,3-5"`` -> ``{1, 3, 4, 5}``."""
    out: set[int] = set()
    for part in (text or "").split(","):
        if "-" in part:
            first, last = part.split("-")
            out.update(range(int(first), int(last) + 1))
        elif part.strip():
            out.add(int(part))
    return out


def jobset_name(fleet: str, machine: int) -> str:
    return f"{fleet}-{machine:03d}"


def coordinator_host(jobset: str) -> str:
    """Host 0's stable DNS name in JobSet ``jobset``: ``{jobset}-slice-0-0.{jobset}``.

    The JobSet controller names the child Job ``{jobset}-{replicatedJob}-{jobIndex}``
    (kubernetes-sigs/jobset ``pkg/util/placement/placement.go``, ``GenJobName``); the Job
    controller names an Indexed Job's pod host ``{job}-{index}``; ``network.enableDNSHostnames``
    sets the pods' subdomain to a headless Service named, by default, after the JobSet
    (``pkg/controllers/jobset_controller.go``, ``GetSubdomain``), resolvable within the namespace.
    The scheme is documented on ``Network.EnableDNSHostnames`` in
    ``api/jobset/v1alpha2/jobset_types.go``.

    Not JAX's own detection (``jax/_src/clusters/cloud_tpu_cluster.py``, ``GkeTpuCluster``): it
    needs the ``TPU_WORKER_HOSTNAMES`` / ``TPU_WORKER_ID`` that GKE's TPU webhook injects on a TPU
    VM, so it cannot run anywhere else (the tests run this derivation on localhost), and explicit
    arguments win over what it detects (``jax/_src/clusters/cluster.py`` fills only unset ones).
    """
    return f"{jobset}-{REPLICATED_JOB}-0-0.{jobset}"


class GkeBackend(Backend):
    self_healing = True  # Kubernetes restarts pods; supervise only watches and merges
    creates_on_request = True  # the manifest may go through kubectl instead

    def __init__(self, config):
        super().__init__(config)
        self.shape: SliceShape = slice_shape(config.gke_accelerator, config.gke_topology, config.tpu_chips)
        self._kubernetes = None
        self._clients: dict[str, Any] = {}

    # -- the manifests --------------------------------------------------------------------------

    def _check_image(self) -> None:
        if not self.config.image:
            raise UserError("--backend gke needs --image (a container image with this project and "
                            "jax[tpu] installed)")

    def _pod_spec(self, runner_flags: list[str]) -> dict[str, Any]:
        """One pod: the runner on one TPU host."""
        c = self.config
        selector = {"cloud.google.com/gke-tpu-accelerator": c.gke_accelerator,
                    "cloud.google.com/gke-tpu-topology": c.gke_topology}
        if c.gke_spot:
            selector["cloud.google.com/gke-spot"] = "true"
        # GKE taints TPU nodes (and tainted spot pools); requesting google.com/tpu alone is not
        # enough on every cluster, so both tolerations are spelled out.
        tolerations = [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
        if c.gke_spot:
            tolerations.append({"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
                                "effect": "NoSchedule"})
        tpus = {"google.com/tpu": str(self.shape.chips_per_host)}
        container = {"name": CONTAINER, "image": c.image,
                     "command": ["python", "-m", "runners.tpu_host", *runner_flags],
                     "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
                     "resources": {"requests": dict(tpus), "limits": dict(tpus)}}
        return {"restartPolicy": "Never",  # required by backoffLimitPerIndex and podFailurePolicy
                "terminationGracePeriodSeconds": c.grace_period_s,
                "nodeSelector": selector, "tolerations": tolerations, "containers": [container]}

    def _runner_flags(self, machine: int | str, distributed: Sequence[str] = ()) -> list[str]:
        # The fleet's flags, then the stopped exit code, then the user's (which win: a user may
        # force --stopped_exit_code 0, and health() then says what that costs).
        return [*fleet_flags(self.config, machine), "--stopped_exit_code", str(STOPPED_EXIT_CODE),
                *distributed, *self.config.runner]

    def _stopped_rule(self, action: str) -> dict[str, Any]:
        return {"action": action, "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                  "values": [STOPPED_EXIT_CODE]}}

    def _preempted_rule(self, action: str) -> dict[str, Any]:
        return {"action": action, "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}

    def _labels(self) -> dict[str, str]:
        return {"fleet": self.config.name, "app.kubernetes.io/managed-by": "runners.fleet"}

    def job(self) -> dict[str, Any]:
        """The Indexed Job of single-host machines, as a manifest."""
        self._check_image()
        c = self.config
        return {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": c.name, "namespace": c.namespace, "labels": self._labels()},
            "spec": {
                "completionMode": "Indexed", "completions": c.num_machines, "parallelism": c.num_machines,
                "backoffLimitPerIndex": c.max_restarts,
                "maxFailedIndexes": c.num_machines,  # one machine's failures never end the others
                "podReplacementPolicy": "Failed",
                "podFailurePolicy": {"rules": [self._preempted_rule("Ignore"), self._stopped_rule("Ignore")]},
                "template": {"metadata": {"labels": {"fleet": c.name}},
                             "spec": self._pod_spec(self._runner_flags("auto"))}}}

    def jobset(self, machine: int) -> dict[str, Any]:
        """Machine ``machine`` as one JobSet of one Indexed Job with a pod per host of its slice."""
        self._check_image()
        c, hosts = self.config, self.shape.hosts
        name = jobset_name(c.name, machine)
        flags = self._runner_flags(machine, slice_flags(coordinator_host(name), c.gke_coordinator_port, hosts))
        labels = {**self._labels(), MACHINE_LABEL: str(machine)}
        return {
            "apiVersion": f"{JOBSET['group']}/{JOBSET['version']}", "kind": "JobSet",
            "metadata": {"name": name, "namespace": c.namespace, "labels": labels,
                         # every pod of the Job in one node pool (one slice), one Job per pool
                         "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology":
                                         "cloud.google.com/gke-nodepool"}},
            "spec": {
                "network": {"enableDNSHostnames": True},  # {jobset}-slice-0-P.{jobset} resolve
                "failurePolicy": {"maxRestarts": c.max_restarts, "rules": [
                    # A Job failed by its podFailurePolicy was preempted (or stopped): restart,
                    # uncounted. Any other failure takes the default action, RestartJobSet
                    # (counted against maxRestarts).
                    {"name": "preempted", "action": "RestartJobSetAndIgnoreMaxRestarts",
                     "onJobFailureReasons": ["PodFailurePolicy"]}]},
                "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": {
                    "completionMode": "Indexed", "completions": hosts, "parallelism": hosts,
                    "backoffLimit": 0,  # one pod down is the slice down: the JobSet restarts it whole
                    "podFailurePolicy": {"rules": [self._preempted_rule("FailJob"),
                                                   self._stopped_rule("FailJob")]},
                    "template": {"metadata": {"labels": {"fleet": c.name, MACHINE_LABEL: str(machine)}},
                                 "spec": self._pod_spec(flags)}}}}]}}

    def manifests(self, machines: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """The Job, or the JobSets of ``machines`` (default: all)."""
        if not self.shape.multi_host:
            return [self.job()]
        self._check_slice_runner_flags()
        return [self.jobset(m) for m in (range(self.config.num_machines) if machines is None else machines)]

    def _check_slice_runner_flags(self) -> None:
        for name in flag_names(self.config.runner):
            if name in SLICE_OWNED:
                raise UserError(f"runner flag --{name} is set by the fleet on a multi-host slice (from "
                                "the JobSet's host names and JOB_COMPLETION_INDEX); remove it")

    def manifest_yaml(self, machines: Sequence[int] | None = None) -> str:
        import yaml
        return yaml.safe_dump_all(self.manifests(machines), sort_keys=False)

    def write_for_user(self, path: str | None) -> str:
        path = path or f"{self.config.name}-job.yaml"
        write_bytes(path, self.manifest_yaml().encode())
        if not self.shape.multi_host:
            return f"wrote the Job manifest to {path}: submit it with kubectl apply -f {path}, or launch --apply"
        return (f"wrote {self.config.num_machines} JobSet manifest(s) to {path} (each machine a slice of "
                f"{self.shape.hosts} hosts): with the JobSet controller installed, submit them with "
                f"kubectl apply -f {path}, or launch --apply")

    @property
    def where(self) -> str:
        if self.shape.multi_host:
            return f"JobSets labelled fleet={self.config.name} in namespace {self.config.namespace}"
        return f"Job {self.config.name} in namespace {self.config.namespace}"

    def plan(self, machines: Sequence[int]) -> str:
        return f"# kubectl apply -f - (namespace {self.config.namespace})\n{self.manifest_yaml(machines)}"

    # -- the API --------------------------------------------------------------------------------

    def _client(self, kind: str):
        """A ``kubernetes.client`` API (``BatchV1Api``, ``CoreV1Api``, ``CustomObjectsApi``) from the
        kubeconfig (``KUBECONFIG``, ``~/.kube/config``) or, in a pod, the service account."""
        if self._kubernetes is None:
            kubernetes = require("kubernetes", "gke", "--backend gke")
            try:
                kubernetes.config.load_kube_config()
            except Exception:
                try:
                    kubernetes.config.load_incluster_config()
                except Exception:
                    raise UserError("no Kubernetes cluster configured: set KUBECONFIG or run "
                                    "gcloud container clusters get-credentials CLUSTER") from None
            self._kubernetes = kubernetes
        if kind not in self._clients:
            self._clients[kind] = getattr(self._kubernetes.client, kind)()
        return self._clients[kind]

    @property
    def api(self):
        return self._client("BatchV1Api")

    @property
    def custom(self):
        return self._client("CustomObjectsApi")

    def _call(self, what: str, call, *args, missing_ok: bool = False, **kwargs):
        """``call(*args, **kwargs)``; None for a 404 where ``missing_ok``; else one line."""
        from kubernetes.client.exceptions import ApiException
        try:
            return call(*args, **kwargs)
        except ApiException as e:
            if missing_ok and e.status == 404:
                return None
            raise UserError(f"Kubernetes: {what}: {e.status} {e.reason}") from None

    def _read(self):
        api = self.api  # first: it says which extra to install when the client is missing
        return self._call(f"reading Job {self.config.name}", api.read_namespaced_job,
                          self.config.name, self.config.namespace, missing_ok=True)

    def _jobsets(self) -> dict[int, dict]:
        """This fleet's JobSets by machine, in one list call."""
        custom = self.custom
        answer = self._call(f"listing JobSets labelled fleet={self.config.name}",
                            custom.list_namespaced_custom_object, JOBSET["group"], JOBSET["version"],
                            self.config.namespace, JOBSET["plural"], label_selector=f"fleet={self.config.name}")
        return {int(js["metadata"]["labels"][MACHINE_LABEL]): js for js in answer.get("items", [])}

    def create(self, machines: Sequence[int]) -> list[int]:
        if not self.shape.multi_host:
            self._call(f"creating Job {self.config.name}", self.api.create_namespaced_job,
                       self.config.namespace, self.job())
            log.info("Job %s/%s created: %d indexes", self.config.namespace, self.config.name,
                     self.config.num_machines)
            return list(range(self.config.num_machines))
        custom = self.custom
        for manifest in self.manifests(machines):
            self._call(f"creating JobSet {manifest['metadata']['name']}", custom.create_namespaced_custom_object,
                       JOBSET["group"], JOBSET["version"], self.config.namespace, JOBSET["plural"], manifest)
            log.info("JobSet %s/%s created: %d hosts", self.config.namespace, manifest["metadata"]["name"],
                     self.shape.hosts)
        return list(machines)

    def existing(self) -> set[int]:
        if self.shape.multi_host:
            return set(self._jobsets())
        job = self._read()
        return set(range(job.spec.completions)) if job is not None else set()

    def health(self, machine: int) -> Health:
        return self.healths([machine])[machine]

    def healths(self, machines: Sequence[int]) -> dict[int, Health]:
        """One read (the Job, or the list of JobSets) for all of ``machines``."""
        if self.shape.multi_host:
            jobsets = self._jobsets()
            return {m: self._jobset_health(jobsets.get(m), m) for m in machines}
        job = self._read()
        return {m: self._index_health(job, m) for m in machines}

    def _index_health(self, job, machine: int) -> Health:
        if job is None:
            return Health(ABSENT)
        status = job.status
        if status is not None and machine in parse_indexes(status.failed_indexes):
            return Health(GONE, f"index {machine} failed {self.config.max_restarts + 1} times "
                                "(backoffLimitPerIndex)")
        if status is not None and machine in parse_indexes(status.completed_indexes):
            # Asked only of machines whose files do not say completed: the runner exited 0 though a
            # signal stopped it, which it does only when the runner flags force it.
            return Health(GONE, f"index {machine} exited 0 before its stream was done: the runner flags "
                                f"set --stopped_exit_code 0, so Kubernetes took a stopped runner for a "
                                f"finished one; remove it (the fleet passes {STOPPED_EXIT_CODE}) and "
                                "launch a new Job")
        if status is not None and any(c.type == "Failed" and c.status == "True" for c in status.conditions or []):
            return Health(GONE, "Job failed")
        return Health(ALIVE)

    def _jobset_health(self, jobset: dict | None, machine: int) -> Health:
        if jobset is None:
            return Health(ABSENT)
        status = jobset.get("status") or {}
        state = status.get("terminalState") or next(
            (c["type"] for c in status.get("conditions") or [] if c.get("type") in ("Completed", "Failed")
             and c.get("status") == "True"), None)
        name = jobset["metadata"]["name"]
        if state == "Failed":
            return Health(GONE, f"JobSet {name} failed after {status.get('restarts', 0)} restart(s) "
                                f"(maxRestarts {self.config.max_restarts}, preemptions not counted)")
        if state == "Completed":  # asked only when the files do not say completed (see above)
            return Health(GONE, f"JobSet {name} completed before its stream was done: the runner flags "
                                f"set --stopped_exit_code 0; remove it (the fleet passes "
                                f"{STOPPED_EXIT_CODE}), teardown and launch again")
        return Health(ALIVE)

    def incarnations(self) -> dict[int, list[Incarnation]]:
        """From one list of the fleet's pods: each pod of the Job is one life of its index's
        machine; a slice's pods of one JobSet restart are together one life of the machine (from
        its first pod's start to its last one's end). Pods not started yet cost nothing and are
        left out; the pods of a slice's earlier restarts are deleted by the JobSet controller."""
        core = self._client("CoreV1Api")
        pods = self._call(f"listing the pods labelled fleet={self.config.name}", core.list_namespaced_pod,
                          self.config.namespace, label_selector=f"fleet={self.config.name}").items
        groups: dict[tuple[int, str], list] = {}
        for pod in pods:
            labels = pod.metadata.labels or {}
            if pod.status is None or pod.status.start_time is None:
                continue
            if MACHINE_LABEL in labels:  # a slice's pod: the fleet labels the template itself
                machine = int(labels[MACHINE_LABEL])
                jobset = labels.get(JOBSET_UID_LABEL) or labels.get(JOBSET_NAME_LABEL, "")
                key = f"{jobset}/restart-{labels.get(RESTART_LABEL, '0')}"
            elif INDEX_LABEL in labels:
                machine, key = int(labels[INDEX_LABEL]), pod.metadata.uid
            else:
                continue
            groups.setdefault((machine, key), []).append(pod)
        out: dict[int, list[Incarnation]] = {}
        for (machine, key), members in groups.items():
            out.setdefault(machine, []).append(_incarnation(key, members))
        return {m: sorted(lives, key=lambda i: i.started_at) for m, lives in sorted(out.items())}

    def delete(self, machines: Sequence[int]) -> None:
        if not self.shape.multi_host:
            api = self.api  # first: it says which extra to install when the client is missing
            # Foreground: the pods go first, then the Job
            self._call(f"deleting Job {self.config.name}", api.delete_namespaced_job, self.config.name,
                       self.config.namespace, propagation_policy="Foreground", missing_ok=True)
            log.info("Job %s/%s deleted", self.config.namespace, self.config.name)
            return
        custom = self.custom
        for machine in machines:
            name = jobset_name(self.config.name, machine)
            self._call(f"deleting JobSet {name}", custom.delete_namespaced_custom_object, JOBSET["group"],
                       JOBSET["version"], self.config.namespace, JOBSET["plural"], name,
                       propagation_policy="Foreground", missing_ok=True)
            log.info("JobSet %s/%s deleted", self.config.namespace, name)


def _incarnation(key: str, pods: list) -> Incarnation:
    """One life made of ``pods`` (one, or a slice's): from the first start to the last end."""
    ends = [_finished_at(p) for p in pods]
    active = any(p.status.phase not in FINISHED_PHASES for p in pods)
    ended = None if active or None in ends else max(ends)
    return Incarnation(key=key, started_at=min(p.status.start_time.timestamp() for p in pods),
                       ended_at=ended, active=active)


def _finished_at(pod) -> float | None:
    """When its last container ended, where its status says."""
    ends = [s.state.terminated.finished_at for s in pod.status.container_statuses or []
            if s.state is not None and s.state.terminated is not None and s.state.terminated.finished_at]
    return max(ends).timestamp() if ends else None
