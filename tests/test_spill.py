"""The spill files that carry stream lines from tokenizing to the part writers."""

from apache_beam.pvalue import TaggedOutput

from common.files import delete_tree, match, write_bytes
from transforms.ids import make_sample_id
from transforms.partition import bucket_of
from transforms.spill import (SPILL_DIR, LineInfo, SpillLines, SpillSection, StreamEntry, decode_section,
                              encode_spill, part_entries, spill_bytes)

BUCKETS = 8


def entry(file_index: int, row: int, size: int = 10) -> StreamEntry:
    sample_id = make_sample_id(file_index, row)
    return StreamEntry(sample_id, row % 7, row % 3 == 0, f'{{"sample_id": {sample_id}}}'.ljust(size).encode() + b"\n")


def test_a_spill_file_is_one_section_per_bucket_sorted_by_id():
    entries = [entry(0, row) for row in (9, 3, 5, 0, 7, 1, 8, 2, 6, 4)]
    data, sections = encode_spill(entries, BUCKETS)
    assert [s[0] for s in sections] == sorted({bucket_of(e.sample_id, BUCKETS) for e in entries})
    assert sum(s[2] for s in sections) == len(data) and sections[0][1] == 0
    decoded = []
    for bucket, offset, length, first, last in sections:
        rows = list(decode_section(data[offset:offset + length]))
        assert [e.sample_id for e in rows] == sorted(e.sample_id for e in entries
                                                     if bucket_of(e.sample_id, BUCKETS) == bucket)
        assert (first, last) == (rows[0].sample_id, rows[-1].sample_id)
        decoded += rows
    assert sorted(decoded) == sorted(entries)  # ids, counts, truncated and lines all come back


def test_a_part_reads_only_its_id_range_of_the_sections(tmp_path):
    entries = [entry(0, row) for row in range(40)]
    data, sections = encode_spill(entries, BUCKETS)
    path = str(tmp_path / "spill.bin")
    write_bytes(path, data)
    spilled = [SpillSection(path, *s) for s in sections]
    lo, hi = make_sample_id(0, 10), make_sample_id(0, 25)
    got = part_entries(spilled, lo, hi)
    assert sorted(got) == [e for e in entries if lo <= e.sample_id < hi]
    assert sorted(part_entries(spilled, hi, None)) == entries[25:]


def test_spill_bytes_follow_the_part_size_within_bounds():
    assert spill_bytes(16_000_000) == 16_000_000
    assert spill_bytes(10_000) == 1_000_000 and spill_bytes(10**9) == spill_bytes(None) == 64_000_000


def spill_run(tmp_path, entries, max_bytes) -> tuple[list[LineInfo], list[SpillSection]]:
    """One bundle of ``entries`` through ``SpillLines``: its infos and sections."""
    fn = SpillLines(str(tmp_path / SPILL_DIR), BUCKETS, max_bytes)
    fn.start_bundle()
    outputs = [o for e in entries for o in fn.process(e)]
    infos = [o for o in outputs if isinstance(o, LineInfo)]
    sections = [o.value for o in outputs if isinstance(o, TaggedOutput)]
    sections += [o.value.value for o in fn.finish_bundle()]  # windowed: finish_bundle's outputs
    assert all(isinstance(o, LineInfo) or o.tag == SpillLines.SECTIONS for o in outputs)
    return infos, sections


def test_spill_files_break_at_the_size_limit_and_where_rows_stop_being_consecutive(tmp_path):
    # Two slices of file 1 (the second far after the first), then one of file 0: three runs.
    entries = ([entry(1, row, 50) for row in range(0, 20)] + [entry(1, row, 50) for row in range(20_000, 20_010)]
               + [entry(0, row, 50) for row in range(0, 10)])
    infos, sections = spill_run(tmp_path, entries, max_bytes=15 * 51)
    assert infos == list(LineInfo(e.sample_id, e.num_tokens, len(e.line)) for e in entries)
    files = sorted({s.path for s in sections})
    assert files == match(str(tmp_path / SPILL_DIR / "*.bin"))
    # 20 rows at 15 a file: 2 files; then 10 and 10 rows: one file each.
    assert len(files) == 4
    spans = sorted((min(s.first_id for s in sections if s.path == f), max(s.last_id for s in sections if s.path == f))
                   for f in files)
    rows = [(0, 0, 9), (1, 0, 14), (1, 15, 19), (1, 20_000, 20_009)]  # (file, first row, last row)
    assert spans == [(make_sample_id(f, a), make_sample_id(f, b)) for f, a, b in rows]
    assert sorted(part_entries(sections, 0, None)) == sorted(entries)


def test_delete_tree_on_gcs_deletes_the_prefix_only(gcs):
    bucket = gcs.client().bucket("acts")
    for name in ("out/_spill/a.bin", "out/_spill/b.bin", "out/_spill_other.bin", "out/stream_000.jsonl"):
        bucket.blob(name).upload_from_string(b"x")
    delete_tree("gs://acts/out/_spill")
    assert sorted(b.name for b in gcs.client().list_blobs("acts")) == ["out/_spill_other.bin", "out/stream_000.jsonl"]
    delete_tree("gs://acts/out/_spill")  # nothing there: not an error


def test_delete_tree_locally(tmp_path):
    (tmp_path / "_spill").mkdir()
    (tmp_path / "_spill" / "a.bin").write_bytes(b"x")
    delete_tree(str(tmp_path / "_spill"))
    assert not (tmp_path / "_spill").exists()
    delete_tree(str(tmp_path / "_spill"))
