"""The records an experiment scores: a stream's first records, cut to the longest sequence."""

from __future__ import annotations

import dataclasses

from common.stream_reader import open_streams, stream_records


@dataclasses.dataclass(frozen=True)
class Record:
    sample_id: int
    source: str
    input_ids: tuple[int, ...]   # at most max_seq_length tokens
    answer_start: int | None     # first scored token: the expected answer (ARC --include_answers)
    truncated: bool              # cut here to max_seq_length
    roles: list | None = None    # its tokens' role runs (common.roles), uncut; None: a stream from before roles
    columns: dict | None = None  # the dataset's kept columns (pipeline.prepare --keep_columns)
    answers: tuple[int, ...] | None = None  # its answer and wrong answer tokens (--answer_columns)


def read_records(stream: str, max_samples: int | None, max_seq_length: int) -> list[Record]:
    """The first ``max_samples`` records (all if None) of a stream (a file, or a directory of its
    parts; or a prepare's output directory, with its manifest: every machine's stream in machine
    order), validated, each cut to ``max_seq_length`` tokens (its answer may then be cut too, or lie
    wholly past the cut)."""
    records = []
    for found in open_streams(stream):
        left = None if max_samples is None else max_samples - len(records)
        if left == 0:
            break
        records += [Record(r["sample_id"], r.get("source", ""), tuple(r["input_ids"][:max_seq_length]),
                           r.get("answer_start"), len(r["input_ids"]) > max_seq_length, r.get("roles"),
                           r.get("columns"), tuple(r["answers"]) if r.get("answers") else None)
                    for r in stream_records(found, 0, left, None)]
    return records
