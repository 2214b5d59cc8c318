"""Reading a machine's stream (one file or ordered parts, ``common/stream_reader.py``): the stream
the flags name and the columns it keeps; the length pre-check of ``--long_samples error``; the
record count for the status."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

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
