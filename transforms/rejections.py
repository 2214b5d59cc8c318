"""Dead-letter records: why a source record produced no sample, counted per reason."""

from __future__ import annotations

import json
from typing import Any

COUNTER_NAMESPACE = "prepare"
PREVIEW_CHARS = 500


class RejectedRecord(ValueError):
    """A source record that cannot become a sample; ``reason`` is a short counter-friendly code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def rejection(error: RejectedRecord, origin: str, file_index: int, row: int,
              record: Any) -> dict[str, Any]:
    """The dead-letter entry written to ``rejected/``, with a bounded preview of the record."""
    preview = record if isinstance(record, str) else json.dumps(record, default=str)
    return {"reason": error.reason, "detail": error.detail, "origin": origin,
            "file_index": file_index, "row": row, "record_preview": preview[:PREVIEW_CHARS]}


def count_rejection(reason: str) -> None:
    """Bumps the total and the per-reason Beam counters (visible in the Dataflow UI). Beam is
    imported here, not with the module: the runner reads ARC answers (``transforms.arc``) without it."""
    from apache_beam.metrics import Metrics
    Metrics.counter(COUNTER_NAMESPACE, "rejected").inc()
    Metrics.counter(COUNTER_NAMESPACE, f"rejected_{reason}").inc()
