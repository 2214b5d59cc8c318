"""``runners.tpu_host --generate``: each prompt continued on the device, prompt + continuation
stored with the continuation's tokens marked ``generated``, exactly once."""

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest

from activations.reader import load_shard
from fixtures.hf_reference import load_reference, reference_activations, relative_error
from common.states import COMPLETED
from model.generate import Generator, stop_token_ids
from model.loading import load_model
from tests.conftest import read_streams
from tests.test_continued_records import independent_grid
from tests.test_host import index_rows, run_host_cli, run_with_kills, shard_contents

pytestmark = pytest.mark.slow
NEW = 8


def args_for(stream, out, model, *extra):
    return ["--machine_id", "0", "--dataset_stream", str(stream), "--model_path", model, "--output_dir", str(out),
            "--shard_size_gb", "0.0002", "--batch_size", "2", "--max_seq_length", "96", "--dtype", "float32",
            "--layers_to_extract", "1,3", "--generate", str(NEW), *extra]


@pytest.fixture(scope="module")
def stream(arc_streams, tmp_path_factory):
    """Six ARC records (their prompts truncated to leave room for the continuation)."""
    path = tmp_path_factory.mktemp("gen_stream") / "stream.jsonl"
    records = read_streams(arc_streams, 2)[0][:6]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def greedy(stream, tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("greedy")
    result = run_host_cli(*args_for(stream, out, tiny_checkpoints["gqa_tied"]))
    assert result.returncode == 0, result.stderr
    return out / "machine_000"


def stored(machine_dir) -> dict[int, dict]:
    """sample id -> its shard entry per layer ({layer: entry})."""
    out: dict[int, dict] = {}
    for path in sorted(machine_dir.glob("shard_*.pkl*")):
        for layer, entries in load_shard(str(path)).items():
            for entry in entries:
                out.setdefault(entry["sample_id"], {})[layer] = entry
    return out


def test_greedy_continuations_are_the_models_and_their_activations_transformers(greedy, stream, tiny_checkpoints):
    model = tiny_checkpoints["gqa_tied"]
    records = [json.loads(line) for line in stream.read_text().splitlines()]
    entries = stored(greedy)
    assert sorted(entries) == sorted(r["sample_id"] for r in records)
    loaded = load_model(model, jnp.float32, with_head=True, devices=jax.devices()[:1])
    generator = Generator(loaded.config, loaded.params, jnp.float32, cache_length=96, mesh=loaded.mesh)
    reference = load_reference(model, "float32")
    for record in records[:3]:
        prompt = record["input_ids"][:96 - NEW]  # truncated to leave room for NEW tokens
        generation = entries[record["sample_id"]][1]["generation"]
        alone = generator.continuations([prompt], NEW, stop_token_ids(model))[0]
        assert generation == {"prompt_tokens": len(prompt), "token_ids": alone.tokens,  # no tokenizer: no text
                              "num_tokens": len(alone.tokens), "finish": alone.finish, "text": None}
        full = prompt + alone.tokens
        expected = reference_activations(reference, [full])[0]
        for layer in (1, 3):
            ours = entries[record["sample_id"]][layer]["activation"]
            assert ours.shape == (len(full), 64)
            assert relative_error(ours, expected[layer]) <= 1e-5


def test_the_index_and_tokens_table_say_what_the_model_wrote(greedy):
    index = pq.read_table(greedy / "index" / "shard_0001.parquet").to_pylist()
    tokens = {r["sample_id"]: r for r in pq.read_table(greedy / "index" / "shard_0001_tokens.parquet").to_pylist()}
    for row in index:
        assert row["num_tokens"] == row["prompt_tokens"] + row["generated_tokens"]
        assert row["finish_reason"] in ("stop_token", "length")
        assert tokens[row["sample_id"]]["generated_tokens"] == row["generated_tokens"]
        assert tokens[row["sample_id"]]["roles"][-1] == {"role": "generated", "count": row["generated_tokens"]}
    metadata = json.loads((greedy / "metadata.json").read_text())
    assert metadata["generate"] == {"max_new_tokens": NEW, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0,
                                    "stop": []}


def test_selecting_the_generated_role_stores_exactly_the_continuations_rows(greedy, stream, tiny_checkpoints,
                                                                          tmp_path):
    result = run_host_cli(*args_for(stream, tmp_path, tiny_checkpoints["gqa_tied"], "--tokens", "generated"))
    assert result.returncode == 0, result.stderr
    every, selected = stored(greedy), stored(tmp_path / "machine_000")
    for sample_id, layers in every.items():
        start = layers[1]["generation"]["prompt_tokens"]
        for layer, entry in layers.items():
            picked = selected[sample_id][layer]
            assert picked["positions"].tolist() == list(range(start, entry["activation"].shape[0]))
            np.testing.assert_array_equal(picked["activation"], entry["activation"][start:])


def test_a_run_under_a_steering_writes_and_stores_under_it(stream, tiny_checkpoints, greedy, tmp_path):
    """--generate with --ablate steer:...: each continuation is the steered generator's, and the
    activations stored are the steered model's (transformers with the same forward hook)."""
    from fixtures.hf_reference import intervention_hooks, remove_hooks
    from interventions.resolve import ablation_arrays, parse_one
    from model.sites import RESID_POST, array_key
    from activations.directions import write_directions
    model = tiny_checkpoints["gqa_tied"]
    loaded = load_model(model, jnp.float32, with_head=True, devices=jax.devices()[:1])
    c = loaded.config
    path = str(tmp_path / "directions.npz")
    write_directions(path, {("diff_in_means", array_key(RESID_POST, 1)):
                            np.random.default_rng(3).standard_normal(c.hidden_size).astype(np.float32) * 4},
                     {"model_type": c.model_type, "hidden_size": c.hidden_size})
    spec = f"steer:1:{path}"
    result = run_host_cli(*args_for(stream, tmp_path / "out", model, "--ablate", spec))
    assert result.returncode == 0, result.stderr
    entries, plain = stored(tmp_path / "out" / "machine_000"), stored(greedy)
    intervention = parse_one(spec, c)
    generator = Generator(c, loaded.params, jnp.float32, cache_length=96, mesh=loaded.mesh,
                          ablation=ablation_arrays(intervention, c, c.num_hidden_layers))
    reference = load_reference(model, "float32")
    undo = intervention_hooks(reference, intervention)
    changed = 0
    try:
        for record in [json.loads(line) for line in stream.read_text().splitlines()][:3]:
            prompt = record["input_ids"][:96 - NEW]
            generation = entries[record["sample_id"]][1]["generation"]
            assert generation["token_ids"] == generator.continuations([prompt], NEW, stop_token_ids(model))[0].tokens
            changed += generation["token_ids"] != plain[record["sample_id"]][1]["generation"]["token_ids"]
            expected = reference_activations(reference, [prompt + generation["token_ids"]])[0]  # the hook's
            for layer in (1, 3):
                assert relative_error(entries[record["sample_id"]][layer]["activation"], expected[layer]) <= 1e-5
    finally:
        remove_hooks(undo)
    assert changed  # the steering changed what the model wrote


def test_a_sampled_run_killed_and_resumed_stores_what_an_uninterrupted_one_does(tmp_path):
    """Each draw comes from the seed, the sample's id and the step: a restart redraws the same.
    A model of 512 tokens: XLA's CPU sort of a 152k vocabulary (top_p) costs 0.1 s a step."""
    from fixtures.tiny_models import SMALL_VOCAB, write_checkpoint
    from tests.test_family_runs import write_stream
    model = write_checkpoint(tmp_path / "model", "qwen2", vocab_size=SMALL_VOCAB)
    write_stream(tmp_path / "stream.jsonl", model, count=24)
    sampled = ("--temperature", "0.8", "--top_p", "0.95", "--seed", "3", "--window", "3")
    baseline = run_host_cli(*args_for(tmp_path / "stream.jsonl", tmp_path / "baseline", model, *sampled))
    assert baseline.returncode == 0, baseline.stderr
    expected = shard_contents(tmp_path / "baseline" / "machine_000")
    expected_index = index_rows(tmp_path / "baseline" / "machine_000")
    assert len(expected) >= 3  # a kill can land between shards
    out = tmp_path / "killed"
    at_kills = run_with_kills(args_for(tmp_path / "stream.jsonl", out, model, *sampled),
                              out / "machine_000", len(expected), random.Random(7), max_kills=1)
    assert at_kills
    assert json.loads((out / "machine_000" / "checkpoint.json").read_text())["status"] == COMPLETED
    assert shard_contents(out / "machine_000") == expected
    assert index_rows(out / "machine_000") == expected_index


def test_a_resume_with_other_generation_settings_is_refused(stream, tiny_checkpoints, tmp_path):
    first = run_host_cli(*args_for(stream, tmp_path, tiny_checkpoints["gqa_tied"], "--max_samples", "2"))
    assert first.returncode == 0, first.stderr
    args = [a for a in args_for(stream, tmp_path, tiny_checkpoints["gqa_tied"]) if a != str(NEW)]
    args[args.index("--generate") + 1:args.index("--generate") + 1] = ["4"]
    again = run_host_cli(*args)
    refused = "made with other settings (--generate {'max_new_tokens': 8"
    assert again.returncode == 2 and refused in again.stderr, again.stderr


def test_text_and_stop_strings_with_a_tokenizer(stream, tiny_checkpoints, qwen_tokenizer_dir, tmp_path):
    """Each continuation's text is its tokens decoded; a stop string cuts it after the token that
    completes the string's first occurrence, whatever the model wrote after."""
    from transforms.tokenizers import load_tokenizer, special_ids
    tokenizer = load_tokenizer(str(qwen_tokenizer_dir))
    model, free_dir, cut_dir = tiny_checkpoints["gqa_tied"], tmp_path / "free", tmp_path / "cut"
    result = run_host_cli(*args_for(stream, free_dir, model, "--tokenizer", str(qwen_tokenizer_dir)))
    assert result.returncode == 0, result.stderr
    free = {i: e[1]["generation"] for i, e in stored(free_dir / "machine_000").items()}
    index = {r["sample_id"]: r for r in pq.read_table(free_dir / "machine_000" / "index" / "shard_0001.parquet")
             .to_pylist()}
    records = {r["sample_id"]: r for r in map(json.loads, stream.read_text().splitlines())}
    special = special_ids(tokenizer) | set(stop_token_ids(model))
    tokens_rows = {r["sample_id"]: r for path in sorted((free_dir / "machine_000" / "index").glob("*_tokens.parquet"))
                   for r in pq.read_table(path).to_pylist()}
    for sample_id, generation in free.items():
        assert generation["text"] == tokenizer.decode(generation["token_ids"])
        start = generation["prompt_tokens"]
        assert [p - start for p in tokens_rows[sample_id]["special"] if p >= start] == \
            [i for i, token in enumerate(generation["token_ids"]) if token in special]
        # ARC tasks know their output: the continuation is scored against it.
        grid = independent_grid(generation["text"])
        assert generation["answer_correct"] is (grid == records[sample_id]["expected_output"])
        assert (generation["answer_rows"], generation["answer_cols"]) == \
            ((len(grid), len(grid[0])) if grid and len({len(row) for row in grid}) == 1 else (None, None))
        if sample_id in index:
            assert index[sample_id]["generated_text"] == generation["text"]
            assert [index[sample_id][k] for k in ("answer_correct", "answer_rows", "answer_cols")] == \
                [generation[k] for k in ("answer_correct", "answer_rows", "answer_cols")]
    # A stop string from the middle of one continuation's text (two of its tokens).
    sample_id, generation = next((i, g) for i, g in free.items() if g["num_tokens"] == NEW)
    stop = tokenizer.decode(generation["token_ids"][3:5])
    result = run_host_cli(*args_for(stream, cut_dir, model, "--tokenizer", str(qwen_tokenizer_dir),
                                    "--stop", stop.encode("unicode_escape").decode()))
    assert result.returncode == 0, result.stderr
    entries = stored(cut_dir / "machine_000")
    for i, generation in free.items():
        tokens = generation["token_ids"]
        ends = [k for k in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:k])]
        cut = entries[i][1]["generation"]
        assert cut["token_ids"] == tokens[:ends[0]] if ends else tokens
        assert cut["finish"] == ("stop_string" if ends else generation["finish"])
        assert entries[i][1]["activation"].shape[0] == cut["prompt_tokens"] + cut["num_tokens"]
    assert entries[sample_id][1]["generation"]["finish"] == "stop_string"
    assert len(entries[sample_id][1]["generation"]["token_ids"]) <= 5


def test_a_batch_whose_cache_would_not_fit_is_continued_a_few_prompts_at_a_time(tiny_checkpoints):
    from transforms.extraction import ExtractConfig, OrderedExtraction, continuing_for
    config = ExtractConfig(model_path=tiny_checkpoints["gqa_tied"], layers=(1,), batch_size=4, max_seq_length=96,
                           dtype="float32", generate=NEW, mesh_type="1d")
    extraction = OrderedExtraction(config)
    extraction.setup()
    data = extraction.extractor.mesh.shape["data"]
    assert extraction.continuing.batch_size == extraction.extractor.batch_size == 4 * data  # room enough here
    one_row_a_device = extraction.continuing.generator.cache_bytes(1)
    assert continuing_for(extraction.extractor, config, free=2 * one_row_a_device).batch_size == data


@pytest.mark.parametrize("flags, message", [
    (["--generate", "0"], "--generate must be at least 1 (new tokens a prompt), got 0"),
    (["--generate", "96"], "--generate 96 leaves no room for a prompt in --max_seq_length 96"),
    (["--temperature", "0.8"], "--temperature choose how --generate writes: pass --generate N"),
    (["--generate", "4", "--top_p", "0.9"], "--top_p and top_k choose among sampled tokens"),
    (["--stop", "###"], "--stop choose how --generate writes: pass --generate N"),
    (["--generate", "4", "--stop", "###"], "--stop finds strings in a continuation's text, which needs a tokenizer"),
])
def test_bad_generation_flags_are_one_line_before_the_model_loads(stream, tiny_checkpoints, tmp_path, flags,
                                                                  message):
    args = [a for a in args_for(stream, tmp_path, tiny_checkpoints["gqa_tied"]) if a not in ("--generate", str(NEW))]
    result = run_host_cli(*args, *flags)
    assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1], result.stderr
    assert not (tmp_path / "machine_000").exists()


def test_a_prompt_without_room_for_its_continuation_is_one_line_under_long_samples_error(stream, tiny_checkpoints,
                                                                                        tmp_path):
    result = run_host_cli(*args_for(stream, tmp_path, tiny_checkpoints["gqa_tied"], "--long_samples", "error"))
    first = json.loads(stream.read_text().splitlines()[0])
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(
        f"sample {first['sample_id']} ({stream}:1) has {first['num_tokens']} tokens, more than the {96 - NEW} a "
        f"prompt may have: --max_seq_length 96 less --generate {NEW} new tokens (--long_samples truncate would "
        f"continue its first {96 - NEW} tokens; skip would leave it out)"), result.stderr
    assert not list((tmp_path / "machine_000").glob("shard_*"))


def test_a_two_machine_fleet_generates_and_its_merged_index_scores_every_answer(arc_streams, tiny_checkpoints,
                                                                                 qwen_tokenizer_dir, tmp_path):
    from tests.conftest import run_in_process
    model = tiny_checkpoints["gqa_tied"]
    runner = [a for a in args_for(arc_streams, tmp_path, model, "--tokenizer", str(qwen_tokenizer_dir),
                                  "--max_samples", "3") if a not in ("--dataset_stream", str(arc_streams))]
    for machine in ("0", "1"):
        runner[runner.index("--machine_id") + 1] = machine
        result = run_in_process("runners.tpu_host", *runner, "--streams_dir", str(arc_streams))
        assert result.returncode == 0, result.stderr
    result = run_in_process("runners.fleet", "merge", "--name", "gen", "--streams_dir", str(arc_streams),
                            "--output", str(tmp_path), "--", "--model_path", model, "--max_samples", "3")
    assert "fleet gen complete: 2 machines, 6 samples" in result.stdout, result.stdout + result.stderr
    merged = pq.read_table(tmp_path / "index.parquet").to_pylist()
    expected = {r["sample_id"]: r["expected_output"] for stream in read_streams(arc_streams, 2) for r in stream}
    for machine in ("0", "1"):
        for sample_id, layers in stored(tmp_path / f"machine_00{machine}").items():
            generation = layers[1]["generation"]
            row = next(r for r in merged if r["sample_id"] == sample_id)
            assert row["generated_text"] == generation["text"] and row["finish_reason"] == generation["finish"]
            assert row["answer_correct"] is (independent_grid(generation["text"]) == expected[sample_id])


def test_a_prompt_that_opens_a_thinking_section_stores_the_continuation_as_thinking(stream, tiny_checkpoints,
                                                                                   qwen_tokenizer_dir, tmp_path):
    """Qwen2.5's vocabulary with Qwen3's <think> and </think> added; each prompt ends with <think>
    (as a thinking model's chat template leaves it): what the model writes up to </think> is
    thinking, the rest generated, and an answer is looked for only after the section."""
    from transforms.tokenizers import load_tokenizer
    tokenizer = load_tokenizer(str(qwen_tokenizer_dir)).__class__.from_pretrained(str(qwen_tokenizer_dir))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    opening, closing = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    records = [json.loads(line) for line in stream.read_text().splitlines()][:3]
    with open(tmp_path / "thinking.jsonl", "w") as f:
        for r in records:
            ids = r["input_ids"][:40] + [opening]
            f.write(json.dumps({**r, "input_ids": ids, "num_tokens": len(ids), "roles": [["user", len(ids)]],
                                "special": []}) + "\n")
    result = run_host_cli(*args_for(tmp_path / "thinking.jsonl", tmp_path, tiny_checkpoints["gqa_tied"],
                                    "--tokenizer", str(tmp_path / "tokenizer")))
    assert result.returncode == 0, result.stderr
    tables = [pq.read_table(p).to_pylist() for p in sorted((tmp_path / "machine_000" / "index").glob("*.parquet"))]
    tokens = {r["sample_id"]: r for t in tables for r in t if "thinking_tokens" in r}
    index = {r["sample_id"]: r for t in tables for r in t if "answer_correct" in r}
    for sample_id, generation in ((i, e[1]["generation"]) for i, e in stored(tmp_path / "machine_000").items()):
        written = generation["token_ids"]
        thought = written.index(closing) + 1 if closing in written else len(written)
        expected = [["user", 41], ["thinking", thought]] + ([["generated", len(written) - thought]]
                                                             if thought < len(written) else [])
        assert [[r["role"], r["count"]] for r in tokens[sample_id]["roles"]] == expected
        assert tokens[sample_id]["thinking_tokens"] == thought
        assert index[sample_id]["answer_correct"] is False and index[sample_id]["answer_rows"] is None
