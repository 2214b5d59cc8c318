"""Turning source records into samples (a chat prompt or a plain text, with id and source),
sending every record that cannot become one to the dead-letter output with its reason."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import apache_beam as beam
from apache_beam import pvalue

from common.cli import UserError
from transforms.arc import arc_answer, arc_messages, is_arc_record, parse_arc_task
from transforms.ids import make_sample_id
from transforms.rejections import RejectedRecord, count_rejection, rejection
from transforms.sources import SourceRecord

FORMATS = ("arc", "fineweb")
REJECTED_TAG = "rejected"


@dataclasses.dataclass(frozen=True)
class Sample:
    """A formatted sample: exactly one of ``messages`` (a chat) or ``text`` (plain text) is set."""
    sample_id: int
    source: str
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) turns
    text: str | None = None
    answer: str | None = None  # the expected answer, tokenized after the prompt (a scored span)


def detect_format(record: Any, text_field: str) -> str:
    """``arc`` or ``fineweb`` from the shape of a record; raises ``UserError`` if neither fits."""
    if is_arc_record(record):
        return "arc"
    if isinstance(record, dict) and text_field in record:
        return "fineweb"
    keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
    raise UserError(f"cannot detect the format of records like {keys}: "
                    f"pass --format arc|fineweb (or --text_field)")


def arc_samples(item: SourceRecord, include_answers: bool = False) -> list[Sample]:
    """One sample per test input of an ARC task; source = ``task_id:test_index``. With
    ``include_answers``, the test's expected output (where the task has it) is the answer."""
    if not isinstance(item.record, dict):
        raise RejectedRecord("not_a_record", f"expected a JSON object, got {type(item.record).__name__}")
    task = parse_arc_task(item.record, default_id=item.origin, with_outputs=include_answers)
    return [Sample(make_sample_id(item.file_index, item.row, i), f"{task.task_id}:{i}",
                   messages=tuple((m["role"], m["content"]) for m in arc_messages(task, i)),
                   answer=arc_answer(task, i) if include_answers else None)
            for i in range(len(task.test_inputs))]


def text_samples(item: SourceRecord, text_field: str) -> list[Sample]:
    """One sample per document; source = the record's ``id``, else ``url``, else its position."""
    if not isinstance(item.record, dict):
        raise RejectedRecord("not_a_record", f"expected a JSON object, got {type(item.record).__name__}")
    if text_field not in item.record:
        raise RejectedRecord("missing_field", f"record has no {text_field!r} field")
    text = item.record[text_field]
    if not isinstance(text, str) or not text.strip():
        raise RejectedRecord("empty_text", f"{text_field!r} is empty or not a string")
    source = item.record.get("id") or item.record.get("url") or item.origin
    return [Sample(make_sample_id(item.file_index, item.row), str(source), text=text)]


def samples_from_record(item: SourceRecord, fmt: str, text_field: str,
                        include_answers: bool = False) -> list[Sample]:
    """The samples of one source record; raises ``RejectedRecord`` for an invalid one."""
    if item.parse_error is not None:
        raise RejectedRecord("invalid_json", item.parse_error)
    if fmt == "arc":
        return arc_samples(item, include_answers)
    return text_samples(item, text_field)


class _FormatFn(beam.DoFn):
    def __init__(self, fmt: str, text_field: str, include_answers: bool):
        self._fmt = fmt
        self._text_field = text_field
        self._include_answers = include_answers

    def process(self, item: SourceRecord) -> Iterator[Any]:
        try:
            yield from samples_from_record(item, self._fmt, self._text_field, self._include_answers)
        except RejectedRecord as e:
            count_rejection(e.reason)
            yield pvalue.TaggedOutput(REJECTED_TAG,
                                      rejection(e, item.origin, item.file_index, item.row, item.record))


class FormatSamples(beam.PTransform):
    """``SourceRecord``s -> ``Sample``s (main output) and dead-letter dicts (``rejected``)."""

    def __init__(self, fmt: str, text_field: str, include_answers: bool = False):
        super().__init__()
        if fmt not in FORMATS:
            raise UserError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
        self._fmt = fmt
        self._text_field = text_field
        self._include_answers = include_answers

    def expand(self, records):
        return records | beam.ParDo(_FormatFn(self._fmt, self._text_field, self._include_answers)).with_outputs(
            REJECTED_TAG, main="samples")
