"""Activation patching over a paired dataset (``runners.ablate --metric logit_diff``): pairs and
one-token answers from ``pipeline.prepare``; the runner's grids, with the clean values read from a
``runners.tpu_host`` store, equal ``ablation.patching``'s (checked against TransformerLens and
PyTorch autograd in test_patching.py); a whole block's input patched gives the clean run; a
2-machine store gives the grids of a 1-machine one; a kill -9 resumes without recomputing finished
cells; bad input is one line."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from ablation.patching import ROWS_PER_FORWARD
from tests.conftest import REPO, run_in_process, wait_for

LENGTH, PAIRS = 6, 2
GRIDS = ("patch:*:hook_resid_pre:pos=*", "patch:*:attn.hook_z:heads=*:pos=*", "patch:*:hook_resid_pre")
SITES = "hook_resid_pre,attn.hook_z"


def pair_records(vocab: int) -> list[dict]:
    """Two pairs of the paired layout as stream records, twins differing in two tokens: what bad
    input is made from."""
    rng = np.random.default_rng(0)
    records = []
    for pair in range(PAIRS):
        clean = rng.integers(0, vocab, LENGTH)
        corrupted = clean.copy()
        corrupted[[1, 3]] = rng.integers(0, vocab, 2)
        answers = [int(a) for a in rng.choice(vocab, 2, replace=False)]
        for k, (variant, ids) in enumerate((("clean", clean), ("corrupted", corrupted))):
            records.append({"sample_id": 2 * pair + k, "input_ids": ids.tolist(), "num_tokens": LENGTH,
                            "truncated": False, "source": "pairs", "text_preview": "", "roles": [["text", LENGTH]],
                            "special": [], "columns": {"pair": pair, "variant": variant}, "answers": answers})
    return records


def write_stream(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def prepare(tmp, tokenizer: str, machines: int) -> str:
    """fixtures.ioi's pairs through pipeline.prepare, as a user prepares a paired dataset."""
    from fixtures.ioi import ioi_rows
    write_stream(tmp / "ioi.jsonl", ioi_rows(PAIRS))
    done = run_in_process("pipeline.prepare", "--dataset", str(tmp / "ioi.jsonl"), "--tokenizer", tokenizer,
                          "--keep_columns", "pair,variant", "--answer_columns", "answer,wrong_answer",
                          "--num_machines", str(machines), "--output_dir", str(tmp / "streams"))
    assert done.returncode == 0, done.stderr
    return str(tmp / "streams")


def store(tmp, model: str, streams: str, machines: int) -> str:
    """The index of a runners.tpu_host store of every machine's stream, merged."""
    for machine in range(machines):
        done = run_in_process("runners.tpu_host", "--machine_id", str(machine), "--streams_dir", streams,
                              "--model_path", model, "--output_dir", str(tmp / "store"), "--sites", SITES,
                              "--batch_size", "2")
        assert done.returncode == 0, done.stderr
    merged = run_in_process("pipeline.index", "--activations_dir", str(tmp / "store"), "--output",
                            str(tmp / "index.parquet"))
    assert merged.returncode == 0, merged.stderr
    return str(tmp / "index.parquet")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, qwen_tokenizer_dir):
    """(the model, its path, a 1-machine prepare of the IOI pairs, its store's index, a 2-machine
    store's index): a tiny Qwen2 with the real Qwen2.5 vocabulary, its norms' scales spread (so
    that the clean and corrupted runs' logit differences are far apart)."""
    import jax.numpy as jnp
    from fixtures.tiny_models import write_checkpoint
    from model.loading import load_model
    tmp = tmp_path_factory.mktemp("patching_run")
    path = write_checkpoint(tmp / "qwen2", "qwen2", norm_std=0.2)
    (tmp / "one").mkdir()
    (tmp / "two").mkdir()
    streams = prepare(tmp / "one", qwen_tokenizer_dir, 1)
    one = store(tmp / "one", path, streams, 1)
    two = store(tmp / "two", path, prepare(tmp / "two", qwen_tokenizer_dir, 2), 2)
    return load_model(path, jnp.float32, with_head=True), path, streams, one, two


def stream_pairs(streams: str) -> list[dict]:
    """Each pair's (clean, corrupted) record of a prepare's output, by pair."""
    records = [json.loads(line) for path in sorted(pathlib.Path(streams).glob("stream_*.jsonl"))
               for line in path.read_text().splitlines()]
    by = {(r["columns"]["pair"], r["columns"]["variant"]): r for r in records}
    return [(by[pair, "clean"], by[pair, "corrupted"]) for pair in range(PAIRS)]


def ablate(setup, output, *flags: str, grids=GRIDS, index: str | None = None):
    _, path, stream, one, _ = setup
    return run_in_process("runners.ablate", "--model_path", path, "--stream", stream, "--metric", "logit_diff",
                          "--patch_from", index or one, "--interventions", *grids, "--output_dir", str(output),
                          "--no_tensorboard", *flags)


def grid_of(results: pd.DataFrame, grid: str, method: str, pair: int, shape: tuple) -> np.ndarray:
    rows = results[(results["grid"] == grid) & (results["method"] == method) & (results["pair"] == str(pair))]
    rows = rows.sort_values(["layer", "position", "head"])
    assert len(rows) == np.prod(shape), grid
    return rows["logit_diff"].to_numpy().reshape(shape)


def test_the_runner_patches_a_stores_values_as_the_library_patches_the_clean_run(setup, tmp_path):
    """Per pair, the exact and attribution grids of runners.ablate (clean values from the store)
    equal ablation.patching's with the clean run's; a block's whole input patched recovers the
    clean run; a 2-machine store gives the same results as a 1-machine one."""
    from ablation.patching import Pair, attribution_grid, baselines, patching_grid
    from model.sites import ATTN_Z, RESID_PRE
    model, _, streams, _, two = setup
    nothing = "patch:0:hook_resid_pre:tokens=user"  # the prompts have no user tokens: patches nothing
    twice = "patch:1:hook_resid_pre:pos=0-1"  # two cells of the first grid: computed once
    done = ablate(setup, tmp_path / "one", "--method", "both", grids=(*GRIDS, nothing, twice))
    assert done.returncode == 0, done.stderr
    results = pd.read_parquet(tmp_path / "one" / "patching.parquet")
    assert not results.duplicated(["intervention", "method", "pair"]).any()
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    lengths = []
    for pair_id, (clean, corrupted) in enumerate(stream_pairs(streams)):
        pair = Pair(tuple(clean["input_ids"]), tuple(corrupted["input_ids"]), *clean["answers"])
        length = len(pair.clean)
        lengths.append(length)
        for grid, site, shape in ((GRIDS[0], RESID_PRE, (layers, length)), (GRIDS[1], ATTN_Z, (layers, length, heads))):
            for method, reference in (("exact", patching_grid), ("attribution", attribution_grid)):
                np.testing.assert_allclose(grid_of(results, grid, method, pair_id, shape), reference(model, pair, site),
                                           rtol=1e-5, atol=1e-5, err_msg=f"{grid} {method}")
        whole = results[(results["grid"] == "patch:*:hook_resid_pre") & (results["pair"] == str(pair_id))
                        & (results["method"] == "exact")]
        assert len(whole) == layers
        # Every position of a block's input: the clean run, to float32 rounding (test_patching: 1 within 1e-6
        # with the clean run's own values; a store's come from the extraction's program, rounded otherwise).
        np.testing.assert_allclose(whole["normalized"], 1, atol=1e-5)
        assert np.allclose(whole[["clean_logit_diff", "corrupted_logit_diff"]].iloc[0], baselines(model, pair))
        unpatched = results[(results["intervention"] == nothing) & (results["pair"] == str(pair_id))]
        assert len(unpatched) == 2  # the corrupted run, both methods (another batch shape: within rounding)
        np.testing.assert_allclose(unpatched["normalized"], 0, atol=1e-5)
    summary = pd.read_csv(tmp_path / "one" / "patching_summary.csv")
    # The two pairs' templates differ in length: positions past the shorter one have one pair.
    assert len(summary) == 2 * (layers * (max(lengths) * (1 + heads) + 1) + 1)
    assert set(summary["pairs"]) == ({PAIRS} if len(set(lengths)) == 1 else {1, PAIRS})
    agreement = json.loads((tmp_path / "one" / "agreement.json").read_text())
    assert set(agreement) == {"patch:*:hook_resid_pre:pos=*", "patch:*:attn.hook_z:heads=*:pos=*",
                              "patch:*:hook_resid_pre", "patch:*:hook_resid_pre:tokens=user"}
    assert agreement["patch:*:hook_resid_pre:pos=*"]["cells"] == layers * max(lengths)
    assert agreement["patch:*:hook_resid_pre:tokens=user"]["correlation"] is None  # one cell: none
    assert len(list((tmp_path / "one" / "charts").glob("patching_*.png"))) == 8
    # The 2-machine store (each pair's twins on two machines): the same values read, the same cells.
    again = ablate(setup, tmp_path / "two", index=two, grids=GRIDS[:2])
    assert again.returncode == 0, again.stderr
    columns = ["intervention", "pair", "logit_diff", "normalized"]
    other = pd.read_parquet(tmp_path / "two" / "patching.parquet")
    same = results[(results["method"] == "exact") & results["grid"].isin(GRIDS[:2])]
    assert len(other) == len(same) > 0
    pd.testing.assert_frame_equal(same[columns].sort_values(columns[:2]).reset_index(drop=True),
                                  other[columns].sort_values(columns[:2]).reset_index(drop=True))


GATED = """
import glob, os, sys, time
import ablation.patching as patching
forward = patching._patched_forward
def gated(*args, **kwargs):
    while glob.glob(sys.argv[1] + "/patching_parts/part-*.parquet") and not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
    return forward(*args, **kwargs)
patching._patched_forward = gated
from common.cli import run_main
from runners.ablate import main
run_main("runners.ablate", main, sys.argv[3:])
"""


def test_a_run_killed_during_a_grid_resumes_without_recomputing_finished_cells(setup, tmp_path):
    """Killed (-9) once its first forward's cells are written, held before the second; the re-run
    computes the other pair's cells only, and the results equal an uninterrupted run's."""
    model, path, stream, one, _ = setup
    flags = ["--model_path", path, "--stream", stream, "--metric", "logit_diff", "--patch_from", one,
             "--interventions", GRIDS[0], "--no_tensorboard", "--no_charts"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", GATED, str(killed), str(tmp_path / "gate"), *flags,
                             "--output_dir", str(killed)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: (killed / "patching_parts" / "part-000000.parquet").exists() or proc.poll() is not None,
             what="the first forward's cells")
    proc.kill()
    proc.wait()
    first = pd.read_parquet(killed / "patching_parts" / "part-000000.parquet")
    assert len(first) == ROWS_PER_FORWARD and set(first["pair"]) == {"0"}  # pair 0's first forward
    resumed = run_in_process("runners.ablate", *flags, "--output_dir", str(killed))
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads((killed / "run.json").read_text())
    layers = model.config.num_hidden_layers
    cells = [layers * len(clean["input_ids"]) for clean, _ in stream_pairs(stream)]  # [layers, positions] a pair
    forwards = -(-(cells[0] - ROWS_PER_FORWARD) // ROWS_PER_FORWARD) + -(-cells[1] // ROWS_PER_FORWARD)
    assert (report["cells"], report["forwards"]) == (sum(cells), forwards)
    assert report["computed"] == sum(cells) - ROWS_PER_FORWARD  # all but the first forward's
    whole = run_in_process("runners.ablate", *flags, "--output_dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    columns = ["intervention", "pair", "logit_diff"]
    got, expected = (pd.read_parquet(d / "patching.parquet")[columns].sort_values(columns[:2]).reset_index(drop=True)
                     for d in (killed, tmp_path / "whole"))
    pd.testing.assert_frame_equal(got, expected)


def test_prepare_keeps_pairs_and_one_token_answers(qwen_tokenizer, qwen_tokenizer_dir, tmp_path):
    """fixtures.ioi's rows through pipeline.prepare: the pair and variant kept, the answers each one
    token of the real Qwen2.5 vocabulary; a two-token answer is one line."""
    from fixtures.ioi import ioi_rows
    rows = ioi_rows(3)
    flags = ["--tokenizer", qwen_tokenizer_dir, "--keep_columns", "pair,variant", "--answer_columns",
             "answer,wrong_answer", "--num_machines", "1"]
    write_stream(tmp_path / "ioi.jsonl", rows)
    done = run_in_process("pipeline.prepare", "--dataset", str(tmp_path / "ioi.jsonl"), "--output_dir",
                          str(tmp_path / "streams"), *flags)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "streams" / "stream_000.jsonl").read_text().splitlines()]
    for record, row in zip(sorted(records, key=lambda r: r["sample_id"]), rows):
        assert record["columns"] == {"pair": row["pair"], "variant": row["variant"]}
        assert [qwen_tokenizer.decode([token]) for token in record["answers"]] == [row["answer"], row["wrong_answer"]]
        assert record["input_ids"] == qwen_tokenizer(row["text"])["input_ids"]
    write_stream(tmp_path / "bad.jsonl", [rows[0], {**rows[1], "answer": " Mary Ann"}])
    bad = run_in_process("pipeline.prepare", "--dataset", str(tmp_path / "bad.jsonl"), "--output_dir",
                         str(tmp_path / "bad"), *flags)
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1].endswith("the answer ' Mary Ann' is 2 tokens of "
                                                        f"{qwen_tokenizer_dir}, not one (--answer_columns: a logit "
                                                        "difference compares one token with one)")


def test_bad_input_is_one_line(setup, tmp_path):
    """A sample with no twin, a sample without a pair column, twins of unequal lengths (or unequal
    tokens= counts), a site the clean store does not hold, a store holding another prompt at the
    clean sample's id, a cell patching one position twice, a --patch_from that is no merged index,
    patching under the loss metric or in runners.tpu_host: one line each, before the model loads."""
    records = pair_records(512)
    patching = ["--metric", "logit_diff", "--patch_from", setup[3]]
    cases = [
        (records[1:], patching, "sample 1: pair 0 has no clean prompt"),
        ([{**r, "columns": {"variant": r["columns"]["variant"]}} for r in records], patching,
         "sample 0 has no pair column: a patching stream pairs its samples (pipeline.prepare --keep_columns "
         "pair,variant)"),
        ([records[0], {**records[1], "input_ids": records[1]["input_ids"] + [5], "num_tokens": LENGTH + 1,
                       "roles": [["text", LENGTH + 1]]}], patching,
         "pair '0': the clean prompt has 6 tokens, the corrupted 7"),
        ([records[0], {**records[1], "roles": [["user", 2], ["text", 4]]}],
         patching + ["--interventions", "patch:0:hook_resid_pre:tokens=text"],
         "pair '0': tokens=text chooses 6 tokens of the clean prompt and 4 of the corrupted"),
        (records, patching + ["--interventions", "patch:*:hook_mlp_out"], "holds no blocks.0.hook_mlp_out of sample 0"),
        (records, patching, "tokens of sample 0 at blocks.0.hook_resid_pre, the stream's clean prompt has 6"),
        (records, patching + ["--interventions", "patch:1:hook_resid_pre+patch:1:hook_resid_pre:pos=2"],
         "patches block 1's hook_resid_pre at position 2 twice"),
        (records, ["--metric", "logit_diff", "--patch_from", str(tmp_path / "store" / "index.parquet")],
         "no merged_metadata.json beside it"),
        (records, [], "activation patching is scored by --metric logit_diff"),
    ]
    path = setup[1]
    for i, (stream_records, flags, message) in enumerate(cases):
        stream = write_stream(tmp_path / f"stream_{i}.jsonl", stream_records)
        done = run_in_process("runners.ablate", "--model_path", path, "--stream", stream, "--interventions", GRIDS[0],
                              "--output_dir", str(tmp_path / f"out_{i}"), *flags)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (message, done.stderr)
        assert message in done.stderr.strip().splitlines()[-1], (message, done.stderr)
    host = run_in_process("runners.tpu_host", "--machine_id", "0", "--dataset_stream", stream, "--model_path", path,
                          "--output_dir", str(tmp_path / "host"), "--ablate", "patch:0:hook_resid_pre")
    assert host.returncode == 2 and "runners.ablate --metric logit_diff --patch_from INDEX" in host.stderr
