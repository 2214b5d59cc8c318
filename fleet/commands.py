"""The five steps of a fleet, each written once against ``fleet.backend.Backend``:
launch, status, supervise, merge, teardown. Each returns the process's exit code."""

from __future__ import annotations

import json
import logging
import sys
import time

from common.cli import UserError
from common.extras import require
from common.files import join, read_optional, write_bytes
from fleet.backend import Backend, make_backend
from fleet.config import FleetConfig, resolve
from fleet.machines import ALL_COMPLETED, exit_code, fleet_views, read_fleet
from fleet.merge import merge
from fleet.report import plain_table, rich_table, write_chart
from fleet.runner import check_runner_flags
from fleet.supervise import Supervisor
from host.states import COMPLETED
from host.status import utc_now

log = logging.getLogger("runners.fleet")
RECORD_FILE = "fleet.json"


def check_output(config: FleetConfig) -> None:
    """A gs:// output's bucket must exist (the hosts would fail on it one by one)."""
    if not config.output.startswith("gs://"):
        return
    from common.files import gcs_client
    bucket = config.output[len("gs://"):].split("/", 1)[0]
    try:
        exists = gcs_client().bucket(bucket).exists()
    except Exception as e:
        raise UserError(f"cannot reach GCS bucket {bucket!r}: {str(e).splitlines()[0]}") from None
    if not exists:
        raise UserError(f"GCS bucket {bucket!r} of --output does not exist (or these credentials cannot see it)")


def launch(config: FleetConfig, dry_run: bool, apply: bool, manifest_out: str | None) -> int:
    config, _ = resolve(config)
    check_runner_flags(config)
    backend = make_backend(config)
    if dry_run:  # asks no cloud API: machines that exist already are skipped by the real launch
        print(backend.plan(_to_launch(config, backend, look=False)))
        return 0
    check_output(config)
    written = backend.write_for_user(manifest_out)
    if written:
        print(written)
    if backend.creates_on_request and not apply:
        return 0
    todo = _to_launch(config, backend)
    if not todo:
        print(f"fleet {config.name}: nothing to launch (every machine exists or completed)")
        return 0
    backend.prepare()
    _write_record(config)
    started = backend.create(todo)
    waiting = [i for i in todo if i not in started]
    print(f"fleet {config.name}: launched {len(started)} machine(s) on {config.backend}"
          + (f"; {len(waiting)} wait for a free slot (supervise starts them)" if waiting else ""))
    return 0


def _to_launch(config: FleetConfig, backend: Backend, look: bool = True) -> list[int]:
    """Machines that neither completed nor exist (``look=False``: without asking the backend)."""
    done = {v.machine_id for v in fleet_views(read_fleet(config)) if v.state == COMPLETED}
    existing = backend.existing() if look else set()
    return [i for i in range(config.num_machines) if i not in existing | done]


def _write_record(config: FleetConfig) -> None:
    """``{output}/_fleet/fleet.json``: what was launched, when (for people and for teardown)."""
    record = {"name": config.name, "backend": config.backend, "num_machines": config.num_machines,
              "streams_dir": config.streams_dir, "output": config.output, "runner": list(config.runner),
              "launched_at": utc_now()}
    write_bytes(join(config.fleet_dir(), RECORD_FILE), (json.dumps(record, indent=2) + "\n").encode())


def _resolve_if_possible(config: FleetConfig, teardown: bool = False) -> tuple[FleetConfig, dict | None]:
    """``status`` needs no manifest when ``--num_machines`` is given, ``teardown`` none at all;
    both use one when there is one."""
    config.check()
    if config.streams_dir and read_optional(join(config.streams_dir, "manifest.json")) is not None:
        return resolve(config)
    if config.num_machines is None and not teardown:
        raise UserError("pass --num_machines, or --streams_dir with the prepare manifest")
    return config, None


def status(config: FleetConfig, watch: bool, chart: str | None) -> int:
    if chart:
        require("matplotlib", "charts", "status --chart")
    config, manifest = _resolve_if_possible(config)
    if not watch:
        return _show_status(config, manifest, chart)
    if sys.stdout.isatty():
        from rich.live import Live
        with Live(auto_refresh=False) as live:
            while True:
                files = read_fleet(config)
                views = fleet_views(files, manifest)
                live.update(rich_table(views), refresh=True)
                if chart:
                    write_chart(views, files, chart)
                if exit_code(views) == ALL_COMPLETED:
                    return ALL_COMPLETED
                time.sleep(config.interval)
    while True:
        code = _show_status(config, manifest, chart)
        if code == ALL_COMPLETED:
            return code
        time.sleep(config.interval)


def _show_status(config: FleetConfig, manifest: dict | None, chart: str | None) -> int:
    files = read_fleet(config)
    views = fleet_views(files, manifest)
    print(plain_table(views), flush=True)
    if chart:
        write_chart(views, files, chart)
    return exit_code(views)


def _existing_or_error(config: FleetConfig, backend: Backend) -> set[int]:
    existing = backend.existing()
    if not existing and read_optional(join(config.fleet_dir(), RECORD_FILE)) is None:
        raise UserError(f"fleet {config.name!r} was never launched: no {backend.where}, and no "
                        f"{join(config.fleet_dir(), RECORD_FILE)}")
    return existing


def supervise(config: FleetConfig, index_path: str | None) -> int:
    config, manifest = resolve(config)
    host = check_runner_flags(config)
    backend = make_backend(config)
    if backend.self_healing:
        _existing_or_error(config, backend)
    log.info("supervising fleet %s: %d machines on %s, a look every %g s", config.name,
             config.num_machines, config.backend, config.interval)
    gave_up = Supervisor(config, backend, manifest).run()
    if gave_up:
        raise UserError(f"machine(s) {', '.join(f'{i:03d}' for i in gave_up)} did not complete and are "
                        "no longer restarted (see the log lines above and their logs); fix, then run "
                        "launch and supervise again")
    log.info("every machine completed; merging")
    return _merge(config, manifest, index_path, host.max_samples)


def merge_command(config: FleetConfig, index_path: str | None) -> int:
    config, manifest = resolve(config)
    host = check_runner_flags(config)
    return _merge(config, manifest, index_path, host.max_samples)


def _merge(config: FleetConfig, manifest: dict, index_path: str | None, limit: int | None) -> int:
    result, line = merge(config, manifest, index_path, limit)
    print(line)
    return 0 if result.complete else 1


def teardown(config: FleetConfig, dry_run: bool) -> int:
    config, _ = _resolve_if_possible(config, teardown=True)
    backend = make_backend(config)
    existing = sorted(_existing_or_error(config, backend))
    if dry_run:
        print(f"would delete {len(existing)} machine(s) of fleet {config.name}: {backend.where}"
              + (f": {', '.join(f'{i:03d}' for i in existing)}" if existing else ""))
        return 0
    backend.delete(existing)
    print(f"fleet {config.name}: deleted {len(existing)} machine(s) ({backend.where}); the output "
          f"under {config.output} is kept")
    return 0

