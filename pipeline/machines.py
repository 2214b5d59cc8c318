"""Extraction as a Beam pipeline of machines: ``ListMachines`` -> ``Reshuffle`` -> ``ExtractMachine``
-> ``Merge`` (``pipeline.extract``), for engines that schedule and retry the work themselves
(Dataflow TPU workers).

One element is one machine of the prepare manifest. ``ExtractMachine`` runs the host runner's
own code path on it (``host.run.run_process``: resume from the machine's checkpoint on GCS,
the ordered extraction, size-triggered shards, index, statistics, ``status.json``), with the
model its worker loaded once in ``setup``, in a scratch directory of its own per attempt.
Because an engine may retry an attempt or run a speculative copy of it, each attempt holds the
machine through a lease on GCS and commits through its fenced checkpoint (``host/lease.py``):
a second live attempt stops before writing anything (here it then waits for the holder to end,
rather than spend one of the work item's retries); a stale one cannot commit. ``Merge`` waits
for every machine and runs the fleet's merge (``fleet/merge.py``): the merged index,
``merged_metadata.json`` and the completeness verdict.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
from typing import Iterator, Sequence

import apache_beam as beam

from common.cli import UserError
from fleet.config import FleetConfig
from host.config import HostConfig

log = logging.getLogger("pipeline.extract")


class ExtractMachine(beam.DoFn):
    """machine number -> the same number, once its machine is completed (stored and committed)."""

    def __init__(self, host: HostConfig, scratch_dir: str | None = None):
        self.host = host              # the runner's flags; machine_id and output_dir set per machine
        self.scratch_dir = scratch_dir
        self.extraction = None

    def setup(self) -> None:
        from host.run import check_model, extract_config
        from transforms.extraction import OrderedExtraction
        check_model(self.host)
        self.extraction = OrderedExtraction(extract_config(self.host))
        self.extraction.setup()  # once per worker process: the model stays loaded for every machine

    def process(self, machine: int) -> Iterator[int]:
        while (code := self._attempt(machine)) is None:
            # A live attempt holds the machine (a speculative copy, or a retry beside an attempt
            # its engine lost sight of): failing would spend one of the work item's few retries.
            # Its end is this attempt's: the machine completed (this run then finds it so), or
            # its lease released or expired (this run takes it over).
            time.sleep(self.host.lease_s / 3)
        if code != 0:
            raise RuntimeError(f"machine {machine:03d} stopped before its stream's end (exit status {code}); "
                               "a retry resumes it from its checkpoint")
        yield machine

    def _attempt(self, machine: int) -> int | None:
        """One run of the machine: its exit status, or None if a live attempt holds it."""
        from host.lease import LeaseHeld
        from host.run import run_process
        scratch = tempfile.mkdtemp(prefix=f"machine_{machine:03d}-", dir=self.scratch_dir)
        config = dataclasses.replace(self.host, machine_id=machine, output_dir=scratch)
        try:
            return run_process(config, extraction=self.extraction)
        except LeaseHeld as e:
            log.warning("%s; waiting for it to end", e)
            return None
        except UserError as e:  # a lost lease, a bad stream, GCS unreachable: one line in the log
            log.error("machine %03d: %s", machine, e)
            raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # every shard is on GCS, verified

    def teardown(self) -> None:
        if self.extraction is not None:
            self.extraction.teardown()


class MergeFleet(beam.DoFn):
    """The machines done (all of them, as one list) -> the verdict line, once the merged index is
    written. An incomplete verdict fails the step where the job covered every machine."""

    def __init__(self, fleet: FleetConfig, manifest: dict, limit: int | None, every_machine: bool):
        self.fleet, self.manifest, self.limit, self.every_machine = fleet, manifest, limit, every_machine

    def process(self, machines: Sequence[int]) -> Iterator[str]:
        from fleet.merge import merge
        result, line = merge(self.fleet, self.manifest, None, self.limit)
        log.info("%s", line)
        if self.every_machine and not result.complete:
            raise UserError(line)
        yield line


class ExtractMachines(beam.PTransform):
    """pipeline root -> the merge's verdict line."""

    def __init__(self, machines: Sequence[int], host: HostConfig, fleet: FleetConfig, manifest: dict,
                 scratch_dir: str | None = None):
        super().__init__()
        self.machines, self.host, self.fleet, self.manifest = list(machines), host, fleet, manifest
        self.scratch_dir = scratch_dir

    def expand(self, root):
        every = set(self.machines) == set(range(self.manifest["num_machines"]))
        return (root
                | "ListMachines" >> beam.Create(self.machines)
                | "Reshuffle" >> beam.Reshuffle()  # one machine per work item, on any worker
                | "ExtractMachine" >> beam.ParDo(ExtractMachine(self.host, self.scratch_dir))
                | "AllMachines" >> beam.combiners.ToList()
                | "Merge" >> beam.ParDo(MergeFleet(self.fleet, self.manifest, self.host.max_samples, every)))
