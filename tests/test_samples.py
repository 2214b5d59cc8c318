import pytest

from common.cli import UserError
from transforms.ids import make_sample_id
from transforms.rejections import RejectedRecord
from transforms.samples import SampleFormat, detect_format, samples_from_record
from transforms.sources import SourceRecord

TASK = {"id": "t1", "train": [{"input": [[1]], "output": [[2]]}],
        "test": [{"input": [[3]]}, {"input": [[4]]}]}


def record(value, file_index=1, row=5, parse_error=None):
    return SourceRecord(file_index, row, f"f:{row}", value, parse_error)


def test_one_arc_sample_per_test_input():
    samples = samples_from_record(record(TASK), SampleFormat("arc"))
    assert [(s.sample_id, s.source) for s in samples] == [
        (make_sample_id(1, 5, 0), "t1:0"), (make_sample_id(1, 5, 1), "t1:1")]
    assert samples[0].messages[0][0] == "system" and samples[0].text is None


def test_text_sample_keeps_id_or_url_as_source():
    with_id = samples_from_record(record({"text": "hello", "id": "<urn:1>", "url": "u"}), SampleFormat("fineweb"))
    with_url = samples_from_record(record({"content": "hello", "url": "http://x"}), SampleFormat("fineweb", "content"))
    bare = samples_from_record(record({"text": "hello"}), SampleFormat("fineweb"))
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
        samples_from_record(record(value), SampleFormat(fmt))
    assert e.value.reason == reason


def test_unparseable_row_is_invalid_json():
    with pytest.raises(RejectedRecord) as e:
        samples_from_record(record(None, parse_error="invalid JSON: x"), SampleFormat("fineweb"))
    assert e.value.reason == "invalid_json"


def test_detect_format():
    assert detect_format(TASK, "text") == "arc"
    assert detect_format({"examples": []}, "text") == "arc"
    assert detect_format({"text": "x"}, "text") == "fineweb"
    with pytest.raises(UserError, match="cannot detect the format"):
        detect_format({"body": "x"}, "text")


CHAT_RECORD = {"id": "c1", "label": 1, "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]},
    {"role": "assistant", "content": "4"}]}


def test_a_conversation_is_one_sample_of_its_turns_openai_or_sharegpt():
    openai, = samples_from_record(record(CHAT_RECORD), SampleFormat("chat"))
    sharegpt, = samples_from_record(record({"conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}),
        SampleFormat("chat"))
    turns = (("system", "Be brief."), ("user", "2+2?"), ("assistant", "4"))
    assert openai.messages == sharegpt.messages == turns and not openai.generation_prompt
    assert (openai.source, sharegpt.source, openai.sample_id) == ("c1", "f:5", make_sample_id(1, 5))
    asked, = samples_from_record(record(CHAT_RECORD), SampleFormat("chat", add_generation_prompt=True))
    assert asked.generation_prompt


def test_a_prompt_response_pair_is_a_user_and_an_assistant_turn():
    pair, = samples_from_record(record({"prompt": "2+2?", "response": "4"}), SampleFormat("pair"))
    alone, = samples_from_record(record({"q": "2+2?"}), SampleFormat("pair", prompt_field="q", response_field=None))
    assert pair.messages == (("user", "2+2?"), ("assistant", "4")) and not pair.generation_prompt
    assert alone.messages == (("user", "2+2?"),) and alone.generation_prompt


@pytest.mark.parametrize("messages, reason", [
    ([], "empty_conversation"),
    ("hello", "empty_conversation"),
    ([{"role": "robot", "content": "x"}], "unknown_role"),
    ([{"role": "user", "content": [{"type": "image", "url": "x"}]}], "non_text_content"),
    ([{"role": "user"}], "missing_field"),
    ([{"speaker": "user", "text": "x"}], "missing_field"),
])
def test_invalid_conversations_raise_with_reason(messages, reason):
    with pytest.raises(RejectedRecord) as e:
        samples_from_record(record({"messages": messages}), SampleFormat("chat"))
    assert e.value.reason == reason


def test_kept_columns_travel_with_each_sample_typed_and_null_where_missing():
    fmt = SampleFormat("chat", columns=(("label", "int64"), ("score", "float64"), ("topic", "string")))
    sample, = samples_from_record(record({**CHAT_RECORD, "score": 2}), fmt)
    assert sample.columns == (("label", 1), ("score", 2.0), ("topic", None))
    assert isinstance(sample.columns[1][1], float)
    with pytest.raises(RejectedRecord) as e:
        samples_from_record(record({**CHAT_RECORD, "label": "one"}), fmt)
    assert e.value.reason == "column_type" and "'one'" in e.value.detail
    arc = samples_from_record(record({**TASK, "label": 7}), SampleFormat("arc", columns=(("label", "int64"),)))
    assert [s.columns for s in arc] == [(("label", 7),)] * 2  # every test input of the task


def test_detect_chat_and_pair_formats():
    assert detect_format(CHAT_RECORD, "text") == "chat"
    assert detect_format({"conversations": []}, "text") == "chat"
    assert detect_format({"prompt": "p", "response": "r", "text": "t"}, "text") == "pair"
    assert detect_format({"prompt": "p"}, "text", response_field=None) == "pair"
    with pytest.raises(UserError, match=r"cannot detect the format of records like \['id', 'label', 'turns'\]"):
        detect_format({"id": 1, "label": 0, "turns": []}, "text")
