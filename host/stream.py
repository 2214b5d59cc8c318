"""Reading a machine's stream (one file or ordered parts, ``common/stream_reader.py``): the stream
the flags name, its validated records from a position, checked against the checkpoint; the length
pre-check of ``--long_samples error``; the record count for the status."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterator

from common.cli import UserError
from common.stream_format import StreamFormatError, parse_stream_line
from common.stream_reader import Stream, machine_stream, manifest_document, manifest_entries, open_stream
from host.progress import Progress
from transforms.long_samples import SampleTooLong, too_long_message

if TYPE_CHECKING:
    from host.config import HostConfig

log = logging.getLogger("runners.tpu_host")


def runner_stream(config: HostConfig) -> Stream:
    """``--dataset_stream`` (a file or a directory of parts), else machine N's stream in
    ``--streams_dir``, its parts as the manifest there lists them."""
    if config.dataset_stream:
        return open_stream(config.dataset_stream)
    entry = manifest_entries(config.streams_dir).get(config.machine_id)
    return machine_stream(config.streams_dir, config.machine_id, entry)


def kept_column_types(config: HostConfig) -> dict[str, str]:
    """The types of the columns the streams keep (``pipeline.prepare --keep_columns``), from the
    manifest of ``--streams_dir`` ({} without one, or for an explicit ``--dataset_stream``: the
    index then types each column by its values)."""
    if not config.streams_dir:
        return {}
    return dict(manifest_document(config.streams_dir).get("keep_columns") or {})


def stream_records(stream: Stream, start: int, limit: int | None,
                   checkpoint_at: tuple[int, int] | None) -> Iterator[dict]:
    """Records ``start..limit-1`` of the stream, validated. ``checkpoint_at`` = (position, sample
    id) of the last covered record: the stream must still have it there (it must not change
    under a resume)."""
    first = start if checkpoint_at is None else min(start, checkpoint_at[0])
    for line in stream.lines(first, limit):
        if checkpoint_at is not None and line.position == checkpoint_at[0]:
            if parse_stream_line(line.text, line.where)["sample_id"] != checkpoint_at[1]:
                raise UserError(f"{line.part} changed since the checkpoint: line {line.number} is no "
                                f"longer sample {checkpoint_at[1]}")
        if line.position >= start:
            yield parse_stream_line(line.text, line.where)


def check_lengths(stream: Stream, start: int, limit: int | None, max_seq_length: int, new_tokens: int = 0) -> None:
    """``--long_samples error``, before the model loads: the first record from ``start`` longer
    than ``max_seq_length`` less the ``new_tokens`` a continuation may add stops the run. A
    malformed line ends the check (the run reports it when it gets there, after storing what comes
    before it)."""
    for line in stream.lines(start, limit):
        try:
            record = parse_stream_line(line.text, line.where)
        except StreamFormatError:
            return
        if record["num_tokens"] > max_seq_length - new_tokens:
            raise SampleTooLong(too_long_message(record, max_seq_length - new_tokens, line.where, new_tokens))


def count_records(progress: Progress, stream: Stream, max_samples: int | None) -> None:
    """Sets ``samples_total`` of the status once the stream's records are counted (the manifest's
    counts, else its lines, in the background: a large ``gs://`` stream takes a while, and nothing
    waits for the number)."""
    try:
        total = stream.count()
    except Exception as e:  # the run itself reports an unreadable stream
        log.debug("could not count %s: %s", stream.name, e)
        return
    progress.samples_total = total if max_samples is None else min(total, max_samples)
