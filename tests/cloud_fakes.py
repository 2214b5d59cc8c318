"""Local servers of the two cloud APIs the fleet drives, so the tests run the real client
libraries (``google-cloud-tpu`` over REST, ``kubernetes``) against the far side of the wire.

``FakeTpuApi`` serves the Cloud TPU v2 queued-resource calls with long-running operations
(``tests/fake_kubernetes.py`` serves Kubernetes on the same ``Server``). Both keep what they were
sent, for the tests to check, and can be scripted (a preemption, a Job's status).
"""

from __future__ import annotations

import datetime
import http.server
import itertools
import json
import re
import threading
import traceback
import urllib.parse
from typing import Any, Callable


def _now(timespec: str = "seconds") -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec=timespec).replace("+00:00", "Z")


def _seconds(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class Server:
    """A threaded HTTP server on a free loopback port; subclasses answer ``handle(method, path,
    query, body) -> (status, document)``."""

    def __init__(self):
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _serve(self):
                url = urllib.parse.urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                query = dict(urllib.parse.parse_qsl(url.query))
                with outer.lock:
                    status, document = outer.handle(self.command, url.path, query, body)
                data = json.dumps(document).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _serve

            def log_message(self, *args):  # quiet: the tests read their own logs
                pass

        self.lock = threading.RLock()
        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._http.server_address[1]}"

    def handle(self, method: str, path: str, query: dict, body: Any) -> tuple[int, Any]:
        raise NotImplementedError

    def start(self):
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


def _google_error(code: int, status: str, message: str) -> tuple[int, Any]:
    return code, {"error": {"code": code, "message": message, "status": status}}


class FakeTpuApi(Server):
    """Cloud TPU v2: create / get / list / delete queued resources, get nodes and operations.

    A created queued resource is ACTIVE at once with its node READY; ``on_create(node_id)`` then
    "boots" the VM (called outside the request, on a thread). ``preempt(node_id)`` makes the node
    PREEMPTED and its queued resource SUSPENDED, as a spot preemption does. ``active`` keeps each
    node's billed interval: from its creation until it is preempted or deleted.
    """

    def __init__(self, on_create: Callable[[str], None] | None = None):
        super().__init__()
        self.on_create = on_create
        self.created: list[dict] = []       # request bodies, with "queuedResourceId" added
        self.deleted: list[str] = []        # queued-resource names
        self.active: list[dict] = []        # {"node_id", "start", "end"}: seconds since the epoch
        self._queued: dict[str, dict] = {}
        self._nodes: dict[str, dict] = {}
        self._operations: dict[str, dict] = {}
        self._ids = itertools.count(1)

    def queued_resources(self) -> dict[str, dict]:
        with self.lock:
            return dict(self._queued)

    def nodes(self) -> dict[str, dict]:
        with self.lock:
            return dict(self._nodes)

    def preempt(self, node_id: str) -> None:
        with self.lock:
            node = next(n for name, n in self._nodes.items() if name.endswith(f"/nodes/{node_id}"))
            node["state"] = "PREEMPTED"
            self._queued[node["queuedResource"]]["state"] = {"state": "SUSPENDED"}
            self._end(node_id)

    def _end(self, node_id: str) -> None:
        for interval in self.active:
            if interval["node_id"] == node_id and interval["end"] is None:
                interval["end"] = datetime.datetime.now(datetime.timezone.utc).timestamp()

    def _operation(self, location: str, response: dict) -> dict:
        name = f"{location}/operations/op-{next(self._ids)}"
        self._operations[name] = {"name": name, "done": True, "response": response}
        return {"name": name, "done": False}  # the client polls it once

    def handle(self, method, path, query, body):
        path = path.removeprefix("/v2/")
        location = re.fullmatch(r"(projects/[^/]+/locations/[^/]+)/.*", path)
        if method == "POST" and path.endswith("/queuedResources"):
            return self._create(path.rsplit("/", 1)[0], query["queuedResourceId"], body)
        if method == "GET" and path.endswith("/queuedResources"):
            prefix = path + "/"
            return 200, {"queuedResources": [q for n, q in self._queued.items() if n.startswith(prefix)]}
        if method == "GET" and path.endswith("/nodes"):
            prefix = path + "/"
            return 200, {"nodes": [n for name, n in self._nodes.items() if name.startswith(prefix)]}
        store = (self._queued if "/queuedResources/" in path else self._nodes if "/nodes/" in path
                 else self._operations if "/operations/" in path else None)
        if store is None or path not in store:
            return _google_error(404, "NOT_FOUND", f"{path} not found")
        if method == "GET":
            return 200, store[path]
        if method == "DELETE" and store is self._queued:
            queued = self._queued.pop(path)
            for spec in queued["tpu"]["nodeSpec"]:
                self._nodes.pop(f"{spec['parent']}/nodes/{spec['nodeId']}", None)
                self._end(spec["nodeId"])
            self.deleted.append(path)
            return 200, self._operation(location.group(1), {"@type": "type.googleapis.com/google.protobuf.Empty"})
        return _google_error(400, "INVALID_ARGUMENT", f"{method} {path} is not served here")

    def _create(self, location: str, queued_id: str, body: dict):
        name = f"{location}/queuedResources/{queued_id}"
        if name in self._queued:
            return _google_error(409, "ALREADY_EXISTS", f"{name} already exists")
        self.created.append({**body, "queuedResourceId": queued_id})
        queued = {**body, "name": name, "createTime": _now(), "state": {"state": "ACTIVE"}}
        self._queued[name] = queued
        specs = queued["tpu"]["nodeSpec"]
        for spec in specs:
            created = _now("microseconds")
            self._nodes[f"{spec['parent']}/nodes/{spec['nodeId']}"] = {
                **spec["node"], "name": f"{spec['parent']}/nodes/{spec['nodeId']}", "state": "READY",
                "createTime": created, "queuedResource": name}
            self.active.append({"node_id": spec["nodeId"], "start": _seconds(created), "end": None})
        if self.on_create:
            threading.Thread(target=self._boot, args=[s["nodeId"] for s in specs]).start()
        typed = {**queued, "@type": "type.googleapis.com/google.cloud.tpu.v2.QueuedResource"}
        return 200, self._operation(location, typed)

    def _boot(self, *node_ids: str) -> None:
        for node_id in node_ids:
            try:
                self.on_create(node_id)
            except Exception:  # a broken test hook must be seen, not swallowed by the thread
                traceback.print_exc()
