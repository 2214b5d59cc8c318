"""The records an experiment scores: a stream's first records, cut to the longest sequence."""

from __future__ import annotations

import dataclasses

from common.stream_reader import open_stream
from host.stream import stream_records


@dataclasses.dataclass(frozen=True)
class Record:
    sample_id: int
    source: str
    input_ids: tuple[int, ...]   # at most max_seq_length tokens
    answer_start: int | None     # first scored token: the expected answer (ARC --include_answers)
    truncated: bool              # cut here to max_seq_length
    roles: list | None = None    # its tokens' role runs (common.roles), uncut; None: a stream from before roles


def read_records(stream: str, max_samples: int | None, max_seq_length: int) -> list[Record]:
    """The first ``max_samples`` records (all if None) of a stream (a file, or a directory of its
    parts), validated, each cut to ``max_seq_length`` tokens (its answer may then be cut too, or lie
    wholly past the cut)."""
    return [Record(r["sample_id"], r.get("source", ""), tuple(r["input_ids"][:max_seq_length]),
                   r.get("answer_start"), len(r["input_ids"]) > max_seq_length, r.get("roles"))
            for r in stream_records(open_stream(stream), 0, max_samples, None)]
