"""Creating Beam pipelines from leftover command-line arguments, with the local runner pinned.

Since Beam 2.68 the DirectRunner tries the Prism runner first, which downloads a binary at run
time and cannot work offline. Local runs therefore use the in-process FnApiRunner, which honours
``--direct_running_mode`` (``in_memory`` | ``multi_processing``) and ``--direct_num_workers``.
Every other runner (``--runner DataflowRunner`` ...) is used as given.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Iterator

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions, TestOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner

from common.cli import UserError

LOCAL_RUNNERS = (None, "DirectRunner", "FnApiRunner", "SwitchingDirectRunner")
_STEP_NOTE = re.compile(r" \[while running '[^']*'\]")  # what Beam appends to a worker's error


def pipeline_options(beam_args: list[str]) -> PipelineOptions:
    """Beam options from the arguments our own parser did not consume; unknown ones are errors."""
    options = PipelineOptions(beam_args)
    beam_log = logging.getLogger("apache_beam.options.pipeline_options")
    level = beam_log.level
    beam_log.setLevel(logging.ERROR)  # we report unknown arguments ourselves, as one line
    try:
        known = options.get_all_options(retain_unknown_options=False)
        with_unknown = options.get_all_options(retain_unknown_options=True)
    finally:
        beam_log.setLevel(level)
    unknown = sorted(set(with_unknown) - set(known))
    if unknown:
        raise UserError(f"unrecognized arguments: {' '.join('--' + u for u in unknown)}")
    return options


def is_local(options: PipelineOptions) -> bool:
    return options.view_as(StandardOptions).runner in LOCAL_RUNNERS


def is_dry_run(options: PipelineOptions) -> bool:
    """``--dry_run=True``: a remote runner (Dataflow) builds the job and does not submit it. Beam
    keeps the flag's text, so ``--dry_run=False`` must not count."""
    value = options.view_as(TestOptions).dry_run
    return str(value).strip().lower() not in ("", "false", "0", "no", "none")


def make_pipeline(options: PipelineOptions) -> beam.Pipeline:
    """A pipeline on the requested runner; local runs go to the FnApiRunner. A dry run asks for
    a runner that honours it; invalid remote options are one line."""
    if is_local(options):
        if is_dry_run(options):
            raise UserError("--dry_run builds a job for a remote runner without submitting it (e.g. "
                            "--runner DataflowRunner); the local runner would run everything")
        return beam.Pipeline(runner=FnApiRunner(), options=options)
    try:
        return beam.Pipeline(options=options)
    except ValueError as e:  # Beam's validation of the runner's options (project, region, ...)
        raise UserError(" ".join(str(e).split())) from None


@contextlib.contextmanager
def worker_user_errors(context: str) -> Iterator[None]:
    """Runs a pipeline's body so that a worker's ``UserError`` (wrapped by the runner) reaches the
    user as its own one line, ``context`` appended; the runner's log of the failed bundle (a
    traceback) is silenced, since every other error is raised again whole. (Worker processes of
    their own, ``--direct_running_mode multi_processing``, print theirs before it.)"""
    runner_log = logging.getLogger("apache_beam.runners.common")
    level = runner_log.level
    runner_log.setLevel(logging.CRITICAL)
    try:
        yield
    except UserError as e:  # raised by an in-process worker, Beam's note of the step appended
        raise UserError(f"{_STEP_NOTE.sub('', str(e))}{context}") from None
    except Exception as e:
        reason = next((line.split("UserError: ", 1)[1] for line in str(e).splitlines() if "UserError: " in line), None)
        if reason is None:
            raise
        raise UserError(f"{_STEP_NOTE.sub('', reason)}{context}") from None
    finally:
        runner_log.setLevel(level)
