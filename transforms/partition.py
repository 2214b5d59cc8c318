"""Assigning each sample to exactly one machine, deterministically and balanced by tokens.

A sample's stable hash puts it in one of ``num_machines * VIRTUAL_BUCKETS_PER_MACHINE`` buckets;
the buckets are then dealt to machines greedily, largest token total first, each to the machine
with the fewest tokens so far (ties to the lower machine id). Only the bucket totals travel to
one place, so this scales; the same inputs always give the same assignment, and since a sample is
in exactly one bucket, no two machines ever hold the same sample.
"""

from __future__ import annotations

import heapq
from typing import Mapping

import apache_beam as beam

from transforms.ids import stable_hash

VIRTUAL_BUCKETS_PER_MACHINE = 16


def bucket_of(sample_id: int, num_buckets: int) -> int:
    return stable_hash(sample_id) % num_buckets


def machines_for_buckets(bucket_tokens: Mapping[int, int], num_machines: int) -> dict[int, int]:
    """Bucket -> machine, greedy longest-first onto the least-loaded machine."""
    loads = [(0, m) for m in range(num_machines)]  # (tokens so far, machine)
    plan = {}
    for bucket, tokens in sorted(bucket_tokens.items(), key=lambda kv: (-kv[1], kv[0])):
        load, machine = heapq.heappop(loads)
        plan[bucket] = machine
        heapq.heappush(loads, (load + tokens, machine))
    return plan


def machine_of(sample_id: int, plan: Mapping[int, int], num_machines: int) -> int:
    """The machine a sample goes to under ``plan`` (bucket -> machine, from ``PlanMachines``)."""
    return plan[bucket_of(sample_id, num_machines * VIRTUAL_BUCKETS_PER_MACHINE)]


class PlanMachines(beam.PTransform):
    """Anything with ``sample_id`` and ``num_tokens`` (``spill.LineInfo``) -> one dict, bucket ->
    machine, for ``machine_of``. A plan rather than assigned pairs: its users look the machine up
    where they need it, so nothing is held once more under its machine (the local runner keeps
    every PCollection between stages in memory)."""

    def __init__(self, num_machines: int):
        super().__init__()
        self._num_machines = num_machines

    def expand(self, entries):
        num_buckets = self._num_machines * VIRTUAL_BUCKETS_PER_MACHINE
        return (entries
                | "TokensPerBucket" >> beam.Map(lambda e: (bucket_of(e.sample_id, num_buckets), e.num_tokens))
                | "SumBuckets" >> beam.CombinePerKey(sum)
                | "CollectBuckets" >> beam.combiners.ToDict()
                | "Plan" >> beam.Map(machines_for_buckets, self._num_machines))
