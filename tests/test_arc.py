import pytest

from transforms.arc import arc_messages, grid_block, parse_arc_task, parse_grid
from transforms.rejections import RejectedRecord

TASK = {"train": [{"input": [[0, 1], [2, 3]], "output": [[3, 2], [1, 0]]}],
        "test": [{"input": [[4, 5], [6, 7]]}, {"input": [[9]]}]}


def test_grid_block_is_fenced_digits_one_row_per_line():
    assert grid_block(((0, 1, 2), (3, 4, 5))) == "```grid\n012\n345\n```"


@pytest.mark.parametrize("grid, reason", [
    ([[0, 1], [2]], "non_rectangular_grid"),
    ([[0, 10]], "cell_out_of_range"),
    ([[0, -1]], "cell_out_of_range"),
    ([[0, "1"]], "cell_out_of_range"),
    ([[True]], "cell_out_of_range"),
    ([], "empty_grid"),
    ([[]], "empty_grid"),
    ("012", "empty_grid"),
])
def test_invalid_grids_are_rejected_with_their_reason(grid, reason):
    with pytest.raises(RejectedRecord) as e:
        parse_grid(grid, "g")
    assert e.value.reason == reason


def test_arc_agi_schema():
    task = parse_arc_task({"id": "abc", **TASK}, default_id="x")
    assert task.task_id == "abc"
    assert task.train == ((((0, 1), (2, 3)), ((3, 2), (1, 0))),)
    assert task.test_inputs == (((4, 5), (6, 7)), ((9,),))


def test_barc_schema_uses_last_example_as_test():
    record = {"examples": [[[[1]], [[2]]], [[[3]], [[4]]], [[[5]], [[6]]]]}
    task = parse_arc_task(record, default_id="file.jsonl:3")
    assert task.task_id == "file.jsonl:3"
    assert task.train == ((((1,),), ((2,),)), (((3,),), ((4,),)))
    assert task.test_inputs == (((5,),),)


@pytest.mark.parametrize("record", [{"train": [], "test": TASK["test"]}, {"train": TASK["train"]},
                                    {"train": TASK["train"], "test": [{"output": [[1]]}]}])
def test_missing_fields_are_rejected(record):
    with pytest.raises(RejectedRecord) as e:
        parse_arc_task(record, default_id="x")
    assert e.value.reason == "missing_field"


def test_messages_show_train_pairs_and_the_chosen_test_input():
    system, user = arc_messages(parse_arc_task(TASK, "t"), test_index=1)
    assert (system["role"], user["role"]) == ("system", "user")
    assert "Example 1\nInput:\n```grid\n01\n23\n```\nOutput:\n```grid\n32\n10\n```" in user["content"]
    assert "Test input:\n```grid\n9\n```" in user["content"]
    assert "45\n67" not in user["content"]


def test_test_outputs_are_kept_when_given():
    from transforms.arc import arc_answer
    task = parse_arc_task({"train": TASK["train"], "test": [{"input": [[1]], "output": [[2, 3]]}, {"input": [[4]]}]},
                          default_id="x", with_outputs=True)
    assert task.test_outputs == (((2, 3),), None)
    assert arc_answer(task, 0) == "```grid\n23\n```" and arc_answer(task, 1) is None
    barc = parse_arc_task({"examples": [[[[1]], [[2]]], [[[5]], [[6]]]]}, default_id="y", with_outputs=True)
    assert arc_answer(barc, 0) == "```grid\n6\n```"


def test_test_outputs_are_read_only_when_answers_are_asked_for():
    record = {"train": TASK["train"], "test": [{"input": [[1]], "output": []}]}  # a malformed output
    assert parse_arc_task(record, default_id="x").test_outputs == (None,)  # not read: as before the flag
    with pytest.raises(RejectedRecord) as e:
        parse_arc_task(record, default_id="x", with_outputs=True)
    assert e.value.reason == "empty_grid"
