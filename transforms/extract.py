"""``ExtractActivations``: the Beam DoFn of extraction, stream records in, one record per sample
with its activations out, in input order within a bundle.

A thin wrapper of ``OrderedExtraction`` (``transforms/extraction.py``, which the host runner
drives without Beam): a skipped record goes to the ``rejected`` tagged output, and both kinds of
outcome are counted (Beam counters ``extract:truncated``, ``extract:skipped_too_long``).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import TaggedOutput
from apache_beam.transforms.window import GlobalWindows

from transforms.extraction import REJECTED, ExtractConfig, OrderedExtraction, Tagged


class ExtractActivations(beam.DoFn):
    """Stream records -> activation records (in input order within a bundle)."""

    def __init__(self, config: ExtractConfig):
        self.config = config
        self.core = OrderedExtraction(config)

    def setup(self):
        self.core.setup()

    def start_bundle(self):
        self.core.start()

    def process(self, record: dict[str, Any]):
        yield from _as_beam(self.core.process(record))

    def finish_bundle(self):
        for out in _as_beam(self.core.drain()):
            if isinstance(out, TaggedOutput):
                yield TaggedOutput(out.tag, GlobalWindows.windowed_value(out.value))
            else:
                yield GlobalWindows.windowed_value(out)

    def teardown(self):
        self.core.teardown()


def _as_beam(outputs: Iterable[dict[str, Any] | Tagged]) -> Iterator[dict[str, Any] | TaggedOutput]:
    """Tagged outputs as Beam's, each outcome counted."""
    for out in outputs:
        if isinstance(out, Tagged):
            if out.tag == REJECTED:
                Metrics.counter("extract", "skipped_too_long").inc()
            yield TaggedOutput(out.tag, out.value)
        else:
            if out["truncated"]:
                Metrics.counter("extract", "truncated").inc()
            yield out
