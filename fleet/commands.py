"""The five steps of a fleet, each written once against ``fleet.backend.Backend``:
launch, status, supervise, merge, teardown. Each returns the process's exit code."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time

from common.cli import UserError
from common.extras import require
from common.files import join, read_optional, write_bytes
from fleet.backend import Backend, error_line
from fleet.backends import SubmitJob, backend_class, make_backend
from fleet.config import FleetConfig, resolve
from fleet import usage
from fleet.machines import (ALL_COMPLETED, ANY_LIMIT, LAUNCH_RECORD, NEEDS_ATTENTION, UNDER_LIMIT, Limit, exit_code,
                            fleet_views, read_fleet, read_launched_at)
from fleet.merge import merge
from fleet.report import FleetReport, fleet_report, plain_table, rich_table, status_document, write_chart
from fleet.runner import check_runner_flags
from fleet.supervise import Supervisor
from fleet.usage import Ledger
from common.states import COMPLETED
from host.status import utc_now

log = logging.getLogger("runners.fleet")


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


def launch(config: FleetConfig, dry_run: bool, apply: bool, manifest_out: str | None,
           submit_job: SubmitJob | None = None) -> int:
    """``submit_job``: how a one-job engine submits its job (``fleet.backends.make_backend``)."""
    config, _ = resolve(config)
    limit = check_runner_flags(config).max_samples
    backend = make_backend(config, submit_job)
    if dry_run:  # asks no cloud API: machines that exist already are skipped by the real launch
        print(backend.plan(_to_launch(config, backend, limit, look=False)))
        return 0
    check_output(config)
    written = backend.write_for_user(manifest_out)
    if written:
        print(written)
    if backend.creates_on_request and not apply:
        return 0
    todo = _to_launch(config, backend, limit)
    if not todo:
        print(f"fleet {config.name}: nothing to launch (every machine exists or completed)")
        return 0
    backend.prepare()
    _write_record(config)
    started = backend.create(todo)
    usage.record(config, backend)
    waiting = [i for i in todo if i not in started]
    print(f"fleet {config.name}: launched {len(started)} machine(s) on {config.backend}"
          + (f"; {len(waiting)} wait for a free slot (supervise starts them)" if waiting else ""))
    return 0


def _to_launch(config: FleetConfig, backend: Backend, limit: Limit, look: bool = True) -> list[int]:
    """Machines that neither completed nor exist (``look=False``: without asking the backend).
    One that completed under a smaller ``--max_samples`` than ``limit`` and still exists is
    deleted first: it runs the old flags."""
    views = fleet_views(read_fleet(config), limit=limit)
    done = {v.machine_id for v in views if v.state == COMPLETED}
    more = [v.machine_id for v in views if v.state == UNDER_LIMIT]
    existing = backend.existing() if look else set()
    if look and more and existing & set(more):
        if backend.self_healing:
            raise UserError(f"machine(s) {', '.join(f'{i:03d}' for i in more)} completed under a smaller "
                            f"--max_samples; run teardown (the output stays), then launch again")
        stale = sorted(existing & set(more))
        asked_at = time.time()
        backend.delete(stale)
        usage.deleted(config, Ledger.read(config), stale, asked_at)
        for machine in stale:
            log.info("machine %03d: completed under a smaller --max_samples; deleted, to run the new flags",
                     machine)
        existing -= set(more)
    return [i for i in range(config.num_machines) if i not in existing | done]


def _write_record(config: FleetConfig) -> None:
    """``{output}/_fleet/fleet.json``: what was launched, when (for people and for teardown)."""
    record = {"name": config.name, "backend": config.backend, "num_machines": config.num_machines,
              "streams_dir": config.streams_dir, "output": config.output, "runner": list(config.runner),
              "launched_at": utc_now()}
    write_bytes(join(config.fleet_dir(), LAUNCH_RECORD), (json.dumps(record, indent=2) + "\n").encode())


def _resolve_if_possible(config: FleetConfig, teardown: bool = False) -> tuple[FleetConfig, dict | None]:
    """``status`` needs no manifest when ``--num_machines`` is given, ``teardown`` none at all;
    both use one when there is one."""
    config.check()
    if config.streams_dir and read_optional(join(config.streams_dir, "manifest.json")) is not None:
        return resolve(config)
    if config.num_machines is None and not teardown:
        raise UserError("pass --num_machines, or --streams_dir with the prepare manifest")
    return config, None


def status(config: FleetConfig, watch: bool, chart: str | None, as_json: bool = False) -> int:
    if chart:
        require("matplotlib", "charts", "status --chart")
    config, manifest = _resolve_if_possible(config)
    limit = _runner_limit(config)
    engine = make_backend(config) if backend_class(config.backend).one_job else None
    if not watch:
        return _show_status(config, manifest, limit, chart, as_json, engine)
    if sys.stdout.isatty() and not as_json:
        from rich.console import Group
        from rich.live import Live
        with Live(auto_refresh=False) as live:
            while True:
                report = _report(config, manifest, limit)
                job = _job_status(engine)
                live.update(Group(rich_table(report), job[0]) if job else rich_table(report), refresh=True)
                if chart:
                    write_chart(report, chart)
                if exit_code(report.views) == ALL_COMPLETED:
                    return ALL_COMPLETED
                time.sleep(config.interval)
    while True:
        code = _show_status(config, manifest, limit, chart, as_json, engine)
        if code == ALL_COMPLETED:
            return code
        time.sleep(config.interval)


def _runner_limit(config: FleetConfig) -> Limit:
    """The ``--max_samples`` the machines are to run under: from the runner flags given, else
    from those ``launch`` recorded in ``_fleet/fleet.json``; ``ANY_LIMIT`` when neither says."""
    runner = config.runner
    if not runner:
        record = read_optional(join(config.fleet_dir(), LAUNCH_RECORD))
        runner = tuple(json.loads(record).get("runner", ())) if record is not None else ()
    if not runner:
        return ANY_LIMIT
    return check_runner_flags(dataclasses.replace(config, runner=runner)).max_samples


def _report(config: FleetConfig, manifest: dict | None, limit: Limit) -> FleetReport:
    files = read_fleet(config)
    now = time.time()
    return fleet_report(fleet_views(files, manifest, now, limit), files, Ledger.read(config), now,
                        config.price_per_hour, read_launched_at(config))


def _show_status(config: FleetConfig, manifest: dict | None, limit: Limit, chart: str | None,
                 as_json: bool, engine: Backend | None = None) -> int:
    """The table (or document); with ``engine`` (a ``one_job`` backend), its job's line after it. A
    job that ended before every machine completed needs attention, whatever their files say."""
    report = _report(config, manifest, limit)
    job = _job_status(engine)
    if as_json:
        print(json.dumps({**status_document(report), **({"job": job[0]} if job else {})}, indent=2), flush=True)
    else:
        print(plain_table(report) + (f"\n{job[0]}" if job else ""), flush=True)
    if chart:
        write_chart(report, chart)
    code = exit_code(report.views)
    return NEEDS_ATTENTION if job and job[1] and code != ALL_COMPLETED else code


def _job_status(engine: Backend | None) -> tuple[str, bool] | None:
    """The engine's job in one line, and whether it ended; a refused call is a line too (the
    machines' table stands without it)."""
    if engine is None:
        return None
    try:
        return engine.job_status()
    except Exception as e:
        return f"{engine.config.backend}: cannot read the job: {error_line(e)}", False


def _existing_or_error(config: FleetConfig, backend: Backend) -> set[int]:
    existing = backend.existing()
    if not existing and read_optional(join(config.fleet_dir(), LAUNCH_RECORD)) is None:
        raise UserError(f"fleet {config.name!r} was never launched: no {backend.where}, and no "
                        f"{join(config.fleet_dir(), LAUNCH_RECORD)}")
    return existing


def supervise(config: FleetConfig, index_path: str | None) -> int:
    config, manifest = resolve(config)
    host = check_runner_flags(config)
    backend = make_backend(config)
    if backend.self_healing:
        _existing_or_error(config, backend)
    log.info("supervising fleet %s: %d machines on %s, a look every %g s", config.name,
             config.num_machines, config.backend, config.interval)
    if backend.one_job:  # the engine retries the work; its job's end is ours to wait for
        ledger = Ledger.read(config)
        backend.wait_for_job(lambda: usage.record(config, backend, ledger))
        log.info("the job is done; merging")
        return _merge(config, manifest, index_path, host.max_samples)
    gave_up = Supervisor(config, backend, manifest, host.max_samples).run()
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
    verb, done = backend.delete_words
    if dry_run:
        print(f"would {verb} {len(existing)} machine(s) of fleet {config.name}: {backend.where}"
              + (f": {', '.join(f'{i:03d}' for i in existing)}" if existing else ""))
        return 0
    asked_at = time.time()
    backend.delete(existing)
    ledger = Ledger.read(config)
    usage.deleted(config, ledger, list(ledger.lives), asked_at)
    print(f"fleet {config.name}: {done} {len(existing)} machine(s) ({backend.where}); the output "
          f"under {config.output} is kept")
    return 0

