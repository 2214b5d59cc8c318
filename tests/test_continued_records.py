"""What a continuation adds to a stream record (transforms/generation.py), without a model: the
roles of the tokens the model wrote (``generated``, ``thinking`` inside a thinking section), the
positions of its special tokens, and an ARC answer scored against the task's expected output."""

import pytest

from model.generate import LENGTH, STOP_TOKEN, Continuation
from transforms.arc import first_grid, grid_block, scored_answer
from common.stream_format import StreamFormatError, parse_stream_line
from transforms.generation import Continuing, continued_record, thinking_ids, written_runs

OPEN, CLOSE, END = 900, 901, 7  # a thinking section's markers, a stop token


def prompt_record(ids, **extra):
    return {"sample_id": 5, "input_ids": list(ids), "num_tokens": len(ids), "roles": [["user", len(ids)]],
            "special": [0], **extra}


def test_written_tokens_are_generated_or_thinking_and_special_where_they_are():
    record = prompt_record([1, 2, 3])
    written = [OPEN, 10, 11, CLOSE, 12, END]
    out = continued_record(record, Continuation(written, STOP_TOKEN), special_ids={END}, thinking=(OPEN, CLOSE))
    assert out["input_ids"] == [1, 2, 3, *written] and out["num_tokens"] == 9
    assert out["roles"] == [["user", 3], ["thinking", 4], ["generated", 2]]
    assert out["special"] == [0, 8]  # the prompt's, then the stop token at 3 + 5
    assert out["generation"] == {"prompt_tokens": 3, "token_ids": written, "num_tokens": 6, "finish": STOP_TOKEN,
                                 "text": None}
    # Without thinking markers every written token is generated; a record without roles keeps none.
    assert continued_record(record, Continuation(written, STOP_TOKEN))["roles"] == [["user", 3], ["generated", 6]]
    bare = continued_record({**record, "roles": None, "special": None}, Continuation(written, LENGTH))
    assert bare["roles"] is None and bare["special"] is None


@pytest.mark.parametrize("prompt, written, runs", [
    ([1, OPEN], [10, 11, CLOSE, 12], [["thinking", 3], ["generated", 1]]),  # the template opened the section
    ([OPEN, 4, CLOSE, 5], [10, 11], [["generated", 2]]),                    # closed in the prompt (thinking off)
    ([1], [10, OPEN, 11], [["generated", 1], ["thinking", 2]]),             # still thinking at the limit
    ([1], [OPEN, CLOSE, OPEN, 3, CLOSE], [["thinking", 5]]),
])
def test_a_thinking_section_runs_from_its_opening_marker_through_its_closing_one(prompt, written, runs):
    assert written_runs(prompt, written, (OPEN, CLOSE)) == runs


def test_thinking_markers_are_found_in_a_vocabulary_that_has_them(qwen_tokenizer):
    assert thinking_ids(qwen_tokenizer) is None  # Qwen2.5's vocabulary has none (Qwen3's adds them)
    qwen3_like = qwen_tokenizer.__class__.from_pretrained(qwen_tokenizer.name_or_path)
    qwen3_like.add_tokens(["<think>", "</think>"])
    opening, closing = thinking_ids(qwen3_like)
    assert qwen3_like.encode("<think>x</think>")[0] == opening and qwen3_like.encode("</think>") == [closing]


def independent_grid(text):
    """The first closed ``` block's rows as lists of ints (None: no such block, or not rows of
    digits), by another route than transforms.arc's."""
    parts = text.split("```")
    if len(parts) < 3 or "\n" not in parts[1]:
        return None
    lines = parts[1].split("\n", 1)[1].strip().split("\n")
    if not all(line.replace(" ", "").isdecimal() and line.isascii() for line in lines):
        return None
    return [[int(c) for c in line.replace(" ", "")] for line in lines]


def test_a_planted_correct_answer_is_scored_correct_and_a_wrong_one_not(qwen_tokenizer):
    expected = [[1, 2, 3], [4, 5, 6]]
    record = prompt_record([1, 2], expected_output=expected)
    for text, correct in ((f"Sure.\n{grid_block(expected)}\nDone", True),
                          (f"{grid_block(((1, 2, 3), (4, 5, 7)))}\n{grid_block(expected)}", False),  # the first counts
                          ("```grid\n12\n3\n```", False)):                                          # not rectangular
        tokens = qwen_tokenizer.encode(text)
        decoded = qwen_tokenizer.decode(tokens)
        out = continued_record(record, Continuation(tokens, LENGTH), decoded, answer_text=decoded)["generation"]
        rectangular = len({len(row) for row in independent_grid(decoded)}) == 1  # a grid is
        assert out["answer_correct"] is correct is (independent_grid(decoded) == expected)
        assert (out["answer_rows"], out["answer_cols"]) == ((2, 3) if rectangular else (None, None))
    # No text (no tokenizer), or no expected output: nothing is scored.
    assert "answer_correct" not in continued_record(record, Continuation([3], LENGTH))["generation"]
    assert "answer_correct" not in continued_record(prompt_record([1]), Continuation([3], LENGTH), "x",
                                                    answer_text="x")["generation"]


@pytest.mark.parametrize("text, grid", [
    ("```grid\n01\n23\n```", ((0, 1), (2, 3))),
    ("text\n```\n0 1\n2 3\n```", ((0, 1), (2, 3))),  # no info string, spaces between digits
    ("```grid\n01\n23", None),                          # never closed (the limit cut it)
    ("Here is the ```grid block:\n```grid\n01\n23\n```", ((0, 1), (2, 3))),  # a fence opens a line
    ("```\n0\t1\n2\t3\n```", ((0, 1), (2, 3))),        # tabs between digits
    ("```python\nx = 1\n```\n```grid\n1\n```", None),   # the first block is no grid
    ("no block", None),
])
def test_first_grid(text, grid):
    assert first_grid(text) == grid
    assert scored_answer(text, [[0, 1], [2, 3]])["answer_correct"] is (grid == ((0, 1), (2, 3)))


def test_the_answer_is_what_follows_the_thinking_section_and_there_is_none_inside_it(qwen_tokenizer):
    tokenizer = qwen_tokenizer.__class__.from_pretrained(qwen_tokenizer.name_or_path)
    tokenizer.add_tokens(["<think>", "</think>"])
    opening, closing = thinking_ids(tokenizer)
    continuing = Continuing(None, 8, None, (), 1, tokenizer, thinking=(opening, closing))
    draft, answer = tokenizer.encode("```grid\n1\n```"), tokenizer.encode("```grid\n2\n```")
    thought = [opening, *draft, closing, *answer]
    assert continuing.answer_text([5], thought, tokenizer.decode(thought)) == "```grid\n2\n```"
    assert continuing.answer_text([5, opening], draft, tokenizer.decode(draft)) == ""  # still thinking
    assert continuing.answer_text([5], answer, tokenizer.decode(answer)) == "```grid\n2\n```"


def test_a_stream_record_expected_output_must_be_a_grid():
    line = '{"sample_id": 1, "input_ids": [3], "num_tokens": 1, "source": "t:0", "text_preview": "x", '
    assert parse_stream_line(line + '"expected_output": [[1, 2]]}', "s:1")["expected_output"] == [[1, 2]]
    with pytest.raises(StreamFormatError, match="s:1: expected_output has rows of different widths \\[1, 2\\]"):
        parse_stream_line(line + '"expected_output": [[1, 2], [3]]}', "s:1")
