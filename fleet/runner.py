"""The ``runners.tpu_host`` command each machine runs: the fleet's own flags, then the user's.

The user's runner flags are checked here, with the runner's own parser, before anything is
launched: a typo must fail once on this computer, not on 32 hosts.
"""

from __future__ import annotations

import sys

from common.cli import UserError, add_config_flags, config_from_namespace, make_parser
from fleet.config import CLOUD_SCRATCH_DIR, FLEET_OWNED, FleetConfig
from host.config import HostConfig


def flag_names(words: tuple[str, ...]) -> list[str]:
    """The flags named in command-line ``words``: ``--a 1 --b=2`` -> ``["a", "b"]``."""
    return [w[2:].split("=", 1)[0] for w in words if w.startswith("--")]


def _gcs_parts(url: str) -> tuple[str, str]:
    bucket, _, prefix = url[len("gs://"):].partition("/")
    return bucket, prefix.strip("/")


def fleet_flags(config: FleetConfig, machine: int | str) -> list[str]:
    """The flags the fleet sets: the machine, the stream, where the output goes."""
    flags = ["--machine_id", str(machine), "--streams_dir", config.streams_dir]
    if not config.cloud:
        return flags + ["--output_dir", config.output]
    bucket, prefix = _gcs_parts(config.output)
    machine_prefix = f"{prefix}/machine_{{machine_id:03d}}" if prefix else "machine_{machine_id:03d}"
    flags += ["--output_dir", CLOUD_SCRATCH_DIR, "--upload_to_gcs", "--gcs_bucket", bucket,
              "--gcs_prefix", machine_prefix, "--delete_local_after_upload"]
    if "compilation_cache_dir" not in flag_names(config.runner):
        # One cache for the whole fleet: every host compiles the same shapes, and a recreated
        # host finds them there instead of on a disk that went with its VM.
        flags += ["--compilation_cache_dir", f"{config.output.rstrip('/')}/_fleet/xla_cache"]
    return flags


def runner_argv(config: FleetConfig, machine: int | str) -> list[str]:
    """Flags of ``runners.tpu_host`` for ``machine`` (a number, or ``auto`` on cloud hosts)."""
    return fleet_flags(config, machine) + list(config.runner)


# Kubernetes expands $(VAR) in a container's command from its env, where the Job controller puts
# JOB_COMPLETION_INDEX: in a slice's Indexed Job, the host's index.
HOST_INDEX = "$(JOB_COMPLETION_INDEX)"


def slice_flags(coordinator_host: str, port: int, hosts: int) -> list[str]:
    """The flags that make the ``hosts`` pods of one machine one JAX runtime (every pod has the
    same command): process 0's stable address, the process count, this pod's index."""
    return ["--coordinator_address", f"{coordinator_host}:{port}", "--num_processes", str(hosts),
            "--process_id", HOST_INDEX]


def local_command(config: FleetConfig, machine: int) -> list[str]:
    return [sys.executable, "-m", "runners.tpu_host", *runner_argv(config, machine)]


def check_runner_flags(config: FleetConfig) -> HostConfig:
    """The runner's configuration for machine 0, validated as the runner would; one-line errors
    that say they are about the runner flags."""
    for name in flag_names(config.runner):
        if name in FLEET_OWNED:
            raise UserError(f"runner flag --{name} is set by the fleet (from --streams_dir, --output "
                            "and the machine number); remove it")
    parser = make_parser("runners.tpu_host", "")
    add_config_flags(parser, HostConfig)
    try:
        host = config_from_namespace(HostConfig, parser.parse_args(runner_argv(config, 0)))
        host.validate()
    except UserError as e:
        raise UserError(f"runner flags: {e}") from None
    return host
