import pytest

from common.cli import UserError
from transforms.ids import make_sample_id
from transforms.rejections import RejectedRecord
from transforms.samples import detect_format, samples_from_record
from transforms.sources import SourceRecord

TASK = {"id": "t1", "train": [{"input": [[1]], "output": [[2]]}],
        "test": [{"input": [[3]]}, {"input": [[4]]}]}


def record(value, file_index=1, row=5, parse_error=None):
    return SourceRecord(file_index, row, f"f:{row}", value, parse_error)


def test_one_arc_sample_per_test_input():
    samples = samples_from_record(record(TASK), "arc", "text")
    assert [(s.sample_id, s.source) for s in samples] == [
        (make_sample_id(1, 5, 0), "t1:0"), (make_sample_id(1, 5, 1), "t1:1")]
    assert samples[0].messages[0][0] == "system" and samples[0].text is None


def test_text_sample_keeps_id_or_url_as_source():
    with_id = samples_from_record(record({"text": "hello", "id": "<urn:1>", "url": "u"}), "fineweb", "text")
    with_url = samples_from_record(record({"content": "hello", "url": "http://x"}), "fineweb", "content")
    bare = samples_from_record(record({"text": "hello"}), "fineweb", "text")
    assert [s.source for s in with_id + with_url + bare] == ["<urn:1>", "http://x", "f:5"]
    assert with_id[0].text == "hello" and with_id[0].sample_id == make_sample_id(1, 5)


@pytest.mark.parametrize("value, fmt, reason", [
    ({"text": "   "}, "fineweb", "empty_text"),
    ({"text": None}, "fineweb", "empty_text"),
    ({"body": "x"}, "fineweb", "missing_field"),
    ([1, 2], "fineweb", "not_a_record"),
    ({**TASK, "test": [{"input": [[1, 2], [3]]}]}, "arc", "non_rectangular_grid"),
])
def test_invalid_records_raise_with_reason(value, fmt, reason):
    with pytest.raises(RejectedRecord) as e:
        samples_from_record(record(value), fmt, "text")
    assert e.value.reason == reason


def test_unparseable_row_is_invalid_json():
    with pytest.raises(RejectedRecord) as e:
        samples_from_record(record(None, parse_error="invalid JSON: x"), "fineweb", "text")
    assert e.value.reason == "invalid_json"


def test_detect_format():
    assert detect_format(TASK, "text") == "arc"
    assert detect_format({"examples": []}, "text") == "arc"
    assert detect_format({"text": "x"}, "text") == "fineweb"
    with pytest.raises(UserError, match="cannot detect the format"):
        detect_format({"body": "x"}, "text")
