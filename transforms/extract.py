"""``ExtractActivations``: stream records in, one record per sample with its activations out.

The DoFn loads the model once per worker (``setup``), collects up to ``window`` records, runs
them through the bucketed, sharded forward and emits the results **in input order**, so that a
consumer (the host runner) can cut shards that each hold a contiguous run of the stream.
Records longer than ``max_seq_length`` follow ``long_samples`` (``transforms/long_samples.py``);
a skipped one is emitted in its place as a rejection on the ``rejected`` tagged output, and
counted (Beam counters ``extract:truncated``, ``extract:skipped_too_long``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterator, Sequence

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import TaggedOutput
from apache_beam.transforms.window import GlobalWindows

from common.cli import UserError
from model.settings import ModelRunSettings
from transforms.long_samples import fit_record, rejection

STREAM_FIELDS = ("sample_id", "input_ids", "num_tokens", "source", "text_preview")
REJECTED = "rejected"  # the tagged output of records that were not computed
# The tagged output of records another process of a multi-host machine computed and stores:
# ``{"sample_id": ...}``, so that each process still sees every stream position.
ELSEWHERE = "elsewhere"


class StreamFormatError(UserError):
    """A malformed line in a stream file; the message names the file and line number."""


def parse_stream_line(line: str, where: str) -> dict[str, Any]:
    """One stream record, validated; ``where`` is ``path:line`` for the error message."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise StreamFormatError(f"{where}: malformed JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise StreamFormatError(f"{where}: a stream line must be a JSON object")
    missing = [f for f in STREAM_FIELDS if f not in record]
    if missing:
        raise StreamFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    ids = record["input_ids"]
    if (not isinstance(ids, list) or not ids
            or not all(type(t) is int and t >= 0 for t in ids)):
        raise StreamFormatError(f"{where}: input_ids must be a non-empty list of token ids")
    if record["num_tokens"] != len(ids):
        raise StreamFormatError(f"{where}: num_tokens {record['num_tokens']} != {len(ids)} input_ids")
    if type(record["sample_id"]) is not int:
        raise StreamFormatError(f"{where}: sample_id must be an integer")
    if type(record.get("truncated", False)) is not bool:
        raise StreamFormatError(f"{where}: truncated must be true or false")
    original = record.get("original_num_tokens", len(ids))
    if type(original) is not int or original < len(ids):
        raise StreamFormatError(f"{where}: original_num_tokens must be an integer >= num_tokens")
    answer_start = record.get("answer_start", 0)
    if type(answer_start) is not int or answer_start < 0:
        raise StreamFormatError(f"{where}: answer_start must be an integer >= 0")
    return record


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExtractConfig(ModelRunSettings):
    """The model settings (``model.settings``; ``batch_size`` is per device) and what to extract."""
    model_path: str
    layers: tuple[int, ...] | None = None  # None: every layer
    max_seq_length: int = 2048
    activation_dtype: str = "float32"
    window: int | None = None              # records reordered at once; default 8 x global batch
    long_samples: str = "truncate"         # records over max_seq_length: truncate | skip | error
    batches_in_flight: int = 2             # dispatched before the oldest is copied back
    ablation: str | None = None            # an intervention to extract under (model.interventions)
    ablation_means: str | None = None      # its means file, for mode=mean


def activation_record(record: dict[str, Any], activations: dict[int, Any]) -> dict[str, Any]:
    """The output of one sample (as computed, see ``fit_record``): its identity, whether it was
    truncated, and ``{layer: array [num_tokens, hidden]}``."""
    return {"sample_id": record["sample_id"], "source": record["source"],
            "text_preview": record["text_preview"], "num_tokens": record["num_tokens"],
            "truncated": record["truncated"], "original_num_tokens": record["original_num_tokens"],
            "activations": activations}


def extract_in_order(extractor, records: Sequence[dict[str, Any]],
                     long_samples: str = "truncate") -> Iterator[dict[str, Any] | TaggedOutput]:
    """For each record in input order: its activation record, ``TaggedOutput(REJECTED, ...)`` if
    ``long_samples`` skips it, or ``TaggedOutput(ELSEWHERE, ...)`` if another process computed
    it. Computed bucket by bucket."""
    limit = extractor.buckets[-1]
    fitted = [fit_record(r, limit, long_samples) for r in records]  # None: skipped
    results = dict(extractor.extract((i, r["input_ids"]) for i, r in enumerate(fitted) if r is not None))
    for i, (record, fit) in enumerate(zip(records, fitted)):
        if fit is None:
            yield TaggedOutput(REJECTED, rejection(record, limit))
        elif (activations := results.pop(i)) is None:
            yield TaggedOutput(ELSEWHERE, {"sample_id": record["sample_id"]})
        else:
            yield activation_record(fit, activations)


class ExtractActivations(beam.DoFn):
    """Stream records -> activation records (in input order within a bundle)."""

    def __init__(self, config: ExtractConfig):
        self.config = config
        self.extractor = None
        self._pending: list[dict[str, Any]] = []

    def setup(self):
        from model.extract import Extractor
        c = self.config
        self.extractor = Extractor.load(c.model_path, c.layers, c.mesh_type, c.dtype, c.batch_size,
                                        c.max_seq_length, activation_dtype=c.activation_dtype,
                                        attention=c.attention, batches_in_flight=c.batches_in_flight,
                                        ablation=c.ablation, ablation_means=c.ablation_means,
                                        residual_dtype=c.residual_dtype)

    def window_for(self, global_batch: int) -> int:
        """Records computed together: the configured window, else 8 global batches."""
        return self.config.window or 8 * global_batch

    @property
    def window(self) -> int:
        return self.window_for(self.extractor.batch_size)

    @property
    def pending(self) -> int:
        """Records waiting for the window to fill (0 at a window's start)."""
        return len(self._pending)

    def start_bundle(self):
        self._pending = []

    def process(self, record: dict[str, Any]):
        self._pending.append(record)
        if len(self._pending) >= self.window:
            yield from self.drain()

    def finish_bundle(self):
        for out in self.drain():
            if isinstance(out, TaggedOutput):
                yield TaggedOutput(out.tag, GlobalWindows.windowed_value(out.value))
            else:
                yield GlobalWindows.windowed_value(out)

    def drain(self) -> Iterator[dict[str, Any] | TaggedOutput]:
        """Computes and yields every pending record (used by ``finish_bundle`` and the runner)."""
        records, self._pending = self._pending, []
        for out in extract_in_order(self.extractor, records, self.config.long_samples):
            if isinstance(out, TaggedOutput):
                if out.tag == REJECTED:
                    Metrics.counter("extract", "skipped_too_long").inc()
            elif out["truncated"]:
                Metrics.counter("extract", "truncated").inc()
            yield out

    def discard_pending(self) -> int:
        """Drops records not computed yet (on preemption they are redone after resume)."""
        dropped, self._pending = len(self._pending), []
        return dropped

    def teardown(self):
        self.extractor = None
