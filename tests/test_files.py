import re

import pytest

from common.files import _glob_regex, binary_lines, count_lines, match, open_read


def test_gcs_glob_semantics():
    assert re.fullmatch(_glob_regex("a/*.jsonl"), "a/x.jsonl")
    assert not re.fullmatch(_glob_regex("a/*.jsonl"), "a/b/x.jsonl")
    assert re.fullmatch(_glob_regex("a/**"), "a/b/c/index/shard_0001.parquet")
    assert re.fullmatch(_glob_regex("d/part-0[0-2].parquet"), "d/part-01.parquet")
    assert not re.fullmatch(_glob_regex("d/part-0?.parquet"), "d/part-0/x.parquet")


def test_local_match_is_sorted_files_only(tmp_path):
    (tmp_path / "b").mkdir()
    for name in ["b/2.json", "1.json", "b/x.txt"]:
        (tmp_path / name).write_text("{}")
    assert match(str(tmp_path / "**" / "*.json")) == [str(tmp_path / "1.json"), str(tmp_path / "b" / "2.json")]
    assert match(str(tmp_path / "*")) == [str(tmp_path / "1.json")]


@pytest.mark.parametrize("data", [b"", b"a\n", b"a\nbb\n", b"a\nbb", b"\n\nccc\n", b"x" * 10 + b"\ny"])
def test_binary_lines_and_count_lines_agree_with_splitlines(tmp_path, data):
    (tmp_path / "f").write_bytes(data)
    with open(tmp_path / "f", "rb") as f:
        assert list(binary_lines(f, chunk_bytes=3)) == data.splitlines(keepends=True)
    assert count_lines(str(tmp_path / "f")) == len(data.splitlines())


def test_lines_of_a_gcs_object(gcs):
    data = b"".join(b'{"n": %d}\n' % i for i in range(1000))
    gcs.client().bucket("acts").blob("s/stream_000.jsonl").upload_from_string(data)
    with open_read("gs://acts/s/stream_000.jsonl") as f:
        assert list(binary_lines(f, chunk_bytes=1000)) == data.splitlines(keepends=True)
    assert count_lines("gs://acts/s/stream_000.jsonl") == 1000
