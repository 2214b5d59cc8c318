"""A fleet's description: one dataclass, filled from ``--config fleet.yaml`` (or .json) and flags.

Flags override the file; the file overrides the defaults. The file's keys are the flag names;
``runner:`` holds ``runners.tpu_host`` flags (passed through unchanged, after the fleet's own),
and the sections ``local:``, ``tpu_vm:``, ``gke:`` and ``dataflow:`` may group their backend's settings:

    name: qwen7b-fineweb
    num_machines: 32
    streams_dir: gs://B/streams
    output: gs://B/activations
    backend: tpu-vm
    runner: {model_path: Qwen/Qwen2.5-7B, layers_to_extract: [14, 21], batch_size: 8}
    tpu_vm: {project: P, zone: us-central2-b, accelerator_type: v4-8, provisioning: spot}

Runner flags given on the command line come after ``--``: ``runners.fleet launch --config
fleet.yaml -- --batch_size 16``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from typing import Any

from common.cli import UserError, add_config_flags, config_from_namespace, flag
from common.files import join
from common.settings_file import config_path, read_required, read_settings, setting_words

BACKENDS = ("local", "tpu-vm", "gke", "dataflow")
PROVISIONING = ("spot", "reserved", "on-demand")
TPU_TYPES = ("v5e", "v5p", "v6e")  # the TPUs of Dataflow's TPU workers
SECTIONS = ("local", "tpu_vm", "gke", "dataflow")
# The runner flags the fleet sets itself, per machine and backend.
FLEET_OWNED = ("machine_id", "streams_dir", "dataset_stream", "output_dir", "upload_to_gcs",
               "gcs_bucket", "gcs_prefix")
NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
CLOUD_SCRATCH_DIR = "/tmp/activation-extraction"  # on a cloud host; everything is uploaded


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    # What runs, and where its input and output are.
    name: str | None = flag(None, "fleet name (lowercase letters, digits, hyphens): TPU nodes are "
                            "{name}-NNN labelled fleet={name}; the Kubernetes Job is {name} (multi-host "
                            "slices: JobSets {name}-NNN)")
    num_machines: int | None = flag(None, "machines; must equal the prepare manifest's num_machines "
                                    "(default: the manifest's)")
    streams_dir: str | None = flag(None, "the prepare pipeline's output: stream_NNN.jsonl + manifest.json")
    output: str | None = flag(None, "where the machines write machine_NNN/: gs://BUCKET/PREFIX for "
                              "tpu-vm, gke and dataflow, a local directory for local")
    backend: str = flag("local", "where the machines run", choices=BACKENDS)
    runner: tuple[str, ...] = flag((), "runners.tpu_host flags, passed through unchanged (on the "
                                   "command line: after --)", parse=shlex.split)
    # local
    max_parallel: int = flag(4, "local: runner processes at once (the others wait for a free slot)")
    # tpu-vm
    project: str | None = flag(None, "tpu-vm, dataflow: Google Cloud project")
    zone: str | None = flag(None, "tpu-vm: zone of the TPUs, e.g. us-central2-b")
    accelerator_type: str = flag("v4-8", "tpu-vm: TPU type of each machine (one host each)")
    runtime_version: str = flag("tpu-ubuntu2204-base", "tpu-vm: TPU VM software version")
    provisioning: str = flag("spot", "tpu-vm: spot | reserved | on-demand", choices=PROVISIONING)
    stagger_s: float = flag(10.0, "tpu-vm: seconds between two creations")
    tpu_api_endpoint: str | None = flag(None, "tpu-vm: Cloud TPU API endpoint (default: Google's)")
    jax_requirement: str = flag("jax[tpu]", "tpu-vm: what the startup script pip-installs for the TPU")
    # gke
    image: str | None = flag(None, "gke, dataflow: container image with this project installed (jax[tpu] "
                             "included; dataflow: built on a Beam SDK image, entrypoint /opt/apache/beam/boot)")
    namespace: str = flag("default", "gke: namespace of the Job (or JobSets)")
    gke_accelerator: str = flag("tpu-v5-lite-podslice", "gke: node selector "
                                "cloud.google.com/gke-tpu-accelerator")
    gke_topology: str = flag("2x4", "gke: node selector cloud.google.com/gke-tpu-topology; more than "
                             "one host's chips (e.g. 4x4) make each machine a multi-host slice, a JobSet")
    tpu_chips: int | None = flag(None, "gke: google.com/tpu chips per host (pod); default: the "
                                 "accelerator and topology's (all chips of a single-host topology, 4 on "
                                 "a multi-host one); 4 on a v5e/v6e 2x4 picks its 2-host machine type")
    gke_coordinator_port: int = flag(8476, "gke: port of the JAX coordinator on host 0 of a multi-host "
                                     "slice")
    gke_spot: bool = flag(True, "gke: schedule on spot nodes (cloud.google.com/gke-spot)")
    grace_period_s: int = flag(120, "gke: termination grace period: the runner's SIGTERM flush (one "
                               "shard stored and uploaded) must fit in it")
    # dataflow
    region: str | None = flag(None, "dataflow: region of the job, e.g. us-central1")
    tpu_type: str = flag("v5e", "dataflow: TPU of each worker", choices=TPU_TYPES)
    topology: str | None = flag(None, "dataflow: TPU topology of each worker, single-host only (v5e, v6e: "
                                "1x1, 2x2, 2x4; v5p: 2x2x1; default: the largest)")
    reservation: str | None = flag(None, "dataflow: the TPU reservation the workers consume (NAME, or "
                                   "projects/P/reservations/NAME); needs --worker_zone, its zone")
    worker_zone: str | None = flag(None, "dataflow: zone of the workers (default: Dataflow picks one in --region)")
    max_workers: int | None = flag(None, "dataflow: most TPU workers at once (default: one per machine "
                                   "of the job)")
    temp_location: str | None = flag(None, "dataflow: gs:// folder for the job's temporary and staged "
                                     "files (default {output}/_fleet/dataflow_tmp)")
    dataflow_endpoint: str | None = flag(None, "dataflow: Dataflow API endpoint (default: Google's)")
    beam_options: tuple[str, ...] = flag((), "dataflow: more Beam pipeline options for the job, passed "
                                         "through, e.g. '--service_account_email SA --disk_size_gb 200'",
                                         parse=shlex.split)
    # supervise
    interval: float = flag(30.0, "seconds between two looks at the fleet (status --watch, supervise)")
    stall_timeout: float = flag(900.0, "supervise: restart a machine STALLED for longer than this (s)")
    max_restarts: int = flag(3, "supervise: restarts of a machine in a row without progress "
                             "before giving up on it (gke: the Job's backoffLimitPerIndex, a slice "
                             "JobSet's maxRestarts; preemptions count for neither)")
    keep_completed: bool = flag(False, "tpu-vm: keep a machine's queued resource after it completed "
                                "(default: supervise deletes it once its completion is stored)")
    # cost
    price_per_hour: float | None = flag(None, "your price of one machine for one hour (any currency): "
                                        "status then shows the cost so far and at completion")

    @property
    def cloud(self) -> bool:
        return self.backend != "local"

    def machine_dir(self, machine: int) -> str:
        return join(self.output, f"machine_{machine:03d}")

    def fleet_dir(self) -> str:
        """Where the fleet keeps its own files (the launch record, the wheel, local pids)."""
        return join(self.output, "_fleet")

    def check(self) -> None:
        """Errors that need no I/O."""
        if not self.name or not NAME.fullmatch(self.name):
            raise UserError(f"--name must be 1-40 lowercase letters, digits and hyphens, starting with "
                            f"a letter, got {self.name!r}")
        if not self.output:
            raise UserError("pass --output (or set output: in --config)")
        if self.cloud:
            for field in ("streams_dir", "output"):
                if getattr(self, field) and not getattr(self, field).startswith("gs://"):
                    raise UserError(f"--backend {self.backend} needs a gs:// --{field} (the machines "
                                    f"cannot see this computer's files), got {getattr(self, field)!r}")
        if self.num_machines is not None and self.num_machines < 1:
            raise UserError(f"--num_machines must be at least 1, got {self.num_machines}")
        for field in ("max_parallel", "tpu_chips", "grace_period_s", "max_workers"):
            if getattr(self, field) is not None and getattr(self, field) < 1:
                raise UserError(f"--{field} must be at least 1")
        if not 1 <= self.gke_coordinator_port <= 65535:
            raise UserError(f"--gke_coordinator_port must be 1..65535, got {self.gke_coordinator_port}")
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise UserError(f"--price_per_hour must be >= 0, got {self.price_per_hour}")
        if self.max_restarts < 0 or self.interval <= 0 or self.stall_timeout <= 0 or self.stagger_s < 0:
            raise UserError("--max_restarts and --stagger_s must be >= 0, --interval and --stall_timeout > 0")


def _runner_words(runner: Any) -> tuple[str, ...]:
    """A ``runner:`` mapping of the config file as flags: ``{layers_to_extract: [6, 12]}`` ->
    ``--layers_to_extract 6,12``; ``true`` -> ``--name``, ``false`` -> ``--no_name``."""
    if isinstance(runner, str):
        return tuple(shlex.split(runner))
    if isinstance(runner, list):
        return tuple(str(w) for w in runner)
    if not isinstance(runner, dict):
        raise UserError(f"runner: in --config must map runner flags to values, got {type(runner).__name__}")
    words: list[str] = []
    for key, value in runner.items():
        key = str(key).lstrip("-")
        if value is True:
            words.append(f"--{key}")
        elif value is False:
            words.append(f"--no_{key}")
        elif isinstance(value, (list, tuple)):
            words += [f"--{key}", ",".join(str(v) for v in value)]
        elif value is not None:
            words += [f"--{key}", str(value)]
    return tuple(words)


def read_config_file(path: str) -> dict[str, Any]:
    """The fields a YAML or JSON fleet file sets, flattened (sections merged), by flag name."""
    flat = read_settings(path, FleetConfig, SECTIONS)
    if "runner" in flat:
        flat["runner"] = _runner_words(flat["runner"])
    return flat


def add_fleet_flags(parser) -> None:
    parser.add_argument("--config", help="YAML or JSON file of these settings (flags override it)")
    add_config_flags(parser, FleetConfig)


def fleet_config(parser, argv: list[str]):
    """(FleetConfig, the rest of the parsed flags) from ``argv``: ``--config`` first, then flags;
    runner flags after ``--`` are appended to the file's."""
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], tuple(argv[cut + 1:])
    else:
        extra = ()
    path = config_path(parser, argv)
    if path:
        settings = read_config_file(path)
        parser.set_defaults(runner=settings.pop("runner", ()))
        # The file's settings go through the parser as flags (so choices and types are checked),
        # before the command line's, which therefore win.
        argv = setting_words(settings, FleetConfig, path) + argv
    namespace = parser.parse_args(argv)
    config = config_from_namespace(FleetConfig, namespace)
    return dataclasses.replace(config, runner=config.runner + extra), namespace


def read_manifest(streams_dir: str) -> dict[str, Any]:
    """The prepare pipeline's ``manifest.json``."""
    path = join(streams_dir, "manifest.json")
    data = read_required(path, path, f"no manifest.json in --streams_dir {streams_dir!r}: run "
                          "pipeline.prepare first")
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None


def resolve(config: FleetConfig) -> tuple[FleetConfig, dict[str, Any]]:
    """Checks the config against the prepare manifest; fills ``num_machines`` from it."""
    config.check()
    if not config.streams_dir:
        raise UserError("pass --streams_dir (or set streams_dir: in --config)")
    manifest = read_manifest(config.streams_dir)
    expected = manifest["num_machines"]
    if config.num_machines is None:
        config = dataclasses.replace(config, num_machines=expected)
    elif config.num_machines != expected:
        raise UserError(f"--num_machines {config.num_machines} does not match the prepare manifest's "
                        f"num_machines {expected} ({join(config.streams_dir, 'manifest.json')})")
    return config, manifest


def manifest_samples(manifest: dict[str, Any]) -> dict[int, int]:
    """Stream records per machine (machines with none are absent from the manifest's list)."""
    counts = {m["machine"]: m["samples"] for m in manifest["machines"]}
    return {i: counts.get(i, 0) for i in range(manifest["num_machines"])}
