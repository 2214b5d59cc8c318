"""Activation patching over a paired dataset (``runners.ablate --metric logit_diff``): pairs and
one-token answers from ``pipeline.prepare``, with a tokenizer that puts a BOS in front; the
runner's grids, with the clean values read from a ``runners.tpu_host`` store, equal
``ablation.patching``'s on the library's own pairs of the same rows (checked against
TransformerLens and PyTorch autograd in test_patching.py), and its baselines transformers' logit
differences; a whole block's input patched gives the clean run; a 2-machine store gives the grids
of a 1-machine one; a kill -9 resumes without recomputing finished cells; bad input is one line."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from ablation.patching import ROWS_PER_FORWARD
from tests.conftest import REPO, run_in_process, wait_for

pytestmark = pytest.mark.slow
LENGTH, PAIRS = 6, 2
# Pairs for a byte-level tokenizer (fixtures.family_tokenizers: a character is a token): the clean
# prompt's subject is the second name, the corrupted one's the first, the answer the other name.
TEMPLATES = ("{A} and {B}, {S}:", "{A} or {B}, {S}:")
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


def letter_rows() -> list[dict]:
    """``PAIRS`` pairs of the paired layout (``fixtures.ioi``'s) whose names and answers are letters."""
    rows = []
    for pair, (template, (a, b)) in enumerate(zip(TEMPLATES, ("MJ", "AT"))):
        rows += [{"pair": pair, "variant": "clean", "text": template.format(A=a, B=b, S=b), "answer": a,
                  "wrong_answer": b},
                 {"pair": pair, "variant": "corrupted", "text": template.format(A=a, B=b, S=a), "answer": b,
                  "wrong_answer": a}]
    return rows


def prepare(tmp, tokenizer: str, machines: int) -> str:
    """``letter_rows`` through pipeline.prepare, as a user prepares a paired dataset."""
    write_stream(tmp / "pairs.jsonl", letter_rows())
    done = run_in_process("pipeline.prepare", "--dataset", str(tmp / "pairs.jsonl"), "--tokenizer", tokenizer,
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
def setup(tmp_path_factory):
    """(the model, its path, a 1-machine prepare of ``letter_rows``, its store's index, a 2-machine
    store's index, the tokenizer's directory): a tiny Qwen2 of a small vocabulary, its norms' scales
    spread (so that the clean and corrupted runs' logit differences are far apart), and a Gemma-style
    byte-level tokenizer whose settings put a BOS before every text."""
    import jax.numpy as jnp
    from fixtures.family_tokenizers import build_family_tokenizer
    from fixtures.tiny_models import SMALL_VOCAB, write_checkpoint
    from model.loading import load_model
    tmp = tmp_path_factory.mktemp("patching_run")
    path = write_checkpoint(tmp / "qwen2", "qwen2", norm_std=0.2, vocab_size=SMALL_VOCAB)
    tokenizer = str(build_family_tokenizer("gemma2", tmp / "tokenizer"))
    (tmp / "one").mkdir()
    (tmp / "two").mkdir()
    streams = prepare(tmp / "one", tokenizer, 1)
    one = store(tmp / "one", path, streams, 1)
    two = store(tmp / "two", path, prepare(tmp / "two", tokenizer, 2), 2)
    return load_model(path, jnp.float32, with_head=True), path, streams, one, two, tokenizer


def stream_pairs(streams: str) -> list[dict]:
    """Each pair's (clean, corrupted) record of a prepare's output, by pair."""
    records = [json.loads(line) for path in sorted(pathlib.Path(streams).glob("stream_*.jsonl"))
               for line in path.read_text().splitlines()]
    by = {(r["columns"]["pair"], r["columns"]["variant"]): r for r in records}
    return [(by[pair, "clean"], by[pair, "corrupted"]) for pair in range(PAIRS)]


def ablate(setup, output, *flags: str, grids=GRIDS, index: str | None = None):
    _, path, stream, one, *_ = setup
    return run_in_process("runners.ablate", "--model_path", path, "--stream", stream, "--metric", "logit_diff",
                          "--patch_from", index or one, "--interventions", *grids, "--output_dir", str(output),
                          "--no_tensorboard", *flags)


def grid_of(results: pd.DataFrame, grid: str, method: str, pair: int, shape: tuple) -> np.ndarray:
    rows = results[(results["grid"] == grid) & (results["method"] == method) & (results["pair"] == str(pair))]
    rows = rows.sort_values(["layer", "position", "head"])
    assert len(rows) == np.prod(shape), grid
    return rows["logit_diff"].to_numpy().reshape(shape)


NOTHING = "patch:0:hook_resid_pre:tokens=user"  # the prompts have no user tokens: patches nothing
TWICE = "patch:1:hook_resid_pre:pos=0-1"  # two cells of the first grid: computed once


@pytest.fixture(scope="module")
def both(setup, tmp_path_factory) -> pathlib.Path:
    """The output of one runners.ablate run of every grid by both methods, beside a cell that
    patches nothing and two cells of the first grid named again, from the 1-machine store."""
    output = tmp_path_factory.mktemp("both")
    done = ablate(setup, output, "--method", "both", grids=(*GRIDS, NOTHING, TWICE))
    assert done.returncode == 0, done.stderr
    return output


def test_the_runner_patches_a_stores_values_as_the_library_patches_its_pairs(setup, both, tmp_path):
    """Per pair of the library's tokenization of the rows (``pairs_from_rows``: the BOS in front,
    as prepare puts it), the exact and attribution grids of runners.ablate (clean values from the
    store) equal ablation.patching's with the clean run's, and its baselines are transformers'
    logit differences; a block's whole input patched recovers the clean run; the store's values a
    token short (a tokenization without the BOS) are refused in one line; a 2-machine store gives
    the same results as a 1-machine one."""
    import torch
    from ablation.patching import attribution_grid, pairs_from_rows, patching_grid, stored_values
    from common.cli import UserError
    from fixtures.hf_reference import load_reference
    from model.sites import ATTN_Z, RESID_PRE
    from transforms.tokenizers import load_tokenizer
    model, path, streams, one, two, tokenizer = setup
    results = pd.read_parquet(both / "patching.parquet")
    assert not results.duplicated(["intervention", "method", "pair"]).any()
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    pairs = pairs_from_rows(letter_rows(), load_tokenizer(tokenizer))
    reference = load_reference(path, "float64")
    bos = load_tokenizer(tokenizer).convert_tokens_to_ids("<bos>")
    lengths = []
    for pair, (clean, corrupted) in zip(pairs, stream_pairs(streams)):
        assert (list(pair.clean), list(pair.corrupted)) == (clean["input_ids"], corrupted["input_ids"])
        assert pair.clean[0] == pair.corrupted[0] == bos and (pair.answer, pair.wrong) == tuple(clean["answers"])
        length = len(pair.clean)
        lengths.append(length)
        for grid, site, shape in ((GRIDS[0], RESID_PRE, (layers, length)), (GRIDS[1], ATTN_Z, (layers, length, heads))):
            for method, library in (("exact", patching_grid), ("attribution", attribution_grid)):
                np.testing.assert_allclose(grid_of(results, grid, method, pair.name, shape), library(model, pair, site),
                                           rtol=1e-5, atol=1e-5, err_msg=f"{grid} {method}")
        rows = results[results["pair"] == pair.name]
        with torch.no_grad():
            logits = [reference(torch.tensor([ids])).logits[0, -1].numpy() for ids in (pair.clean, pair.corrupted)]
        expected = np.array([scores[pair.answer] - scores[pair.wrong] for scores in logits])  # clean, corrupted
        np.testing.assert_allclose(rows[["clean_logit_diff", "corrupted_logit_diff"]].to_numpy(),
                                   np.broadcast_to(expected, (len(rows), 2)), rtol=1e-5,
                                   atol=1e-5 * np.abs(expected).max())
        whole = rows[(rows["grid"] == "patch:*:hook_resid_pre") & (rows["method"] == "exact")]
        assert len(whole) == layers
        # Every position of a block's input: the clean run's logit difference, to float32 rounding (test_patching:
        # within 1e-6 with the clean run's own values; a store's come from the extraction's program, rounded
        # otherwise). Compared as logit differences: the normalized metric divides the rounding by clean - corrupted.
        np.testing.assert_allclose(whole["logit_diff"], expected[0], rtol=1e-5, atol=1e-5 * np.abs(expected).max())
        unpatched = rows[rows["intervention"] == NOTHING]
        assert len(unpatched) == 2  # the corrupted run, both methods (another batch shape: within rounding)
        np.testing.assert_allclose(unpatched["normalized"], 0, atol=1e-5)
        stored = stored_values(one, clean["sample_id"], [(RESID_PRE, layer) for layer in range(layers)])
        short = [stored[RESID_PRE, layer][1:] for layer in range(layers)]  # [S - 1, H]: no BOS
        message = (rf"^pair '{pair.name}': the clean values at blocks.0.hook_resid_pre are of shape "
                   rf"\({length - 1}, 64\), the clean prompt has {length} tokens")
        for library in (patching_grid, attribution_grid):
            with pytest.raises(UserError, match=message):
                library(model, pair, RESID_PRE, values=short)
    summary = pd.read_csv(both / "patching_summary.csv")
    # The two pairs' templates differ in length: positions past the shorter one have one pair.
    assert len(summary) == 2 * (layers * (max(lengths) * (1 + heads) + 1) + 1)
    assert set(summary["pairs"]) == ({PAIRS} if len(set(lengths)) == 1 else {1, PAIRS})
    agreement = json.loads((both / "agreement.json").read_text())
    assert set(agreement) == {"patch:*:hook_resid_pre:pos=*", "patch:*:attn.hook_z:heads=*:pos=*",
                              "patch:*:hook_resid_pre", "patch:*:hook_resid_pre:tokens=user"}
    assert agreement["patch:*:hook_resid_pre:pos=*"]["cells"] == layers * max(lengths)
    assert agreement["patch:*:hook_resid_pre:tokens=user"]["correlation"] is None  # one cell: none
    assert len(list((both / "charts").glob("patching_*.png"))) == 8
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


def test_a_run_killed_during_a_grid_resumes_without_recomputing_finished_cells(setup, both, tmp_path):
    """Killed (-9) once its first forward's cells are written, held before the second; the re-run
    computes the other pair's cells only, and the results equal an uninterrupted run's (``both``'s
    cells of the grid)."""
    model, path, stream, one, *_ = setup
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
    columns = ["intervention", "pair", "logit_diff"]
    whole = pd.read_parquet(both / "patching.parquet")
    whole = whole[(whole["grid"] == GRIDS[0]) & (whole["method"] == "exact")]
    got, expected = (frame[columns].sort_values(columns[:2]).reset_index(drop=True)
                     for frame in (pd.read_parquet(killed / "patching.parquet"), whole))
    # Other cells shared the uninterrupted run's forwards (another program): equal to float32 rounding.
    pd.testing.assert_frame_equal(got, expected, check_exact=False, rtol=1e-5, atol=1e-6)


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
