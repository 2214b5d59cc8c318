"""A local server of the Kubernetes API the gke backend drives, so the tests run the real
``kubernetes`` client against the far side of the wire: batch/v1 Jobs, v1 pods and
jobset.x-k8s.io/v1alpha2 JobSets, with small but faithful controllers behind them.

* The Job controller (Indexed Jobs): a pod per index (labels ``job-name``,
  ``batch.kubernetes.io/job-completion-index`` and the template's; ``JOB_COMPLETION_INDEX`` in
  each container's env; hostname ``{job}-{index}``). A finished pod is judged by the Job's own
  ``podFailurePolicy`` (first matching rule: ``onExitCodes`` In/NotIn, ``onPodConditions``; no
  match = Count): Ignore recreates the index uncounted, Count counts a failure against
  ``backoffLimitPerIndex`` (then the index goes to ``failedIndexes``) or ``backoffLimit`` (then the
  Job fails), FailIndex fails the index, FailJob the Job (reason ``PodFailurePolicy``). Exit 0 puts
  the index in ``completedIndexes``; all done sets ``Complete`` (or ``Failed``).
* The JobSet controller: a child Job ``{jobset}-{replicatedJob}-{i}`` per replica, labelled (and
  its pods) with the JobSet's name, uid and restart attempt, pods under the subdomain
  ``{jobset}`` with ``network.enableDNSHostnames``. A failed child Job is judged by the JobSet's
  ``failurePolicy`` rules (``onJobFailureReasons``; default RestartJobSet): a restart deletes the
  child Jobs and their pods and creates them again; ``maxRestarts`` counted restarts, then
  ``Failed``. All children complete: ``Completed``.
* The kubelet: a created pod "runs" on a thread by calling ``run_pod(pod)`` (the test's hook,
  like ``FakeTpuApi.on_create``), whose answer is the container's exit code. Without a hook pods
  stay pending and statuses can be scripted (``set_job_status``, ``set_jobset_status``).

Deleting a Job or a JobSet deletes what it owns. What was sent is kept for the tests to check.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import traceback
from typing import Any, Callable

from tests.cloud_fakes import Server, _now

INDEX_KEY = "batch.kubernetes.io/job-completion-index"
FAILURES_KEY = "batch.kubernetes.io/job-index-failure-count"
IGNORED_KEY = "batch.kubernetes.io/job-index-ignored-failure-count"
JOBSET_PREFIX = "jobset.sigs.k8s.io/"
DEFAULT_BACKOFF_LIMIT = 6  # batch/v1 Job's default
PodHook = Callable[[dict], int]


def _k8s_status(code: int, reason: str, message: str) -> tuple[int, Any]:
    return code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": message, "reason": reason, "code": code}


def _deleted() -> tuple[int, Any]:
    return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}


def pod_env(pod: dict, container: int = 0) -> dict[str, str]:
    """The container's environment as the kubelet resolves it (``value``, or a ``fieldRef`` to the
    pod's name, labels or annotations)."""
    env = {}
    for var in pod["spec"]["containers"][container].get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        path = var["valueFrom"]["fieldRef"]["fieldPath"]
        found = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        env[var["name"]] = (pod["metadata"]["name"] if path == "metadata.name"
                            else pod["metadata"].get(found.group(1), {}).get(found.group(2), ""))
    return env


def expanded_command(pod: dict, container: int = 0) -> list[str]:
    """The container's command as the kubelet runs it: ``$(VAR)`` replaced from its env where the
    env defines VAR, ``$$`` an escaped ``$``."""
    env = pod_env(pod, container)

    def expand(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return [re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, word)
            for word in pod["spec"]["containers"][container]["command"]]


def _selected(obj: dict, selector: str) -> bool:
    """``labelSelector`` of ``k=v`` (and bare ``k``: has the label) terms."""
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if key not in labels or ("=" in term and labels[key] != value):
            return False
    return True


def _condition(kind: str, reason: str, message: str = "") -> dict:
    return {"type": kind, "status": "True", "reason": reason, "message": message,
            "lastTransitionTime": _now()}


def _index_list(indexes: set[int]) -> str:
    """``{1, 3, 4, 5}`` -> ``"1,3-5"``, as Kubernetes writes ``completedIndexes``."""
    runs: list[list[int]] = []
    for i in sorted(indexes):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _rule_matches(rule: dict, pod: dict) -> bool:
    """Does this ``podFailurePolicy`` rule match the failed ``pod``?"""
    if "onExitCodes" in rule:
        requirement = rule["onExitCodes"]
        for status in pod["status"].get("containerStatuses", []):
            if requirement.get("containerName") not in (None, status["name"]):
                continue
            code = status["state"]["terminated"]["exitCode"]
            if code == 0:  # a container that succeeded never matches
                continue
            if (code in requirement["values"]) == (requirement["operator"] == "In"):
                return True
        return False
    conditions = {(c["type"], c["status"]) for c in pod["status"].get("conditions", [])}
    return any((c["type"], c.get("status", "True")) in conditions for c in rule.get("onPodConditions", []))


def failure_action(job: dict, pod: dict) -> str:
    """What the Job's ``podFailurePolicy`` does with a failed pod (Count when no rule matches)."""
    rules = (job["spec"].get("podFailurePolicy") or {}).get("rules", [])
    return next((r["action"] for r in rules if _rule_matches(r, pod)), "Count")


class FakeKubernetesApi(Server):
    """Jobs, pods and JobSets in namespaces, with the controllers described above."""

    def __init__(self, run_pod: PodHook | None = None):
        super().__init__()
        self.run_pod = run_pod
        self.jobs: dict[tuple[str, str], dict] = {}
        self.jobsets: dict[tuple[str, str], dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.created: list[dict] = []  # what the client posted (Jobs and JobSets), as sent
        self._ids = itertools.count(1)
        self._index_state: dict[tuple[str, str], dict[str, Any]] = {}  # per Job: done, failed, failures

    def kubeconfig(self, path: str) -> str:
        """A kubeconfig whose current context is this server (no authentication)."""
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                  "clusters": [{"name": "fake", "cluster": {"server": self.endpoint}}],
                  "users": [{"name": "fake", "user": {}}],
                  "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}
        with open(path, "w") as f:
            json.dump(config, f)  # JSON is YAML
        return path

    def set_job_status(self, namespace: str, name: str, status: dict) -> None:
        with self.lock:
            self.jobs[namespace, name]["status"] = status

    def set_jobset_status(self, namespace: str, name: str, status: dict) -> None:
        with self.lock:
            self.jobsets[namespace, name]["status"] = status

    def pods_of(self, namespace: str, selector: str = "") -> list[dict]:
        """Pods (present now) matching a label selector, oldest first."""
        with self.lock:
            found = [copy.deepcopy(p) for (ns, _), p in self.pods.items() if ns == namespace and _selected(p, selector)]
        return sorted(found, key=lambda p: int(p["metadata"]["uid"].split("-")[-1]))

    # -- the API --------------------------------------------------------------------------------

    def handle(self, method, path, query, body):
        routes = [(r"/apis/batch/v1/namespaces/([^/]+)/jobs(?:/([^/]+))?", self.jobs, "jobs.batch", "JobList",
                   "batch/v1", self._create_job, self._delete_job),
                  (r"/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?", self.pods, "pods", "PodList", "v1",
                   None, None),
                  (r"/apis/jobset\.x-k8s\.io/v1alpha2/namespaces/([^/]+)/jobsets(?:/([^/]+))?", self.jobsets,
                   "jobsets.jobset.x-k8s.io", "JobSetList", "jobset.x-k8s.io/v1alpha2", self._create_jobset,
                   self._delete_jobset)]
        for pattern, store, what, list_kind, api_version, create, delete in routes:
            found = re.fullmatch(pattern, path)
            if found:
                return self._serve(method, found.group(1), found.group(2), query, body, store, what,
                                   list_kind, api_version, create, delete)
        return _k8s_status(404, "NotFound", f"{path} is not served here")

    def _serve(self, method, namespace, name, query, body, store, what, list_kind, api_version, create, delete):
        if name is None and method == "POST" and create is not None:
            if (namespace, body["metadata"]["name"]) in store:
                return _k8s_status(409, "AlreadyExists", f'{what} "{body["metadata"]["name"]}" already exists')
            self.created.append(copy.deepcopy(body))
            return 201, create(namespace, body)
        if name is None and method == "GET":
            selector = query.get("labelSelector", "")
            items = [o for (ns, _), o in store.items() if ns == namespace and _selected(o, selector)]
            return 200, {"kind": list_kind, "apiVersion": api_version, "metadata": {}, "items": items}
        if (namespace, name) not in store:
            return _k8s_status(404, "NotFound", f'{what} "{name}" not found')
        if method == "GET":
            return 200, store[namespace, name]
        if method == "DELETE" and delete is not None:
            delete(namespace, name)
            return _deleted()
        return _k8s_status(405, "MethodNotAllowed", f"{method} {what}")

    def _metadata(self, namespace: str, metadata: dict) -> dict:
        return {**metadata, "namespace": namespace, "uid": f"uid-{next(self._ids)}", "creationTimestamp": _now()}

    # -- the Job controller ---------------------------------------------------------------------

    def _create_job(self, namespace: str, body: dict) -> dict:
        job = {**body, "metadata": self._metadata(namespace, body["metadata"]), "status": {}}
        key = (namespace, job["metadata"]["name"])
        self.jobs[key] = job
        self._index_state[key] = {"done": set(), "failed": set(), "failures": {}, "ignored": {}, "counted": 0}
        if job["spec"].get("completionMode") == "Indexed":
            for index in range(job["spec"]["completions"]):
                self._create_pod(job, index)
        return job

    def _create_pod(self, job: dict, index: int) -> None:
        name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
        state = self._index_state[namespace, name]
        template = copy.deepcopy(job["spec"]["template"])
        labels = {**template.get("metadata", {}).get("labels", {}), "job-name": name,
                  "batch.kubernetes.io/job-name": name, "controller-uid": job["metadata"]["uid"],
                  INDEX_KEY: str(index)}
        annotations = {**template.get("metadata", {}).get("annotations", {}), INDEX_KEY: str(index),
                       FAILURES_KEY: str(state["failures"].get(index, 0)),
                       IGNORED_KEY: str(state["ignored"].get(index, 0))}
        spec = template["spec"]
        spec["hostname"] = f"{name}-{index}"
        for container in spec["containers"]:
            container["env"] = [*container.get("env", []), {"name": "JOB_COMPLETION_INDEX", "valueFrom": {
                "fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_KEY}']"}}}]
        pod_name = f"{name}-{index}-{next(self._ids):05d}"
        now = _now()
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {**self._metadata(namespace, {"name": pod_name}), "labels": labels,
                            "annotations": annotations,
                            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                                 "uid": job["metadata"]["uid"], "controller": True}]},
               "spec": spec, "status": {"phase": "Pending"}}
        self.pods[namespace, pod_name] = pod
        if self.run_pod is None:
            return  # never scheduled: statuses are the test's to script
        pod["status"] = {"phase": "Running", "startTime": now, "containerStatuses": [
            {"name": c["name"], "image": c["image"], "imageID": "", "ready": True, "restartCount": 0,
             "state": {"running": {"startedAt": now}}} for c in spec["containers"]]}
        threading.Thread(target=self._run, args=(namespace, pod_name, copy.deepcopy(pod)), daemon=True).start()

    def _run(self, namespace: str, pod_name: str, pod: dict) -> None:
        try:
            code = self.run_pod(pod)
        except Exception:  # a broken test hook must be seen, not swallowed by the thread
            traceback.print_exc()
            code = 1
        with self.lock:
            live = self.pods.get((namespace, pod_name))
            if live is not None and live["status"]["phase"] == "Running":  # not deleted meanwhile
                self._terminate(live, code)
                self._pod_finished(live)

    def _terminate(self, pod: dict, code: int) -> None:
        pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
        for status in pod["status"]["containerStatuses"]:
            started = status["state"]["running"]["startedAt"]
            status["ready"] = False
            status["state"] = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                              "startedAt": started, "finishedAt": _now()}}

    def _pod_finished(self, pod: dict) -> None:
        """The Job controller's look at a pod that ended."""
        namespace = pod["metadata"]["namespace"]
        key = (namespace, pod["metadata"]["labels"]["job-name"])
        job, state = self.jobs.get(key), self._index_state.get(key)
        if job is None or _finished(job):
            return
        spec, index = job["spec"], int(pod["metadata"]["labels"][INDEX_KEY])
        if pod["status"]["phase"] == "Succeeded":
            state["done"].add(index)
        else:
            action = failure_action(job, pod)
            if action == "FailJob":
                return self._fail_job(job, "PodFailurePolicy", f"pod {pod['metadata']['name']} matched a FailJob rule")
            if action == "Ignore":
                state["ignored"][index] = state["ignored"].get(index, 0) + 1
            elif action == "FailIndex":
                state["failed"].add(index)
            else:  # Count
                state["counted"] += 1
                state["failures"][index] = state["failures"].get(index, 0) + 1
                if spec.get("backoffLimitPerIndex") is not None:
                    if state["failures"][index] > spec["backoffLimitPerIndex"]:
                        state["failed"].add(index)
                elif state["counted"] > spec.get("backoffLimit", DEFAULT_BACKOFF_LIMIT):
                    return self._fail_job(job, "BackoffLimitExceeded", "Job has reached the specified backoff limit")
            if index not in state["done"] | state["failed"]:
                self._create_pod(job, index)
        self._write_job_status(job)

    def _write_job_status(self, job: dict) -> None:
        key = (job["metadata"]["namespace"], job["metadata"]["name"])
        state, spec = self._index_state[key], job["spec"]
        status = job["status"]
        status.update(succeeded=len(state["done"]), completedIndexes=_index_list(state["done"]))
        if state["counted"]:
            status["failed"] = state["counted"]
        if state["failed"]:
            status["failedIndexes"] = _index_list(state["failed"])
        if len(state["failed"]) > spec.get("maxFailedIndexes", spec["completions"]):
            return self._fail_job(job, "MaxFailedIndexesExceeded", "Job has exceeded maxFailedIndexes")
        if len(state["done"] | state["failed"]) == spec["completions"]:
            if state["failed"]:
                return self._fail_job(job, "FailedIndexes", "Job has failed indexes")
            status.update(conditions=[_condition("Complete", "CompletionsReached")], completionTime=_now())
            self._job_ended(job)

    def _fail_job(self, job: dict, reason: str, message: str) -> None:
        """The Job failed: its running pods are deleted, its owner told."""
        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        for key, pod in list(self.pods.items()):
            if pod["metadata"]["labels"].get("job-name") == name and key[0] == namespace \
                    and pod["status"]["phase"] not in ("Succeeded", "Failed"):
                del self.pods[key]
        job["status"]["conditions"] = [_condition("Failed", reason, message)]
        self._job_ended(job)

    def _job_ended(self, job: dict) -> None:
        owner = next((o for o in job["metadata"].get("ownerReferences", []) if o["kind"] == "JobSet"), None)
        if owner is not None:
            self._sync_jobset(job["metadata"]["namespace"], owner["name"])

    def _delete_job(self, namespace: str, name: str) -> None:
        """Cascading: the Job's pods go with it."""
        del self.jobs[namespace, name]
        self._index_state.pop((namespace, name), None)
        for key, pod in list(self.pods.items()):
            if key[0] == namespace and pod["metadata"]["labels"].get("job-name") == name:
                del self.pods[key]

    # -- the JobSet controller ------------------------------------------------------------------

    def _create_jobset(self, namespace: str, body: dict) -> dict:
        jobset = {**body, "metadata": self._metadata(namespace, body["metadata"]),
                  "status": {"restarts": 0, "restartsCountTowardsMax": 0}}
        self.jobsets[namespace, jobset["metadata"]["name"]] = jobset
        self._create_children(jobset)
        return jobset

    def _create_children(self, jobset: dict) -> None:
        meta, spec = jobset["metadata"], jobset["spec"]
        network = spec.get("network") or {}
        for replicated in spec["replicatedJobs"]:
            for i in range(replicated.get("replicas", 1)):
                job = copy.deepcopy(replicated["template"])
                labels = {JOBSET_PREFIX + "jobset-name": meta["name"], JOBSET_PREFIX + "jobset-uid": meta["uid"],
                          JOBSET_PREFIX + "replicatedjob-name": replicated["name"], JOBSET_PREFIX + "job-index": str(i),
                          JOBSET_PREFIX + "restart-attempt": str(jobset["status"]["restarts"])}
                job["metadata"] = {"name": f"{meta['name']}-{replicated['name']}-{i}",
                                   "labels": {**job.get("metadata", {}).get("labels", {}), **labels},
                                   "ownerReferences": [{"apiVersion": jobset["apiVersion"], "kind": "JobSet",
                                                        "name": meta["name"], "uid": meta["uid"], "controller": True}]}
                pod_template = job["spec"]["template"]
                pod_template.setdefault("metadata", {})["labels"] = {**pod_template["metadata"].get("labels", {}),
                                                                     **labels}
                if network.get("enableDNSHostnames"):
                    pod_template["spec"]["subdomain"] = network.get("subdomain") or meta["name"]
                self._create_job(meta["namespace"], job)

    def _children(self, jobset: dict) -> list[dict]:
        uid = jobset["metadata"]["uid"]
        return [j for j in self.jobs.values() if j["metadata"]["labels"].get(JOBSET_PREFIX + "jobset-uid") == uid]

    def _sync_jobset(self, namespace: str, name: str) -> None:
        jobset = self.jobsets.get((namespace, name))
        if jobset is None or jobset["status"].get("terminalState"):
            return
        children = self._children(jobset)
        failed = [j for j in children if _condition_of(j, "Failed")]
        if failed:
            reason = _condition_of(failed[0], "Failed")["reason"]
            policy = jobset["spec"].get("failurePolicy") or {}
            rule = next((r for r in policy.get("rules", [])
                         if not r.get("onJobFailureReasons") or reason in r["onJobFailureReasons"]), None)
            action = rule["action"] if rule else "RestartJobSet"
            status = jobset["status"]
            if action == "FailJobSet":
                return self._end_jobset(jobset, "Failed", "FailedJobs")
            if action == "RestartJobSet":
                if status["restartsCountTowardsMax"] >= policy.get("maxRestarts", 0):
                    return self._end_jobset(jobset, "Failed", "ReachedMaxRestarts")
                status["restartsCountTowardsMax"] += 1
            status["restarts"] += 1
            for job in children:  # Recreate: the old Jobs and their pods go, then new ones come
                self._delete_job(namespace, job["metadata"]["name"])
            return self._create_children(jobset)
        if children and all(_condition_of(j, "Complete") for j in children):
            self._end_jobset(jobset, "Completed", "AllJobsCompleted")

    def _end_jobset(self, jobset: dict, state: str, reason: str) -> None:
        jobset["status"].update(terminalState=state, conditions=[_condition(state, reason)])

    def _delete_jobset(self, namespace: str, name: str) -> None:
        jobset = self.jobsets.pop((namespace, name))
        for job in self._children(jobset):
            self._delete_job(namespace, job["metadata"]["name"])


def _finished(job: dict) -> bool:
    return any(_condition_of(job, kind) for kind in ("Complete", "Failed"))


def _condition_of(obj: dict, kind: str) -> dict | None:
    return next((c for c in (obj.get("status") or {}).get("conditions", [])
                 if c["type"] == kind and c["status"] == "True"), None)
