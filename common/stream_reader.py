"""Reading one machine's stream, whether ``pipeline.prepare`` wrote it as one file or in parts, as
one sequence of lines.

A stream is ``stream_NNN.jsonl``, or, past ``--max_part_mb``, the ordered parts
``stream_NNN/part-00000.jsonl``, ``part-00001.jsonl``, ... whose concatenation is that file; the
manifest lists each machine's parts with their record counts. Every reader of streams (the runner,
the fleet's merge, the token ids of the exports, ``runners.ablate``) goes through here: positions
count lines across the parts (0-based), a read from a later position passes over the parts before
it unopened where the manifest counts their records, and an error names the part and its line;
``stream_records`` gives the validated records from a position.
Local, ``gs://`` and ``hf://`` alike (``common/files.py``); needs neither Beam nor JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import IO, Any, Iterator, Mapping, NamedTuple

from common.cli import UserError
from common.files import binary_lines, count_lines, file_size, join, match, open_read, read_optional
from common.stream_format import StreamFormatError, parse_stream_line, stream_dirname, stream_filename

PART_GLOB = "part-*.jsonl"  # the parts of a parted stream; their names sort in stream order


class StreamNotFound(UserError):
    """A stream file or part that does not exist (``path``)."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


@dataclasses.dataclass(frozen=True)
class Part:
    path: str
    samples: int | None = None  # its records (= lines), from the manifest; None: known once read
    bytes: int | None = None    # its size, from the manifest


class StreamLine(NamedTuple):
    position: int  # 0-based, across the parts
    text: str      # with its newline
    part: str      # the part file holding it
    number: int    # 1-based line of that part

    @property
    def where(self) -> str:
        """``part:line``, for error messages."""
        return f"{self.part}:{self.number}"


@dataclasses.dataclass(frozen=True)
class Stream:
    name: str                # the file, or the directory of the parts (messages, metadata.json)
    parts: tuple[Part, ...]  # in stream order

    def raw_lines(self, start: int = 0, limit: int | None = None) -> Iterator[tuple[int, bytes, str, int]]:
        """(position, line bytes with the newline, part, line of the part) of positions
        ``start..limit-1`` (to the end if None). Parts wholly before ``start`` whose records the
        manifest counts are not opened; a part without a count is read to count it."""
        first = 0  # position of the part's first line
        for part in self.parts:
            if limit is not None and first >= limit:
                return
            if part.samples is not None and first + part.samples <= start:
                first += part.samples
                continue
            number = 0
            with _open(part.path) as handle:
                for number, raw in enumerate(binary_lines(handle), 1):
                    position = first + number - 1
                    if limit is not None and position >= limit:
                        return
                    if position >= start:
                        yield position, raw, part.path, number
            first += number

    def lines(self, start: int = 0, limit: int | None = None) -> Iterator[StreamLine]:
        """``raw_lines`` as text (UTF-8, or a ``StreamFormatError`` naming the part and line)."""
        for position, raw, part, number in self.raw_lines(start, limit):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise StreamFormatError(f"{part}:{number}: not UTF-8 text") from None
            yield StreamLine(position, text, part, number)

    def count(self) -> int:
        """Records of the stream: the manifest's counts, lines counted where it has none."""
        return sum(p.samples if p.samples is not None else count_lines(p.path) for p in self.parts)

    def sizes(self) -> list[int]:
        """Each part's size in bytes, one metadata request a part; ``StreamNotFound`` for a
        missing one."""
        sizes = [file_size(p.path) for p in self.parts]
        missing = [p.path for p, size in zip(self.parts, sizes) if size is None]
        if missing:
            raise StreamNotFound(missing[0], f"no stream {missing[0]}")
        return sizes


def _open(path: str) -> IO[bytes]:
    try:
        return open_read(path)
    except FileNotFoundError as e:
        raise StreamNotFound(path, f"cannot open stream {path!r}: {str(e).splitlines()[0]}") from None
    except Exception as e:
        raise UserError(f"cannot open stream {path!r}: {str(e).splitlines()[0]}") from None


def manifest_document(streams_dir: str) -> dict[str, Any]:
    """The prepare manifest in ``streams_dir`` ({} without one)."""
    path = join(streams_dir, "manifest.json")
    try:
        data = read_optional(path)
    except Exception as e:
        raise UserError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    try:
        return json.loads(data) if data is not None else {}
    except ValueError as e:
        raise UserError(f"{path} is not a manifest of pipeline.prepare ({e!r})") from None


def manifest_entries(streams_dir: str) -> dict[int, Mapping[str, Any]]:
    """The machine entries of the prepare manifest in ``streams_dir``, by machine ({} without one)."""
    document = manifest_document(streams_dir)
    if not document:
        return {}
    try:
        return {int(e["machine"]): e for e in document["machines"]}
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{join(streams_dir, 'manifest.json')} is not a manifest of pipeline.prepare ({e!r})") from None


def machine_stream(streams_dir: str, machine: int, entry: Mapping[str, Any] | None = None) -> Stream:
    """Machine ``machine``'s stream in ``streams_dir``: the parts its manifest entry (``entry``)
    lists, or ``stream_NNN.jsonl`` for an entry without them (a prepare from before parts). Without
    an entry (no manifest): ``stream_NNN.jsonl`` where it exists, else the ``stream_NNN/part-*.jsonl``
    there; neither: ``stream_NNN.jsonl``, which a read then reports missing."""
    single = join(streams_dir, stream_filename(machine))
    if entry is not None and entry.get("parts"):
        parts = tuple(Part(join(streams_dir, p["file"]), p.get("samples"), p.get("bytes")) for p in entry["parts"])
        return Stream(parts[0].path if len(parts) == 1 else join(streams_dir, stream_dirname(machine)), parts)
    if entry is None and file_size(single) is None:
        directory = join(streams_dir, stream_dirname(machine))
        found = match(join(directory, PART_GLOB))
        if found:
            return Stream(directory, tuple(Part(p) for p in found))
    return Stream(single, (Part(single),))


def _may_be_directory(path: str) -> bool:
    """A local directory, or on gs:// (where a "directory" is a prefix) a path not naming a .jsonl file."""
    return os.path.isdir(path) if "://" not in path else path.startswith("gs://") and not path.endswith(".jsonl")


def open_stream(path: str) -> Stream:
    """An explicit stream (``--dataset_stream``, ``--stream``, a runner's recorded stream): a file,
    or a directory of ``part-*.jsonl`` read in name order. No manifest counts the parts, so a read
    from a later position reads the earlier parts' lines."""
    if _may_be_directory(path):  # on gs://, one listing
        found = match(join(path, PART_GLOB))
        if found:
            return Stream(path, tuple(Part(p) for p in found))
        if "://" not in path:
            raise UserError(f"stream directory {path} holds no {PART_GLOB} files")
    return Stream(path, (Part(path),))


def open_streams(path: str) -> list[Stream]:
    """The streams ``path`` names: a prepare's output directory (its manifest) every machine's, in
    machine order; else the one ``open_stream`` opens."""
    machines = manifest_entries(path) if _may_be_directory(path) else {}
    if machines:
        return [machine_stream(path, machine, entry) for machine, entry in sorted(machines.items())]
    return [open_stream(path)]


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
