import re

from common.files import _glob_regex, match


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
