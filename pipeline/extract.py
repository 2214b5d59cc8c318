"""Streams -> activations as one Beam job: every machine of the prepare manifest extracted by the
runner's own code, then merged (``pipeline/machines.py``); for Dataflow TPU workers.

    python -m pipeline.extract --streams_dir gs://B/streams --output gs://B/acts \
        --model_path gs://B/models/qwen --layers_to_extract 6,12 [runners.tpu_host flags] \
        [Beam options, e.g. --runner DataflowRunner --project P --region R ...]

Each machine writes ``{output}/machine_NNN/`` exactly as ``runners.tpu_host`` does; re-running the
same command resumes every machine from its checkpoint. Local runs use the FnApiRunner.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

from apache_beam.options.pipeline_options import DebugOptions, StandardOptions
from apache_beam.runners.runner import PipelineResult

from common.beam_pipeline import is_dry_run, make_pipeline, pipeline_options
from common.cli import UserError, add_config_flags, config_from_namespace, flag, int_list, make_parser, run_main
from fleet.config import FleetConfig, resolve
from fleet.config import FLEET_OWNED
from fleet.dataflow import TPU_WORKER_EXPERIMENT
from fleet.runner import flag_names, fleet_flags
from host.config import HostConfig

log = logging.getLogger("pipeline.extract")
# Seconds a silent holder keeps its machine: a retry after a crashed worker waits this long.
DEFAULT_LEASE_S = 120.0


@dataclasses.dataclass(frozen=True)
class ExtractJobConfig:
    streams_dir: str | None = flag(None, "the prepare pipeline's output (stream_NNN.jsonl + manifest.json)")
    output: str | None = flag(None, "gs://BUCKET/PREFIX: each machine's machine_NNN/, the merged "
                              "index.parquet and merged_metadata.json")
    machines: tuple[int, ...] | None = flag(None, "machines to extract, e.g. 0,3,7 (default: every "
                                            "machine of the manifest)", parse=int_list)
    name: str = flag("extract", "the fleet's name, in the merge's verdict line")
    scratch_dir: str | None = flag(None, "worker-local directory for each attempt's files before "
                                   "upload (default: the system's temporary directory)")


def parse(argv: list[str]) -> tuple[ExtractJobConfig, HostConfig, list[str]]:
    """(the job's flags, the runner's flags for machine 0, the Beam options)."""
    parser = make_parser("pipeline.extract", __doc__.splitlines()[0])
    add_config_flags(parser, ExtractJobConfig)
    args, rest = parser.parse_known_args(argv)
    job = config_from_namespace(ExtractJobConfig, args)
    if not job.streams_dir or not job.output:
        raise UserError("pass --streams_dir and --output")
    if not job.output.startswith("gs://"):
        raise UserError(f"--output must be gs://BUCKET/PREFIX (attempts hold their machine through a lease "
                        f"on GCS), got {job.output!r}")
    owned = [name for name in flag_names(rest) if name in FLEET_OWNED]
    if owned:
        raise UserError(f"runner flag --{owned[0]} is set by pipeline.extract (from --streams_dir, --output "
                        "and the machine); remove it")
    runner_parser = make_parser("pipeline.extract", "")
    add_config_flags(runner_parser, HostConfig)
    host_args, beam_args = runner_parser.parse_known_args(fleet_flags(_fleet(job), 0) + rest)
    host = config_from_namespace(HostConfig, host_args)
    if host.lease_s is None:
        host = dataclasses.replace(host, lease_s=DEFAULT_LEASE_S)
    try:
        host.validate()
    except UserError as e:
        raise UserError(f"runner flags: {e}") from None
    return job, host, beam_args


def _fleet(job: ExtractJobConfig, runner_words: tuple[str, ...] = (), num_machines: int | None = None) -> FleetConfig:
    return FleetConfig(name=job.name, num_machines=num_machines, streams_dir=job.streams_dir, output=job.output,
                       backend="dataflow", runner=runner_words)


def machines_to_run(job: ExtractJobConfig, num_machines: int) -> list[int]:
    if job.machines is None:
        return list(range(num_machines))
    outside = [m for m in job.machines if not 0 <= m < num_machines]
    if outside:
        raise UserError(f"--machines {','.join(map(str, outside))}: the manifest has machines 0..{num_machines - 1}")
    return sorted(set(job.machines))


def for_tpu_workers(options) -> None:
    """On Dataflow: one SDK process per VM, one harness thread (the TPU opens once)."""
    if "dataflow" not in (options.view_as(StandardOptions).runner or "").lower():
        return  # (Beam takes DataflowRunner, dataflow, or the class's path)
    debug = options.view_as(DebugOptions)
    if not debug.lookup_experiment(TPU_WORKER_EXPERIMENT):
        debug.add_experiment(TPU_WORKER_EXPERIMENT)
    if not debug.number_of_worker_harness_threads:
        debug.number_of_worker_harness_threads = 1


def run(argv: list[str], wait: bool = True) -> PipelineResult:
    """Parses ``argv`` as the command line does, builds the job and runs it (``wait=False``:
    returns once it is submitted)."""
    return run_parsed(*parse(argv), wait=wait)


def submit(argv: Sequence[str]) -> PipelineResult:
    """The job of ``argv`` (``run``), returned once submitted: the dataflow backend's job
    (``fleet.backends.SubmitJob``)."""
    return run(list(argv), wait=False)


def run_parsed(job: ExtractJobConfig, host: HostConfig, beam_args: list[str], wait: bool = True) -> PipelineResult:
    from pipeline.machines import ExtractMachines
    fleet, manifest = resolve(_fleet(job))
    machines = machines_to_run(job, fleet.num_machines)
    options = pipeline_options(beam_args)
    for_tpu_workers(options)
    log.info("extracting %d machine(s) of %s into %s", len(machines), job.streams_dir, job.output)
    pipeline = make_pipeline(options)
    _ = pipeline | ExtractMachines(machines, host, fleet, manifest, job.scratch_dir)
    result = pipeline.run()
    if wait and not is_dry_run(options):
        result.wait_until_finish()
    return result


def main(argv: list[str]) -> int:
    job, host, beam_args = parse(argv)
    result = run_parsed(job, host, beam_args)
    options = pipeline_options(beam_args)
    runner = options.view_as(StandardOptions).runner
    if is_dry_run(options):
        print(f"dry run: built the {runner} job without submitting it; nothing ran")
        return 0
    if result.state != "DONE":
        raise UserError(f"the extraction job ended {result.state}")
    print(f"activations: {job.output}")
    return 0


if __name__ == "__main__":
    run_main("pipeline.extract", main, skip_native_teardown=True)
