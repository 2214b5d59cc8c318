"""The ``status.json`` of a machine made of several processes: every process's health in one file.

Each process keeps its own ``process_PP/status.json`` and publishes each document it writes to
the distributed runtime's key-value store; process 0 combines the newest of all into the
machine's ``status.json``, which the fleet tools read as they read a one-process machine's:

  * ``state``: the first of failed, stopped, starting, loading, compiling, running, completed
    that any process is in (completed only when all are);
  * ``samples_done``: the smallest (stream records every process has passed); tokens, shards,
    truncated and skipped records: sums; rates: sums;
  * ``num_processes`` and ``processes``: each process's identity, state, counters and heartbeat.

When a process dies, the runtime ends the others; the survivors' watchdogs (``host/watchdog.py``)
then write ``failed`` here and in their own files.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Sequence

from common.states import COMPILING, COMPLETED, FAILED, LOADING, RUNNING, STARTING, STOPPED
from common.files import write_atomically
from host.status import STATUS_FILE, utc_now
from host.storage import GcsStore

log = logging.getLogger("runners.tpu_host")
STATE_ORDER = (FAILED, STOPPED, STARTING, LOADING, COMPILING, RUNNING, COMPLETED)
KEY_PREFIX = "activation-extraction/status/"
FINAL_KEY = "activation-extraction/final/{}"
FINAL_WAIT_S = 120  # for the other processes' last documents, at the end
SUMMED = ("tokens_done", "shards", "truncated", "skipped")
PER_PROCESS = ("process_id", "hostname", "pid", "state", "updated_at", "error", "samples_done",
               "tokens_done", "tokens_per_s", "shards", "host_rss_gb", "device_count")


def combined(documents: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The machine's document from its processes' (process 0's first)."""
    first = documents[0]
    states = {d["state"] for d in documents}
    errors = [f"process {d['process_id']}: {d['error']}" for d in documents if d.get("error")]
    rates = [d.get("tokens_per_s") or {} for d in documents]
    return {**first, "state": next(s for s in STATE_ORDER if s in states),
            "error": "; ".join(errors) or None, "updated_at": utc_now(),
            "samples_done": min(d.get("samples_done") or 0 for d in documents),
            **{k: sum(d.get(k) or 0 for d in documents) for k in SUMMED},
            "tokens_per_s": {k: round(sum(r.get(k) or 0.0 for r in rates), 1)
                             for k in ("last_minute", "since_start")},
            "device_count": sum(d.get("device_count") or 0 for d in documents),
            "num_processes": first["num_processes"],
            "processes": [{k: d.get(k) for k in PER_PROCESS} for d in documents]}


class MachineStatus:
    """Publishes this process's status documents; process 0 also writes the machine's."""

    def __init__(self, machine_dir: str, process_id: int, num_processes: int, store: GcsStore | None):
        self.path = os.path.join(machine_dir, STATUS_FILE)
        self.process_id = process_id
        self.num_processes = num_processes
        self.store = store  # the machine's prefix (not the process's)

    def publish(self, document: dict[str, Any]) -> None:
        """Called with every document this process writes (from its heartbeat thread). A failure
        is only logged: the process's own file is written already, and the next beat retries."""
        try:
            self._publish(document)
        except Exception as e:
            log.warning("publishing the status to the machine failed: %s", str(e).splitlines()[0])

    def _publish(self, document: dict[str, Any]) -> None:
        from jax._src import distributed  # the runtime's key-value store (as multihost_utils uses it)
        client = distributed.global_state.client
        if client is None:
            return
        text = json.dumps(document)
        client.key_value_set(f"{KEY_PREFIX}{self.process_id}", text, allow_overwrite=True)
        final = document["state"] in (COMPLETED, STOPPED, FAILED)
        if final and self.process_id != 0:
            client.key_value_set(FINAL_KEY.format(self.process_id), text, allow_overwrite=True)
        if self.process_id == 0:
            found = {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in client.key_value_dir_get(KEY_PREFIX)}
            if final:  # the machine's last word waits for every process's last one
                for p in range(1, self.num_processes):
                    found[p] = json.loads(client.blocking_key_value_get(FINAL_KEY.format(p), FINAL_WAIT_S * 1000))
            found[0] = document
            self.write(combined([found[p] for p in sorted(found)]))

    def write(self, document: dict[str, Any]) -> None:
        data = (json.dumps(document, indent=2) + "\n").encode()
        write_atomically(self.path, data)
        if self.store is not None:
            try:
                self.store.upload(STATUS_FILE, data)
            except Exception as e:  # the next beat tries again; the run goes on
                log.warning("machine status.json upload failed: %s", str(e).splitlines()[0])


def mark_failed(path: str, error: str, store: GcsStore | None) -> None:
    """Ends the status document at ``path`` (and its uploaded copy) as failed with ``error``: for
    a process that can no longer write its own (the runtime killed it)."""
    try:
        with open(path) as f:
            document = json.load(f)
    except (OSError, ValueError):
        document = {"history": []}
    now = utc_now()
    document.update(state=FAILED, error=error, updated_at=now)
    document["history"] = document.get("history", []) + [{"state": FAILED, "at": now}]
    data = (json.dumps(document, indent=2) + "\n").encode()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_atomically(path, data)
    if store is not None:
        try:
            store.upload(STATUS_FILE, data)
        except Exception as e:
            log.warning("status.json upload failed: %s", str(e).splitlines()[0])
