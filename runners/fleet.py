"""Launch, watch, recover and finish N extraction hosts from one command.

    python -m runners.fleet launch    --config fleet.yaml [--backend local|tpu-vm|gke|dataflow] [--dry_run] [--apply]
    python -m runners.fleet status    --config fleet.yaml [--watch] [--json] [--chart fleet.png]
    python -m runners.fleet supervise --config fleet.yaml
    python -m runners.fleet merge     --config fleet.yaml
    python -m runners.fleet teardown  --config fleet.yaml [--dry_run]

Runner flags after ``--`` are passed to every ``runners.tpu_host`` (after those of the config).
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from common.cli import make_parser, run_main
from fleet import commands
from fleet.backend import cloud_errors
from fleet.config import add_fleet_flags, fleet_config

COMMANDS = {
    "launch": "create the machines that do not exist yet (idempotent)",
    "status": "a table of every machine from its status.json / checkpoint.json (exit 0 all "
              "completed, 1 running, 2 failed, stalled, stopped or missing)",
    "supervise": "recreate machines that are gone, until all complete (dataflow: wait for the job to "
                 "end); then merge",
    "merge": "the merged index + merged_metadata.json, checked complete against the manifest",
    "teardown": "delete what launch created for this fleet (dataflow: cancel its job); never the output",
}


def main(argv: list[str]) -> int:
    parser = make_parser("runners.fleet", __doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}",
                                parser_class=type(parser))
    parsers = {}
    for name, help_text in COMMANDS.items():
        parsers[name] = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        add_fleet_flags(parsers[name])
    for name in ("launch", "teardown"):
        parsers[name].add_argument("--dry_run", action="store_true", help="print what would be done; do nothing")
    parsers["launch"].add_argument("--apply", action="store_true",
                                   help="gke: submit the Job (without: only write its manifest)")
    parsers["launch"].add_argument("--manifest", help="gke: where the Job manifest goes (default {name}-job.yaml)")
    parsers["status"].add_argument("--watch", action="store_true", help="redraw every --interval seconds")
    parsers["status"].add_argument("--json", action="store_true",
                                   help="print the status as one JSON document (machines, fleet, usage)")
    parsers["status"].add_argument("--chart", help="also write a PNG: progress per machine, fleet samples "
                                   "computed and stored since launch")
    for name in ("supervise", "merge"):
        parsers[name].add_argument("--index", help="merged index path (default {output}/index.parquet)")
    command = argv[0] if argv else None
    if command not in COMMANDS:
        parser.parse_args(argv)  # help, or the one-line error for a missing or unknown command
    config, args = fleet_config(parsers[command], argv[1:])
    try:
        with cloud_errors(config.backend):
            return run(command, config, args)
    except KeyboardInterrupt:  # Ctrl-C ends a watch or a supervise; the machines go on
        print(f"runners.fleet {command}: interrupted", file=sys.stderr)
        return 130


def submit_extract_job(argv: Sequence[str]) -> Any:
    """The dataflow backend's job: ``pipeline.extract``, returned once submitted (Beam is imported
    only when a job is submitted)."""
    from pipeline.extract import submit
    return submit(argv)


def run(command: str, config, args) -> int:
    if command == "launch":
        return commands.launch(config, args.dry_run, args.apply, args.manifest, submit_extract_job)
    if command == "status":
        return commands.status(config, args.watch, args.chart, args.json)
    if command == "supervise":
        return commands.supervise(config, args.index)
    if command == "merge":
        return commands.merge_command(config, args.index)
    return commands.teardown(config, args.dry_run)


if __name__ == "__main__":
    run_main("runners.fleet", main, skip_native_teardown=True)  # its work ends in Arrow
