"""``common/stream_reader.py``: a stream in parts reads as the one file it was split from, with
global positions; a read from a later position passes over the manifest-counted parts before it
unopened; errors name the part and its line. Also ``split_stream``, the other modules' way to make
a parted stream from a single-file one (by hand, as the spec lays it out)."""

import json
import pathlib
from typing import Sequence

import pytest

from common.cli import UserError
from common.stream_format import StreamFormatError, json_line, part_filename, stream_dirname, stream_filename
from common.stream_reader import StreamNotFound, machine_stream, manifest_entries, open_stream, stream_records


def split_stream(streams: pathlib.Path, machine: int, cuts: Sequence[int]) -> list[pathlib.Path]:
    """Replaces ``stream_NNN.jsonl`` in ``streams`` by its parts ``stream_NNN/part-PPPPP.jsonl``,
    cut before the given positions, and gives its manifest entry (where there is a manifest) the
    spec's ``parts``; returns the parts."""
    single = streams / stream_filename(machine)
    lines = single.read_bytes().splitlines(keepends=True)
    bounds = [0, *cuts, len(lines)]
    (streams / stream_dirname(machine)).mkdir()
    parts, described = [], []
    for p, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        part = streams / part_filename(machine, p)
        part.write_bytes(b"".join(lines[a:b]))
        ids = [json.loads(line)["sample_id"] for line in lines[a:b]]
        described.append({"file": part_filename(machine, p), "samples": b - a,
                          "tokens": sum(json.loads(line)["num_tokens"] for line in lines[a:b]),
                          "bytes": part.stat().st_size, "first_id": min(ids, default=None),
                          "last_id": max(ids, default=None)})
        parts.append(part)
    single.unlink()
    manifest_path = streams / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        for entry in manifest["machines"]:
            if entry["machine"] == machine:
                entry["parts"] = described
        manifest["streams"] = [f"{stream_dirname(machine)}/" if name == stream_filename(machine) else name
                               for name in manifest.get("streams", [])]
        manifest_path.write_text(json.dumps(manifest))
    return parts


def records(n: int) -> list[dict]:
    return [{"sample_id": 10 * i + 3, "input_ids": [i + 1] * (i % 3 + 1), "num_tokens": i % 3 + 1,
             "source": f"s{i}", "text_preview": f"p{i}"} for i in range(n)]


@pytest.fixture
def streams(tmp_path) -> pathlib.Path:
    """Machine 0's 10 records as one file (``single/``) and in parts of 3, 4 and 3 (``parted/``),
    each with a manifest."""
    lines = "".join(json_line(r) for r in records(10))
    for name in ("single", "parted"):
        (tmp_path / name).mkdir()
        (tmp_path / name / stream_filename(0)).write_text(lines)
        (tmp_path / name / "manifest.json").write_text(json.dumps({"machines": [
            {"machine": 0, "samples": 10, "stream_bytes": len(lines),
             "parts": [{"file": stream_filename(0), "samples": 10, "bytes": len(lines)}]}]}))
    split_stream(tmp_path / "parted", 0, [3, 7])
    return tmp_path


def read(streams_dir: pathlib.Path, start: int = 0, limit: int | None = None, manifest: bool = True):
    entry = manifest_entries(str(streams_dir)).get(0) if manifest else None
    return [(line.position, line.text) for line in machine_stream(str(streams_dir), 0, entry).lines(start, limit)]


def test_parts_read_as_the_file_from_any_position(streams):
    whole = read(streams / "single")
    assert [p for p, _ in whole] == list(range(10))
    for start in range(11):
        for limit in (None, 0, 3, 5, 7, 10):
            expected = [(p, t) for p, t in whole if p >= start and (limit is None or p < limit)]
            assert read(streams / "parted", start, limit) == expected
            assert read(streams / "parted", start, limit, manifest=False) == expected


def test_a_later_start_does_not_open_the_parts_before_it(streams):
    parted = streams / "parted"
    (parted / part_filename(0, 0)).unlink()  # positions 0..2
    stream = machine_stream(str(parted), 0, manifest_entries(str(parted))[0])
    assert read(parted, 3) == read(streams / "single", 3)
    # The runner's read from a checkpoint at position 5 (its record at 4): the same records.
    assert list(stream_records(stream, 5, None, (4, 43))) == records(10)[5:]
    assert stream.count() == 10  # the manifest's counts: nothing read
    with pytest.raises(StreamNotFound, match=f"cannot open stream '{parted / part_filename(0, 0)}'"):
        read(parted, 2)


def test_an_explicit_directory_of_parts(streams):
    parted = open_stream(str(streams / "parted" / stream_dirname(0)))
    single = open_stream(str(streams / "single" / stream_filename(0)))
    assert [p.samples for p in parted.parts] == [None] * 3  # no manifest: counted by reading
    assert [(x.position, x.text) for x in parted.lines(5)] == [(x.position, x.text) for x in single.lines(5)]
    assert parted.count() == single.count() == 10
    (streams / "empty").mkdir()
    with pytest.raises(UserError, match="holds no part-"):
        open_stream(str(streams / "empty"))


def test_errors_name_the_part_and_its_line(streams):
    part = streams / "parted" / part_filename(0, 1)
    lines = part.read_text().splitlines(keepends=True)
    part.write_text(lines[0] + '{"sample_id": 1}\n' + "".join(lines[2:]))
    stream = machine_stream(str(streams / "parted"), 0, manifest_entries(str(streams / "parted"))[0])
    with pytest.raises(StreamFormatError, match=f"^{part}:2: missing field"):
        list(stream_records(stream, 0, None, None))
    with pytest.raises(UserError, match=f"^{part} changed since the checkpoint: line 1 is no longer sample 1$"):
        list(stream_records(stream, 4, None, (3, 1)))


def test_gcs_parts(streams, gcs):
    from tests.test_fleet_errors import upload_streams
    parted = streams / "parted"
    bucket = gcs.client().bucket("acts")
    for p in range(3):
        bucket.blob(f"streams/{part_filename(0, p)}").upload_from_filename(str(parted / part_filename(0, p)))
    url = upload_streams(gcs, parted)  # the manifest
    expected = [(x.position, x.text) for x in open_stream(str(streams / "single" / stream_filename(0))).lines(4)]
    with_counts = machine_stream(url, 0, manifest_entries(url)[0])
    listed = machine_stream(url, 0)  # no manifest entry: the listing of stream_000/
    for stream in (with_counts, listed, open_stream(f"{url}/{stream_dirname(0)}")):
        assert [(x.position, x.text) for x in stream.lines(4)] == expected
        assert stream.parts[1].path == f"{url}/{part_filename(0, 1)}"
    assert listed.count() == with_counts.count() == 10
