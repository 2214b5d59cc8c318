"""Reading a machine's stream: its lines and validated records from a position, checked against
the checkpoint; the length pre-check of ``--long_samples error``; the record count for the status.
Local, ``gs://`` and ``hf://`` streams alike, read in large chunks."""

from __future__ import annotations

import itertools
import logging
from typing import Iterator

from common.cli import UserError
from common.files import binary_lines, count_lines, open_read
from host.progress import Progress
from common.stream_format import StreamFormatError, parse_stream_line
from transforms.long_samples import SampleTooLong, too_long_message

log = logging.getLogger("runners.tpu_host")


def stream_lines(path: str, limit: int | None) -> Iterator[tuple[int, str]]:
    """(0-based line number, line) of the stream's first ``limit`` lines (all if None)."""
    try:
        handle = open_read(path)
    except Exception as e:
        raise UserError(f"cannot open stream {path!r}: {str(e).splitlines()[0]}") from None
    with handle:
        for number, raw in itertools.islice(enumerate(binary_lines(handle)), limit):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError:
                raise StreamFormatError(f"{path}:{number + 1}: not UTF-8 text") from None


def stream_records(path: str, start: int, limit: int | None,
                   checkpoint_at: tuple[int, int] | None) -> Iterator[dict]:
    """Records ``start..limit-1`` of the stream, validated. ``checkpoint_at`` = (position, sample
    id) of the last covered record: the stream must still have it there (it must not change
    under a resume)."""
    for number, line in stream_lines(path, limit):
        if checkpoint_at is not None and number == checkpoint_at[0]:
            if parse_stream_line(line, f"{path}:{number + 1}")["sample_id"] != checkpoint_at[1]:
                raise UserError(f"{path} changed since the checkpoint: line {number + 1} is no "
                                f"longer sample {checkpoint_at[1]}")
        if number >= start:
            yield parse_stream_line(line, f"{path}:{number + 1}")


def check_lengths(path: str, start: int, limit: int | None, max_seq_length: int) -> None:
    """``--long_samples error``, before the model loads: the first record from ``start`` over the
    limit stops the run. A malformed line ends the check (the run reports it when it gets there,
    after storing what comes before it)."""
    for number, line in stream_lines(path, limit):
        if number >= start:
            try:
                record = parse_stream_line(line, f"{path}:{number + 1}")
            except StreamFormatError:
                return
            if record["num_tokens"] > max_seq_length:
                raise SampleTooLong(too_long_message(record, max_seq_length, f"{path}:{number + 1}"))


def count_records(progress: Progress, stream_path: str, max_samples: int | None) -> None:
    """Sets ``samples_total`` of the status once the stream's lines are counted (in the
    background: a large ``gs://`` stream takes a while, and nothing waits for the number)."""
    try:
        total = count_lines(stream_path)
    except Exception as e:  # the run itself reports an unreadable stream
        log.debug("could not count %s: %s", stream_path, e)
        return
    progress.samples_total = total if max_samples is None else min(total, max_samples)
