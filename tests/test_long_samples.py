"""Records longer than --max_seq_length: truncated, skipped, or an error; never a stopped run."""

import json
import random

import pyarrow.parquet as pq
import pytest

from activations.reader import iter_activations
from tests.conftest import run_in_process
from fixtures.hf_reference import load_reference, random_sequences, reference_activations, relative_error
from tests.test_host import index_rows, run_with_kills, shard_contents
from tests.test_host_errors import one_line_error
from transforms.long_samples import SampleTooLong, fit_record, rejection
from common.states import COMPLETED

LIMIT = 512
LENGTHS = (3, 400, 600, 2500)  # a 400-token sample fills a test shard by itself


def record(sample_id, ids, **extra):
    return {"sample_id": sample_id, "input_ids": ids, "num_tokens": len(ids), "source": f"s{sample_id}",
            "text_preview": "", **extra}


def test_truncate_keeps_the_first_tokens_and_says_so():
    fitted = fit_record(record(1, list(range(600))), LIMIT, "truncate")
    assert fitted["input_ids"] == list(range(512)) and fitted["num_tokens"] == 512
    assert fitted["truncated"] is True and fitted["original_num_tokens"] == 600


def test_records_that_fit_are_unchanged_but_flagged():
    assert fit_record(record(1, [5, 6, 7]), LIMIT, "skip") == {**record(1, [5, 6, 7]), "truncated": False,
                                                                "original_num_tokens": 3}
    # Truncated by the prepare pipeline: its stream fields carry through.
    cut = fit_record(record(2, [1] * 512, truncated=True, original_num_tokens=900), LIMIT, "truncate")
    assert cut["truncated"] is True and cut["original_num_tokens"] == 900 and cut["num_tokens"] == 512
    older = fit_record(record(3, [1] * 20, truncated=True), LIMIT, "truncate")
    assert older["truncated"] is True and older["original_num_tokens"] is None


def test_skip_and_error():
    long = record(9, [1] * 2500)
    assert fit_record(long, LIMIT, "skip") is None
    assert rejection(long, LIMIT) == {"sample_id": 9, "source": "s9", "num_tokens": 2500,
                                      "max_seq_length": 512, "reason": "too_long"}
    with pytest.raises(SampleTooLong, match="sample 9 has 2500 tokens, more than --max_seq_length 512"):
        fit_record(long, LIMIT, "error")
    # With --generate 64 the limit is a prompt's: 512 - 64; the entry names both.
    assert rejection(long, LIMIT - 64, 64) == {"sample_id": 9, "source": "s9", "num_tokens": 2500,
                                               "max_seq_length": 512, "generate": 64, "reason": "too_long"}


def write_stream(path, copies=5):  # with windows of 3, resumes land mid-window
    """``copies`` x (3, 400, 600, 2500 tokens) of random ids: with ``skip``, shards hold skipped
    records between their samples, and the stream ends on two skipped records."""
    lengths = [n for _ in range(copies) for n in LENGTHS]
    records = [record(i * 7 + 1, ids) for i, ids in enumerate(random_sequences(lengths, seed=3))]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def host_args(stream, out, model, policy, *extra):
    return ["--machine_id", "0", "--dataset_stream", str(stream), "--model_path", model,
            "--output_dir", str(out), "--max_seq_length", str(LIMIT), "--long_samples", policy,
            "--batch_size", "1", "--window", "3", "--shard_size_gb", "0.0002", "--dtype", "float32",
            "--layers_to_extract", "0,3",
            # Under two shards: each is stored before the next fills, so kills land between shards.
            "--store_memory_gb", "0.0003", *extra]


@pytest.mark.slow
def test_truncated_samples_equal_the_reference_on_their_first_tokens(tiny_checkpoints, tmp_path):
    records = write_stream(tmp_path / "s.jsonl", copies=1)
    result = run_in_process("runners.tpu_host", *host_args(tmp_path / "s.jsonl", tmp_path / "out",
                                                           tiny_checkpoints["gqa_tied"], "truncate"))
    assert result.returncode == 0, result.stderr
    machine = tmp_path / "out" / "machine_000"
    index = {r["sample_id"]: r for path in sorted((machine / "index").glob("shard_????.parquet"))
             for r in pq.read_table(path).to_pylist()}
    assert [(index[r["sample_id"]]["num_tokens"], index[r["sample_id"]]["truncated"],
             index[r["sample_id"]]["original_num_tokens"]) for r in records] == [
        (3, False, 3), (400, False, 400), (512, True, 600), (512, True, 2500)]
    metadata = json.loads((machine / "metadata.json").read_text())
    assert metadata["total_truncated"] == 2 and metadata["total_skipped"] == 0
    assert not (machine / "rejected.jsonl").exists()
    index_path = tmp_path / "index.parquet"
    assert run_in_process("pipeline.index", "--activations_dir", str(tmp_path / "out"), "--output",
                          str(index_path)).returncode == 0
    assert pq.read_table(index_path).column("truncated").to_pylist() == [False, False, True, True]
    assert json.loads((tmp_path / "merged_metadata.json").read_text())["total_truncated"] == 2
    reference = load_reference(tiny_checkpoints["gqa_tied"])
    refs = reference_activations(reference, [r["input_ids"][:LIMIT] for r in records])
    for layer in (0, 3):
        got = dict(iter_activations(str(index_path), [r["sample_id"] for r in records], layer))
        for r, ref in zip(records, refs):
            assert got[r["sample_id"]].shape == (min(r["num_tokens"], LIMIT), 64)
            assert relative_error(got[r["sample_id"]], ref[layer]) <= 1e-5


def rejected_lines(machine):
    path = machine / "rejected.jsonl"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["truncate", "skip"])
def test_kill_9_then_resume_gives_the_uninterrupted_output(tiny_checkpoints, tmp_path, policy):
    records = write_stream(tmp_path / "s.jsonl")
    model = tiny_checkpoints["gqa_tied"]
    baseline = run_in_process("runners.tpu_host", *host_args(tmp_path / "s.jsonl", tmp_path / "base", model, policy))
    assert baseline.returncode == 0, baseline.stderr
    base = tmp_path / "base" / "machine_000"
    expected = (shard_contents(base), index_rows(base), rejected_lines(base))
    stored = [e[0] for shard in expected[0].values() for e in shard[0]]
    if policy == "skip":
        assert stored == [r["sample_id"] for r in records if r["num_tokens"] <= LIMIT]
        assert [json.loads(line) for line in expected[2]] == [
            rejection(r, LIMIT) for r in records if r["num_tokens"] > LIMIT]
        checkpoint = json.loads((base / "checkpoint.json").read_text())
        assert checkpoint["status"] == COMPLETED and checkpoint["total_samples_processed"] == len(records)
        assert checkpoint["total_skipped"] == 10 and checkpoint["last_processed_sample_idx"] == records[-1]["sample_id"]
        merged = run_in_process("pipeline.index", "--activations_dir", str(tmp_path / "base"), "--output",
                                str(tmp_path / "index.parquet"))
        assert merged.returncode == 0, merged.stderr
        summary = json.loads((tmp_path / "merged_metadata.json").read_text())
        assert (summary["total_samples"], summary["total_skipped"]) == (10, 10)
    else:
        assert stored == [r["sample_id"] for r in records] and expected[2] == []

    out = tmp_path / "killed"
    at_kills = run_with_kills(host_args(tmp_path / "s.jsonl", out, model, policy), out / "machine_000",
                              len(expected[0]), random.Random(7))
    covered = [c["total_samples_processed"] if c else 0 for c in at_kills]
    assert any(0 < n < len(records) for n in covered), covered  # some kills landed mid-run
    machine = out / "machine_000"
    assert (shard_contents(machine), index_rows(machine), rejected_lines(machine)) == expected
    assert json.loads((machine / "checkpoint.json").read_text())["status"] == COMPLETED


@pytest.mark.slow
def test_error_stops_before_the_model_loads(tiny_checkpoints, tmp_path):
    write_stream(tmp_path / "s.jsonl", copies=1)
    result = run_in_process("runners.tpu_host", *host_args(tmp_path / "s.jsonl", tmp_path / "out",
                                                           tiny_checkpoints["gqa_tied"], "error"))
    one_line_error(result, "has 600 tokens, more than --max_seq_length 512")
    assert "s.jsonl:3)" in result.stderr.strip().splitlines()[-1]
    status = json.loads((tmp_path / "out" / "machine_000" / "status.json").read_text())
    assert status["state"] == "failed" and "more than --max_seq_length 512" in status["error"]
    assert [h["state"] for h in status["history"]] == ["starting", "failed"]  # no load, no compile
    assert status["compiles"] == 0
