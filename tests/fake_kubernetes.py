"""A local server of the Kubernetes API the gke backend drives (batch/v1 Jobs), so the tests run
the real ``kubernetes`` client against the far side of the wire. It keeps what it was sent, for
the tests to check, and can be scripted (a Job's status)."""

from __future__ import annotations

import json
import re
from typing import Any

from tests.cloud_fakes import Server, _now


def _k8s_status(code: int, reason: str, message: str) -> tuple[int, Any]:
    return code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": message, "reason": reason, "code": code}


class FakeKubernetesApi(Server):
    """batch/v1 Jobs: create, read, list (``labelSelector=k=v``) and delete in a namespace."""

    def __init__(self):
        super().__init__()
        self.jobs: dict[tuple[str, str], dict] = {}

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

    def handle(self, method, path, query, body):
        found = re.fullmatch(r"/apis/batch/v1/namespaces/([^/]+)/jobs(?:/([^/]+))?", path)
        if not found:
            return _k8s_status(404, "NotFound", f"{path} is not served here")
        namespace, name = found.groups()
        if name is None and method == "POST":
            key = (namespace, body["metadata"]["name"])
            if key in self.jobs:
                return _k8s_status(409, "AlreadyExists", f'jobs.batch "{key[1]}" already exists')
            body["metadata"].update(namespace=namespace, uid=f"uid-{len(self.jobs) + 1}", creationTimestamp=_now())
            self.jobs[key] = {**body, "status": {}}
            return 201, self.jobs[key]
        if name is None and method == "GET":
            selector = dict(p.split("=", 1) for p in query.get("labelSelector", "").split(",") if p)
            items = [j for (ns, _), j in self.jobs.items() if ns == namespace and
                     all(j["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())]
            return 200, {"kind": "JobList", "apiVersion": "batch/v1", "metadata": {}, "items": items}
        if (namespace, name) not in self.jobs:
            return _k8s_status(404, "NotFound", f'jobs.batch "{name}" not found')
        if method == "GET":
            return 200, self.jobs[namespace, name]
        if method == "DELETE":
            del self.jobs[namespace, name]
            return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
        return _k8s_status(405, "MethodNotAllowed", f"{method} {path}")
