"""Machines as Cloud TPU VMs: one queued resource per machine, through ``google-cloud-tpu``.

One queued resource per machine, never one multislice request: a repaired slice restarts every
slice of its request, and machines must fail and come back alone. Node ``{name}-NNN`` carries
the label ``fleet={name}``, the metadata ``machine-id=N`` (read by ``--machine_id auto``) and a
startup script that installs this project's wheel (uploaded by ``launch`` to ``{output}/_fleet/``)
and ``jax[tpu]``, runs the runner, and copies its log to ``{output}/machine_NNN/logs/``. A spot
VM cannot be restarted, only deleted and recreated: the new VM runs the startup script again and
the runner resumes from the GCS checkpoint.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from common.cli import UserError
from common.extras import require
from fleet.backend import ABSENT, ALIVE, GONE, PENDING, Backend, Health, Incarnation
from fleet.runner import runner_argv

log = logging.getLogger("runners.fleet")
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPERATION_TIMEOUT_S = 600
# Queued-resource and node states that mean the machine will not come back by itself.
GONE_QUEUED = ("FAILED", "SUSPENDING", "SUSPENDED")
GONE_NODE = ("PREEMPTED", "TERMINATED", "STOPPED", "STOPPING")
PENDING_QUEUED = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING")

STARTUP_SCRIPT = """#!/bin/bash
# Written by runners.fleet launch for fleet {name}: install, run machine $MACHINE, keep its log on GCS.
set -uo pipefail
MACHINE=$(curl -sf -H 'Metadata-Flavor: Google' \\
  http://metadata.google.internal/computeMetadata/v1/instance/attributes/machine-id)
WORK=/opt/activation-extraction
LOG=$WORK/machine_$(printf %03d "$MACHINE")-$(hostname)-$(date -u +%Y%m%dT%H%M%SZ).log
LOG_URL={output}/machine_$(printf %03d "$MACHINE")/logs/$(basename "$LOG")
mkdir -p $WORK && cd $WORK
exec > >(tee -a "$LOG") 2>&1
gcloud storage cp {wheel_url} $WORK/
python3 -m pip install --quiet {jax} "$WORK/{wheel}"
python3 -m runners.tpu_host {runner_args} &
RUNNER=$!
trap 'kill -TERM $RUNNER' TERM  # a preemption notice reaches the runner: it stores a final shard
while kill -0 $RUNNER 2>/dev/null; do
  gcloud storage cp --quiet "$LOG" "$LOG_URL" || true
  sleep 60 & wait $!
done
wait $RUNNER; STATUS=$?
echo "runner exited with status $STATUS"
gcloud storage cp --quiet "$LOG" "$LOG_URL"
exit $STATUS
"""


def tpu_api():
    """``google.cloud.tpu_v2`` (the ``tpu-vm`` extra)."""
    return require("google.cloud.tpu_v2", "tpu-vm", "--backend tpu-vm")


def build_wheel(out_dir: str) -> str:
    """A wheel of this project (``setup.py``), without dependencies: the host resolves those."""
    before = set(glob.glob(os.path.join(out_dir, "*.whl")))
    # setuptools builds in the source tree (build/, *.egg-info): two launches at once must take turns
    with open(os.path.join(tempfile.gettempdir(), "activation-extraction-wheel.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                                 "--quiet", "--wheel-dir", out_dir, PROJECT_ROOT],
                                capture_output=True, text=True)
    made = sorted(set(glob.glob(os.path.join(out_dir, "*.whl"))) - before)
    if result.returncode != 0 or not made:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel written"]
        raise UserError(f"building the wheel of {PROJECT_ROOT} failed: {tail[0]}")
    return made[0]


class TpuVmBackend(Backend):
    release_completed = True  # a VM whose runner completed is billed until its queued resource goes

    def __init__(self, config):
        super().__init__(config)
        if not (config.project and config.zone):
            raise UserError("--backend tpu-vm needs --project and --zone")
        self.parent = f"projects/{config.project}/locations/{config.zone}"
        from importlib.metadata import version
        self.wheel_name = f"activation_extraction-{version('activation-extraction')}-py3-none-any.whl"
        self._client = None

    @property
    def client(self):
        """The Cloud TPU client (REST): Google's endpoint, or ``--tpu_api_endpoint``."""
        if self._client is None:
            from google.api_core.client_options import ClientOptions
            tpu_v2 = tpu_api()
            options = ClientOptions(api_endpoint=self.config.tpu_api_endpoint) if self.config.tpu_api_endpoint else None
            credentials = None
            if self.config.tpu_api_endpoint and self.config.tpu_api_endpoint.startswith("http://"):
                from google.auth.credentials import AnonymousCredentials
                credentials = AnonymousCredentials()  # a local endpoint (tests, a proxy) takes none
            self._client = tpu_v2.TpuClient(credentials=credentials, transport="rest", client_options=options)
        return self._client

    def node_id(self, machine: int) -> str:
        return f"{self.config.name}-{machine:03d}"

    def _qr_name(self, machine: int) -> str:
        return f"{self.parent}/queuedResources/{self.node_id(machine)}"

    def wheel_url(self) -> str:
        return f"{self.config.fleet_dir()}/{self.wheel_name}"

    def startup_script(self) -> str:
        return STARTUP_SCRIPT.format(name=self.config.name, output=self.config.output.rstrip("/"),
                                     wheel_url=self.wheel_url(), wheel=self.wheel_name,
                                     jax=shlex.quote(self.config.jax_requirement),
                                     runner_args=shlex.join(runner_argv(self.config, "auto")))

    def request(self, machine: int):
        """The ``QueuedResource`` of one machine."""
        tpu_v2 = tpu_api()
        c = self.config
        node = tpu_v2.Node(accelerator_type=c.accelerator_type, runtime_version=c.runtime_version,
                           labels={"fleet": c.name},
                           metadata={"machine-id": str(machine), "startup-script": self.startup_script()},
                           scheduling_config=tpu_v2.SchedulingConfig(reserved=c.provisioning == "reserved"))
        spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=self.parent, node_id=self.node_id(machine), node=node)
        queued = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))
        if c.provisioning == "spot":
            queued.spot = tpu_v2.QueuedResource.Spot()
        return queued

    @property
    def where(self) -> str:
        return f"queued resources labelled fleet={self.config.name} in {self.parent}"

    def plan(self, machines: Sequence[int]) -> str:
        tpu_v2 = tpu_api()
        lines = [f"# upload a wheel of {PROJECT_ROOT} to {self.wheel_url()}",
                 f"# then, {self.config.stagger_s:g} s apart, POST {self.parent}/queuedResources:"]
        for machine in machines:
            body = tpu_v2.QueuedResource.to_json(self.request(machine), indent=2)
            lines.append(f"# queuedResourceId={self.node_id(machine)}\n{body}")
        return "\n".join(lines)

    def prepare(self) -> None:
        from common.files import write_bytes
        with tempfile.TemporaryDirectory() as tmp:
            wheel = build_wheel(tmp)
            self.wheel_name = os.path.basename(wheel)
            with open(wheel, "rb") as f:
                write_bytes(self.wheel_url(), f.read())
        log.info("uploaded %s", self.wheel_url())

    def create(self, machines: Sequence[int]) -> list[int]:
        operations = []
        for n, machine in enumerate(machines):
            if n:
                time.sleep(self.config.stagger_s)  # "stagger starts": quotas and the bucket see a ramp
            operations.append(self.client.create_queued_resource(
                parent=self.parent, queued_resource_id=self.node_id(machine),
                queued_resource=self.request(machine)))
            log.info("machine %d: queued resource %s requested", machine, self.node_id(machine))
        for operation in operations:
            operation.result(timeout=OPERATION_TIMEOUT_S)
        return list(machines)

    def _fleet_resources(self) -> dict[int, object]:
        """This fleet's queued resources by machine: those whose node is labelled fleet={name}."""
        found = {}
        for queued in self.client.list_queued_resources(parent=self.parent):
            for spec in queued.tpu.node_spec:
                machine = self._machine(spec.node_id)
                if spec.node.labels.get("fleet") == self.config.name and machine is not None:
                    found[machine] = queued
        return found

    def existing(self) -> set[int]:
        return set(self._fleet_resources())

    def _machine(self, node_id: str) -> int | None:
        suffix = node_id.removeprefix(f"{self.config.name}-")
        return int(suffix) if suffix != node_id and suffix.isdigit() else None

    def incarnations(self) -> dict[int, list[Incarnation]]:
        """Each node of the fleet is one incarnation, from its creation time (TPU VMs are billed
        from then); a preempted or terminated one has ended (the API says when it was created,
        not when it ended: the ledger dates the end when it first sees it)."""
        tpu_v2 = tpu_api()
        found: dict[int, list[Incarnation]] = {}
        for node in self.client.list_nodes(parent=self.parent):
            machine = self._machine(node.name.rsplit("/", 1)[-1])
            if machine is None or node.labels.get("fleet") != self.config.name or node.create_time is None:
                continue  # not ours, or not created yet (no creation time: nothing billed)
            state = tpu_v2.Node.State(node.state).name
            created = node.create_time.timestamp()
            found.setdefault(machine, []).append(Incarnation(f"{node.name}@{created:.6f}", created,
                                                             active=state not in GONE_NODE))
        return found

    def health(self, machine: int) -> Health:
        from google.api_core import exceptions as gexc
        tpu_v2 = tpu_api()
        try:
            queued = self.client.get_queued_resource(name=self._qr_name(machine))
        except gexc.NotFound:
            return Health(ABSENT)
        state = tpu_v2.QueuedResourceState.State(queued.state.state).name
        if state in GONE_QUEUED:
            return Health(GONE, f"queued resource {state}")
        if state != "ACTIVE":
            return Health(PENDING, f"queued resource {state}")
        try:
            node = self.client.get_node(name=f"{self.parent}/nodes/{self.node_id(machine)}")
        except gexc.NotFound:
            return Health(GONE, "queued resource ACTIVE without its node")
        node_state = tpu_v2.Node.State(node.state).name
        if node_state in GONE_NODE:
            return Health(GONE, f"node {node_state}")
        return Health(ALIVE, f"node {node_state}")

    def delete(self, machines: Sequence[int]) -> None:
        from google.api_core import exceptions as gexc
        tpu_v2 = tpu_api()
        operations = []
        for machine in machines:
            try:  # force: the node goes with its queued resource
                operations.append(self.client.delete_queued_resource(request=tpu_v2.DeleteQueuedResourceRequest(
                    name=self._qr_name(machine), force=True)))
            except gexc.NotFound:
                continue
            log.debug("machine %d: queued resource %s deleted", machine, self.node_id(machine))
        for operation in operations:
            operation.result(timeout=OPERATION_TIMEOUT_S)
