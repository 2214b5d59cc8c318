"""Turning source records into samples (a chat or a plain text, with id and source, and the kept
columns), sending every record that cannot become one to the dead-letter output with its reason.

Formats (``FORMATS``):

* ``arc``: one sample per test input of an ARC task, a system + user chat (``transforms/arc.py``);
* ``fineweb``: a plain text column;
* ``chat``: a conversation column (``messages`` or ``conversations``, ``transforms/chat.py``),
  rendered whole by the chat template;
* ``pair``: a prompt column and a response column, as a user turn and an assistant turn.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import apache_beam as beam
from apache_beam import pvalue

from common.cli import UserError
from transforms.arc import arc_answer, arc_messages, is_arc_record, parse_arc_task
from transforms.chat import MESSAGE_FIELDS, conversation, messages_field, prompt_response
from transforms.columns import kept_values
from transforms.ids import make_sample_id
from transforms.rejections import RejectedRecord, count_rejection, rejection
from transforms.sources import SourceRecord

FORMATS = ("arc", "fineweb", "chat", "pair")
REJECTED_TAG = "rejected"


@dataclasses.dataclass(frozen=True)
class Sample:
    """A formatted sample: exactly one of ``messages`` (a chat) or ``text`` (plain text) is set."""
    sample_id: int
    source: str
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) turns
    text: str | None = None
    answer: str | None = None  # the expected answer, tokenized after the prompt (a scored span)
    expected_output: Any = None  # ARC: the test's output grid where the task gives it (scores a continuation)
    generation_prompt: bool = True  # a chat ends with the template's assistant generation prompt
    columns: tuple[tuple[str, Any], ...] = ()  # the kept columns' (name, value)
    answer_texts: tuple[str, ...] = ()  # a metric's answer and wrong answer (--answer_columns), untokenized
    origin: str = ""  # where the record was read (file and row), for a rejection after formatting


@dataclasses.dataclass(frozen=True)
class SampleFormat:
    """How records become samples: the format and its fields, and the kept columns' types."""
    format: str
    text_field: str = "text"
    include_answers: bool = False
    messages_field: str | None = None   # chat: the conversation column (None: messages, else conversations)
    prompt_field: str = "prompt"        # pair
    response_field: str | None = "response"  # pair; None: prompts alone, with the generation prompt
    add_generation_prompt: bool = False  # chat: end on the assistant's generation prompt
    columns: tuple[tuple[str, str], ...] = ()  # kept columns: (name, type) (transforms/columns.py)
    answer_columns: tuple[str, ...] = ()  # the answer and wrong answer's columns, each one token

    def __post_init__(self):
        if self.format not in FORMATS:
            raise UserError(f"unknown format {self.format!r} (choose from {', '.join(FORMATS)})")


def detect_format(record: Any, text_field: str, messages: str | None = None, prompt_field: str = "prompt",
                  response_field: str | None = "response") -> str:
    """The format of a record from its shape; raises ``UserError`` if none fits."""
    if is_arc_record(record):
        return "arc"
    if messages_field(record, messages) is not None:
        return "chat"
    if isinstance(record, dict) and prompt_field in record and (response_field is None or response_field in record):
        return "pair"
    if isinstance(record, dict) and text_field in record:
        return "fineweb"
    keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
    raise UserError(f"cannot detect the format of records like {keys}: pass --format arc|fineweb|chat|pair "
                    "(or name the column: --text_field, --messages_field, --prompt_field)")


def arc_samples(item: SourceRecord, include_answers: bool = False) -> list[Sample]:
    """One sample per test input of an ARC task; source = ``task_id:test_index``. With
    ``include_answers``, the test's expected output (where the task has it) is the answer; it is
    the sample's ``expected_output`` either way (a task whose outputs are malformed keeps none
    there, and is rejected only with ``include_answers``)."""
    try:
        task = parse_arc_task(_object(item), default_id=item.origin, with_outputs=True)
    except RejectedRecord:
        if include_answers:
            raise
        task = parse_arc_task(_object(item), default_id=item.origin)
    outputs = task.test_outputs
    return [Sample(make_sample_id(item.file_index, item.row, i), f"{task.task_id}:{i}",
                   messages=tuple((m["role"], m["content"]) for m in arc_messages(task, i)),
                   answer=arc_answer(task, i) if include_answers else None,
                   expected_output=outputs[i] if i < len(outputs) else None)
            for i in range(len(task.test_inputs))]


def text_samples(item: SourceRecord, text_field: str) -> list[Sample]:
    """One sample per document; source = the record's ``id``, else ``url``, else its position."""
    record = _object(item)
    if text_field not in record:
        raise RejectedRecord("missing_field", f"record has no {text_field!r} field")
    text = record[text_field]
    if not isinstance(text, str) or not text.strip():
        raise RejectedRecord("empty_text", f"{text_field!r} is empty or not a string")
    source = record.get("id") or record.get("url") or item.origin
    return [Sample(make_sample_id(item.file_index, item.row), str(source), text=text)]


def chat_samples(item: SourceRecord, fmt: SampleFormat) -> list[Sample]:
    """One sample per conversation (``chat``) or prompt/response pair (``pair``); source = the
    record's ``id``, else ``conversation_id``, else its position."""
    record = _object(item)
    if fmt.format == "chat":
        field = messages_field(record, fmt.messages_field)
        if field is None:
            named = fmt.messages_field or " or ".join(MESSAGE_FIELDS)
            raise RejectedRecord("missing_field", f"record has no conversation column ({named})")
        turns, generation_prompt = conversation(record[field]), fmt.add_generation_prompt
    else:
        turns = prompt_response(record, fmt.prompt_field, fmt.response_field)
        generation_prompt = fmt.response_field is None
    source = record.get("id") or record.get("conversation_id") or item.origin
    return [Sample(make_sample_id(item.file_index, item.row), str(source), messages=turns,
                   generation_prompt=generation_prompt)]


def _object(item: SourceRecord) -> dict:
    if not isinstance(item.record, dict):
        raise RejectedRecord("not_a_record", f"expected a JSON object, got {type(item.record).__name__}")
    return item.record


def samples_from_record(item: SourceRecord, fmt: SampleFormat) -> list[Sample]:
    """The samples of one source record, each with the record's kept columns and origin; raises
    ``RejectedRecord`` for an invalid one."""
    if item.parse_error is not None:
        raise RejectedRecord("invalid_json", item.parse_error)
    if fmt.format == "arc":
        samples = arc_samples(item, fmt.include_answers)
    elif fmt.format == "fineweb":
        samples = text_samples(item, fmt.text_field)
    else:
        samples = chat_samples(item, fmt)
    columns = kept_values(item.record, dict(fmt.columns)) if fmt.columns else ()
    answers = answer_texts(item.record, fmt.answer_columns) if fmt.answer_columns else ()
    return [dataclasses.replace(s, columns=columns, answer_texts=answers, origin=item.origin) for s in samples]


def answer_texts(record: dict, names: tuple[str, ...]) -> tuple[str, ...]:
    """The texts of a record's answer columns (``--answer_columns``); ``RejectedRecord`` for one
    that is missing or not a non-empty string."""
    texts = tuple(record.get(name) for name in names)
    bad = next((name for name, text in zip(names, texts) if not isinstance(text, str) or not text), None)
    if bad is not None:
        raise RejectedRecord("missing_answer", f"answer column {bad!r} is missing, empty or not a string")
    return texts


class _FormatFn(beam.DoFn):
    def __init__(self, fmt: SampleFormat):
        self._fmt = fmt

    def process(self, item: SourceRecord) -> Iterator[Any]:
        try:
            yield from samples_from_record(item, self._fmt)
        except RejectedRecord as e:
            count_rejection(e.reason)
            yield pvalue.TaggedOutput(REJECTED_TAG,
                                      rejection(e, item.origin, item.file_index, item.row, item.record))


class FormatSamples(beam.PTransform):
    """``SourceRecord``s -> ``Sample``s (main output) and dead-letter dicts (``rejected``)."""

    def __init__(self, fmt: SampleFormat):
        super().__init__()
        self._fmt = fmt

    def expand(self, records):
        return records | beam.ParDo(_FormatFn(self._fmt)).with_outputs(REJECTED_TAG, main="samples")
