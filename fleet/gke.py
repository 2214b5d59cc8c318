"""Machines as the pods of one Kubernetes Indexed Job on GKE TPU nodes.

``completionMode: Indexed`` gives pod N ``JOB_COMPLETION_INDEX=N`` (read by ``--machine_id
auto``); ``completions = parallelism = N``. Kubernetes restarts a failed index itself, up to
``backoffLimitPerIndex`` times; a preemption (pod condition ``DisruptionTarget``) is ignored by
the ``podFailurePolicy``, so it costs no retry; ``podReplacementPolicy: Failed`` waits for the old
pod to be gone before the new one starts (one TPU, never two pods on it). Not a JobSet: a JobSet
restarts every pod when one fails, right for one multi-host slice, wrong for independent machines.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from common.cli import UserError
from common.extras import require
from common.files import write_bytes
from fleet.backend import ABSENT, ALIVE, GONE, Backend, Health
from fleet.runner import runner_argv

log = logging.getLogger("runners.fleet")


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


class GkeBackend(Backend):
    self_healing = True  # Kubernetes restarts pods; supervise only watches and merges
    creates_on_request = True  # the manifest may go through kubectl instead

    def __init__(self, config):
        super().__init__(config)
        self._api = None

    def job(self) -> dict[str, Any]:
        """The Indexed Job, as a manifest."""
        c = self.config
        if not c.image:
            raise UserError("--backend gke needs --image (a container image with this project and "
                            "jax[tpu] installed)")
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
        tpus = {"google.com/tpu": str(c.tpu_chips)}
        container = {"name": "runner", "image": c.image,
                     "command": ["python", "-m", "runners.tpu_host", *runner_argv(c, "auto")],
                     "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
                     "resources": {"requests": dict(tpus), "limits": dict(tpus)}}
        labels = {"fleet": c.name, "app.kubernetes.io/managed-by": "runners.fleet"}
        return {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": c.name, "namespace": c.namespace, "labels": labels},
            "spec": {
                "completionMode": "Indexed", "completions": c.num_machines, "parallelism": c.num_machines,
                "backoffLimitPerIndex": c.max_restarts,
                "maxFailedIndexes": c.num_machines,  # one machine's failures never end the others
                "podReplacementPolicy": "Failed",
                "podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": [
                    {"type": "DisruptionTarget", "status": "True"}]}]},
                "template": {
                    "metadata": {"labels": {"fleet": c.name}},
                    "spec": {"restartPolicy": "Never",  # required by backoffLimitPerIndex
                             "terminationGracePeriodSeconds": c.grace_period_s,
                             "nodeSelector": selector,
                             "tolerations": tolerations,
                             "containers": [container]}}}}

    def manifest_yaml(self) -> str:
        import yaml
        return yaml.safe_dump(self.job(), sort_keys=False)

    def write_for_user(self, path: str | None) -> str:
        path = path or f"{self.config.name}-job.yaml"
        write_bytes(path, self.manifest_yaml().encode())
        return f"wrote the Job manifest to {path}: submit it with kubectl apply -f {path}, or launch --apply"

    @property
    def where(self) -> str:
        return f"Job {self.config.name} in namespace {self.config.namespace}"

    def plan(self, machines: Sequence[int]) -> str:
        return f"# kubectl apply -f - (namespace {self.config.namespace})\n{self.manifest_yaml()}"

    @property
    def api(self):
        """``BatchV1Api`` from the kubeconfig (``KUBECONFIG``, ``~/.kube/config``) or, in a pod,
        the service account."""
        if self._api is None:
            kubernetes = require("kubernetes", "gke", "--backend gke")
            try:
                kubernetes.config.load_kube_config()
            except Exception:
                try:
                    kubernetes.config.load_incluster_config()
                except Exception:
                    raise UserError("no Kubernetes cluster configured: set KUBECONFIG or run "
                                    "gcloud container clusters get-credentials CLUSTER") from None
            self._api = kubernetes.client.BatchV1Api()
        return self._api

    def _read(self):
        api = self.api  # first: it says which extra to install when the client is missing
        from kubernetes.client.exceptions import ApiException
        try:
            return api.read_namespaced_job(self.config.name, self.config.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise UserError(f"Kubernetes: reading Job {self.config.name}: {e.status} {e.reason}") from None

    def create(self, machines: Sequence[int]) -> list[int]:
        self.api.create_namespaced_job(self.config.namespace, self.job())
        log.info("Job %s/%s created: %d indexes", self.config.namespace, self.config.name,
                 self.config.num_machines)
        return list(range(self.config.num_machines))

    def existing(self) -> set[int]:
        job = self._read()
        return set(range(job.spec.completions)) if job is not None else set()

    def health(self, machine: int) -> Health:
        job = self._read()
        if job is None:
            return Health(ABSENT)
        status = job.status
        if status is not None and machine in parse_indexes(status.failed_indexes):
            return Health(GONE, f"index {machine} failed {self.config.max_restarts + 1} times "
                                "(backoffLimitPerIndex)")
        if status is not None and machine in parse_indexes(status.completed_indexes):
            # Asked only of machines whose files do not say completed: the runner exited 0 after a
            # signal stopped it, so Kubernetes counts the index as done and will not rerun it.
            return Health(GONE, f"index {machine} succeeded before its stream was done (stopped by a "
                                "signal); launch a new Job to finish it")
        if status is not None and any(c.type == "Failed" and c.status == "True" for c in status.conditions or []):
            return Health(GONE, "Job failed")
        return Health(ALIVE)

    def delete(self, machines: Sequence[int]) -> None:
        api = self.api  # first: it says which extra to install when the client is missing
        from kubernetes.client.exceptions import ApiException
        try:  # Foreground: the pods go first, then the Job
            api.delete_namespaced_job(self.config.name, self.config.namespace,
                                           propagation_policy="Foreground")
        except ApiException as e:
            if e.status != 404:
                raise UserError(f"Kubernetes: deleting Job {self.config.name}: {e.status} {e.reason}") from None
        log.info("Job %s/%s deleted", self.config.namespace, self.config.name)
