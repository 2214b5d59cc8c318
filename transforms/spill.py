"""Stream lines spilled to files where they are made, so that only references to them travel.

A runner's shuffle would carry every line to the worker writing its part. On Dataflow that is
fine, but the local runner keeps each PCollection between stages in memory (a run held ~6 bytes
for each byte of stream) and its worker processes pass every element through the launcher. So
``SpillLines``, fused with tokenizing, writes the lines into spill files under
``{output_dir}/_spill/`` and passes on only each line's ``LineInfo`` and each file's
``SpillSection``s; the writer of a part reads just the sections it needs (``part_entries``). This
is how Beam's own file sinks work too: temporary files written per bundle, then finalized.

A spill file holds the lines of consecutive source rows (a flush comes at ``max_bytes`` and
wherever the rows stop being consecutive: another file, a row before the last, or one far
after), in one section per hash bucket (``partition.bucket_of``), each sorted by id. The machine
of a bucket is only known once every sample is tokenized (``PlanMachines``), but its sections are
already apart, and their id ranges are narrow: a part's writer reads, of each file, the few
sections of its machine that overlap its id range. A record is ``HEADER`` (sample id, token
count, truncated, line bytes) then the line. File names are random, so a retried bundle's files
never collide; the whole directory is deleted once every part is written (``delete_spill``).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import struct
import uuid
from typing import Iterable, Iterator, NamedTuple

import apache_beam as beam
from apache_beam.transforms.window import GlobalWindows

from common.files import delete_tree, join, read_range, write_bytes
from transforms.ids import split_sample_id
from transforms.partition import bucket_of

SPILL_DIR = "_spill"
HEADER = struct.Struct("<qIBI")  # sample_id, num_tokens, truncated, line bytes
# Spill files are flushed at the part size, within these bounds: small enough that a worker's
# buffer stays below its part writer's share (~2x a part), large enough that the sections a
# part's writer reads (one ranged GET each on gs://) are not tiny.
MIN_SPILL_BYTES, MAX_SPILL_BYTES = 1_000_000, 64_000_000
# Rows that may lie between two consecutive lines of a slice (its rejected records); a slice of
# the same file read elsewhere is SLICE_ROWS (10,000) rows or more.
MAX_ROW_GAP = 1000
READ_THREADS = 8  # sections read at once by a part's writer (ranged GETs on gs://)


class StreamEntry(NamedTuple):
    """What travels from tokenizing to the writers: the line and what the manifest counts, not
    the full prompt. The line is UTF-8 bytes (its size is what parts are cut by; a ``str`` would
    take 2-4 bytes a character in memory as soon as a preview holds one wide character)."""
    sample_id: int
    num_tokens: int
    truncated: bool
    line: bytes  # one stream line, with its "\n"


class LineInfo(NamedTuple):
    """A spilled line, as the planning passes see it (machines by tokens, parts by bytes)."""
    sample_id: int
    num_tokens: int
    size: int  # bytes of the line


class SpillSection(NamedTuple):
    """Where one bucket's lines lie in one spill file, and their id range."""
    path: str
    bucket: int
    offset: int
    length: int
    first_id: int
    last_id: int


def spill_bytes(max_part_bytes: int | None) -> int:
    """A spill file's size limit for parts of ``max_part_bytes`` (None: parts without a limit)."""
    return MAX_SPILL_BYTES if max_part_bytes is None else min(max(max_part_bytes, MIN_SPILL_BYTES), MAX_SPILL_BYTES)


def encode_spill(entries: Iterable[StreamEntry],
                 num_buckets: int) -> tuple[bytes, list[tuple[int, int, int, int, int]]]:
    """A spill file's bytes and its sections as (bucket, offset, length, first_id, last_id), in
    bucket order, each section sorted by id."""
    keyed = sorted((bucket_of(e.sample_id, num_buckets), e.sample_id, e) for e in entries)
    chunks, sections, offset = [], [], 0
    for bucket, group in itertools.groupby(keyed, key=lambda k: k[0]):
        rows = [e for _, _, e in group]
        data = b"".join(HEADER.pack(e.sample_id, e.num_tokens, e.truncated, len(e.line)) + e.line
                        for e in rows)
        chunks.append(data)
        sections.append((bucket, offset, len(data), rows[0].sample_id, rows[-1].sample_id))
        offset += len(data)
    return b"".join(chunks), sections


def decode_section(data: bytes) -> Iterator[StreamEntry]:
    """The entries of one section's bytes, in order."""
    view, at = memoryview(data), 0
    while at < len(data):
        sample_id, num_tokens, truncated, size = HEADER.unpack_from(view, at)
        at += HEADER.size
        yield StreamEntry(sample_id, num_tokens, bool(truncated), bytes(view[at:at + size]))
        at += size


def part_entries(sections: Iterable[SpillSection], first_id: int, end_id: int | None) -> list[StreamEntry]:
    """The spilled entries of ``sections`` with ids in [first_id, end_id) (end None: no bound),
    the sections read concurrently (each a ranged GET on gs://)."""
    sections = list(sections)
    with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
        blobs = pool.map(lambda s: read_range(s.path, s.offset, s.length), sections)
        return [e for data in blobs for e in decode_section(data)
                if e.sample_id >= first_id and (end_id is None or e.sample_id < end_id)]


def _consecutive(previous: int, sample_id: int) -> bool:
    """Whether ``sample_id`` continues the rows of ``previous``: the same file, at most
    ``MAX_ROW_GAP`` rows further on."""
    (file, row, _), (previous_file, previous_row, _) = split_sample_id(sample_id), split_sample_id(previous)
    return file == previous_file and sample_id > previous and row - previous_row <= MAX_ROW_GAP


class SpillLines(beam.DoFn):
    """``StreamEntry`` -> its ``LineInfo`` (main output), and each spill file's ``SpillSection``s
    (output ``SECTIONS``) once it is written."""

    SECTIONS = "sections"

    def __init__(self, spill_dir: str, num_buckets: int, max_bytes: int):
        self._spill_dir = spill_dir
        self._num_buckets = num_buckets
        self._max_bytes = max_bytes

    def start_bundle(self):
        self._buffer: list[StreamEntry] = []
        self._bytes = 0

    def process(self, entry: StreamEntry) -> Iterator:
        if self._buffer and (self._bytes + len(entry.line) > self._max_bytes
                             or not _consecutive(self._buffer[-1].sample_id, entry.sample_id)):
            yield from self._flush()
        self._buffer.append(entry)
        self._bytes += len(entry.line)
        yield LineInfo(entry.sample_id, entry.num_tokens, len(entry.line))

    def finish_bundle(self) -> Iterator:
        # Outputs of finish_bundle carry their window: the pipeline's is the global one.
        for tagged in self._flush():
            yield beam.pvalue.TaggedOutput(self.SECTIONS, GlobalWindows.windowed_value(tagged.value))

    def _flush(self) -> Iterator[beam.pvalue.TaggedOutput]:
        if not self._buffer:
            return
        path = join(self._spill_dir, f"{uuid.uuid4().hex}.bin")
        data, sections = encode_spill(self._buffer, self._num_buckets)
        write_bytes(path, data)
        self._buffer, self._bytes = [], 0
        for section in sections:
            yield beam.pvalue.TaggedOutput(self.SECTIONS, SpillSection(path, *section))


def delete_spill(output_dir: str) -> None:
    """Deletes the spill directory, with the files of bundles that failed and were retried."""
    delete_tree(join(output_dir, SPILL_DIR))

