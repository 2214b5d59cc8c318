"""The per-host runner end to end: prepare -> runners.tpu_host (x2) -> pipeline.index."""

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from activations.reader import iter_activations, load_shard, read_activations
from tests.conftest import REPO, assert_statistics_close, gated_runner, read_streams, run_in_process
from fixtures.hf_reference import load_reference, reference_activations, relative_error
from common.states import COMPLETED
from tests.test_stream_reader import split_stream

pytestmark = pytest.mark.slow
SHARD_GB = "0.0002"  # ~200 kB: a few samples per shard with the tiny model


def host_args(streams, out, machine, model, *extra):
    return ["--machine_id", str(machine), "--streams_dir", str(streams), "--model_path", model,
            "--output_dir", str(out), "--shard_size_gb", SHARD_GB, "--batch_size", "2",
            "--max_seq_length", "160", "--dtype", "float32", *extra]


def run_host_cli(*args, **kw):
    """``runners.tpu_host args`` run to its end in this process (``run_in_process``): the tests
    that kill or signal a runner start processes of their own."""
    return run_in_process("runners.tpu_host", *args, **kw)


def shard_contents(machine_dir: pathlib.Path) -> dict:
    """{shard file name: {layer: [(sample_id, activation bytes)]}} of a machine's shards."""
    out = {}
    for path in sorted(machine_dir.glob("shard_*.pkl*")):
        shard = load_shard(str(path))
        out[path.name] = {layer: [(e["sample_id"], e["activation"].tobytes(), e["source"]) for e in entries]
                          for layer, entries in shard.items()}
    return out


def shard_bytes(machine_dir: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(machine_dir.glob("shard_*.pkl*"))}


def index_rows(machine_dir: pathlib.Path) -> list[dict]:
    """The rows of a machine's per-shard index, arrays and tokens files (shard paths as file names)."""
    rows = []
    for path in sorted((machine_dir / "index").glob("shard_????*.parquet")):
        if path.name.endswith("_stats.parquet"):
            continue
        for row in pq.read_table(path).to_pylist():
            if "shard_path" in row:  # not in the tokens table
                row["shard_path"] = os.path.basename(row["shard_path"])
            rows.append(row)
    return rows


@pytest.fixture(scope="module")
def uninterrupted(arc_streams, tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    for machine in (0, 1):
        result = run_host_cli(*host_args(arc_streams, out, machine, tiny_checkpoints["gqa_tied"]))
        assert result.returncode == 0, result.stderr
    return out


def test_end_to_end_every_sample_once_and_equal_to_reference(arc_streams, tiny_checkpoints, uninterrupted,
                                                             tmp_path):
    index_path = tmp_path / "index.parquet"
    result = run_in_process("pipeline.index", "--activations_dir", str(uninterrupted), "--output", str(index_path))
    assert result.returncode == 0, result.stderr
    index = pq.read_table(index_path).to_pandas()
    streams = [s for stream in read_streams(arc_streams, 2) for s in stream]
    assert sorted(index["sample_id"]) == sorted(s["sample_id"] for s in streams)
    assert index["sample_id"].is_unique and len(index) == 24
    arrays = pq.read_table(tmp_path / "index_arrays.parquet").to_pandas()
    assert len(arrays) == 24 * 4 and sorted(arrays["layer"].unique()) == [0, 1, 2, 3]
    pairs = read_activations(arrays, [s["sample_id"] for s in streams[:6]], [1, 2])
    per_sample = dict(iter_activations(index, [s["sample_id"] for s in streams[:6]], 2))
    assert all(np.array_equal(pairs[(i, 2)], a) for i, a in per_sample.items())
    merged = json.loads((tmp_path / "merged_metadata.json").read_text())
    assert merged["total_samples"] == 24 and merged["completed_machines"] == [0, 1]
    assert_statistics_of_the_arrays(uninterrupted, index_path, 24)
    reference = load_reference(tiny_checkpoints["gqa_tied"])
    by_id = {s["sample_id"]: s for s in streams}
    for layer in (0, 3):
        got = dict(iter_activations(index, [s["sample_id"] for s in streams], layer))
        refs = reference_activations(reference, [by_id[i]["input_ids"] for i in got])
        for (sample_id, activation), ref in zip(got.items(), refs):
            assert activation.shape == (by_id[sample_id]["num_tokens"], 64)
            assert relative_error(activation, ref[layer]) <= 1e-5


def assert_statistics_of_the_arrays(activations_dir: pathlib.Path, index_path: pathlib.Path, samples: int) -> None:
    """The merged per-site statistics (of every machine's shards) equal those recomputed in
    float64 from every stored array read back (relative 1e-5: measured per sample in float32)."""
    from activations.index import stats_path
    from activations.reader import frame_keys
    from activations.site_stats import Moments, table_moments
    if not index_path.exists():
        result = run_in_process("pipeline.index", "--activations_dir", str(activations_dir), "--output",
                                str(index_path))
        assert result.returncode == 0, result.stderr
    stats = table_moments(pq.read_table(stats_path(str(index_path))))
    arrays = pq.read_table(str(index_path).replace(".parquet", "_arrays.parquet")).to_pandas()
    keys = sorted(set(frame_keys(arrays)), key=str)
    assert sorted(stats, key=str) == keys
    values = read_activations(arrays, arrays["sample_id"].unique().tolist(), keys)
    assert len(values) == samples * len(keys)
    for key in keys:
        tokens = np.concatenate([a for (_, k), a in sorted(values.items(), key=str) if k == key]).astype(np.float64)
        assert_statistics_close(stats[key], Moments(len(tokens), tokens.mean(0), tokens.var(0) * len(tokens),
                                                    float(np.linalg.norm(tokens, axis=1).mean())))


def test_metadata_and_checkpoint(uninterrupted):
    machine = uninterrupted / "machine_000"
    metadata = json.loads((machine / "metadata.json").read_text())
    checkpoint = json.loads((machine / "checkpoint.json").read_text())
    assert checkpoint["status"] == COMPLETED and metadata["total_shards"] == checkpoint["total_shards"] > 1
    shards = metadata["shards"]
    assert [s["filename"] for s in shards] == [f"shard_{i:04d}.pkl.gz" for i in range(1, len(shards) + 1)]
    assert sum(s["total_samples_in_shard"] for s in shards) == metadata["total_samples"]
    assert metadata["layers"] == [0, 1, 2, 3] and metadata["hidden_size"] == 64
    assert checkpoint["last_processed_sample_idx"] == shards[-1]["last_sample_id"]


def test_statistics_off_stores_the_same_shards_and_indexes_and_no_statistics(arc_streams, tiny_checkpoints,
                                                                             uninterrupted, tmp_path):
    result = run_host_cli(*host_args(arc_streams, tmp_path, 0, tiny_checkpoints["gqa_tied"], "--statistics", "off"))
    assert result.returncode == 0, result.stderr
    machine, measured = tmp_path / "machine_000", uninterrupted / "machine_000"
    assert shard_contents(machine) == shard_contents(measured)
    assert index_rows(machine) == index_rows(measured)
    assert not list((machine / "index").glob("*_stats.parquet")) and list((measured / "index").glob("*_stats.parquet"))
    said = [json.loads((m / "metadata.json").read_text())["statistics"] for m in (machine, measured)]
    assert said == ["off", "device"]
    merged = run_in_process("pipeline.index", "--activations_dir", str(tmp_path), "--output",
                            str(tmp_path / "index.parquet"))
    assert merged.returncode == 0, merged.stderr
    assert (tmp_path / "index.parquet").exists() and not (tmp_path / "index_stats.parquet").exists()
    refused = run_host_cli(*host_args(arc_streams, tmp_path / "grouped", 0, tiny_checkpoints["gqa_tied"],
                                      "--statistics", "off", "--stats_by", "role"))
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        "runners.tpu_host: error: --stats_by role groups the statistics, which --statistics off does not keep")


def test_completed_run_does_nothing(arc_streams, tiny_checkpoints, uninterrupted):
    before = shard_contents(uninterrupted / "machine_001")
    result = run_host_cli(*host_args(arc_streams, uninterrupted, 1, tiny_checkpoints["gqa_tied"]))
    assert result.returncode == 0 and "already completed" in result.stdout
    assert shard_contents(uninterrupted / "machine_001") == before


def test_a_stream_in_parts_resumed_at_and_inside_a_part_gives_the_same_output(arc_streams, tiny_checkpoints,
                                                                              uninterrupted, tmp_path):
    """Machine 0's stream in parts: a run SIGKILLed once its first shard is checkpointed, resumed
    with that position the first record of a part, and inside a part, gives each time the shards
    and index of the uninterrupted run of the single file. (Each resume's copy of the stream is cut
    where its case needs: the parts' concatenation, which is what a resume checks, is the same.)"""
    def parted(root, cuts):
        streams = shutil.copytree(arc_streams, root / "streams")
        split_stream(streams, 0, cuts)
        return host_args(streams, root, 0, tiny_checkpoints["gqa_tied"], "--store_memory_gb", "0.0003")

    killed = tmp_path / "killed" / "machine_000"
    proc = gated_runner(parted(tmp_path / "killed", [3, 7]), killed, tmp_path / "gate")  # held at its first shard
    checkpoint = killed / "checkpoint.json"
    while not (checkpoint.exists() and json.loads(checkpoint.read_text())["total_shards"]):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.kill()
    proc.communicate()
    at_kill = json.loads(checkpoint.read_text())  # one shard, or two (a batch past the gate)
    done = at_kill["total_samples_processed"]
    assert 1 < done < 11
    expected = uninterrupted / "machine_000"
    for name, cuts in (("at_part", [done]), ("inside", [done - 1, done + 1])):
        shutil.copytree(killed, tmp_path / name / "machine_000")
        result = run_host_cli(*parted(tmp_path / name, cuts))
        assert result.returncode == 0, result.stderr
        assert f"resuming after {at_kill['total_shards']} shards / {done} samples" in result.stderr
        machine = tmp_path / name / "machine_000"
        assert shard_contents(machine) == shard_contents(expected)
        assert index_rows(machine) == index_rows(expected)
    metadata = json.loads((tmp_path / "inside" / "machine_000" / "metadata.json").read_text())
    assert metadata["stream"] == str(tmp_path / "inside" / "streams" / "stream_000")


def kill_at_a_random_moment(proc, machine_dir: pathlib.Path, num_shards: int, rng: random.Random) -> bool:
    """SIGKILLs ``proc`` once a random number of shard files exist, a random instant later (so
    some kills land in start-up, some between shards, some mid-write); False if it ended first."""
    target = rng.randint(0, num_shards - 1)
    while proc.poll() is None:
        if len(list(machine_dir.glob("shard_*"))) >= target:
            time.sleep(rng.uniform(0.0, 0.05))
            if proc.poll() is not None:
                return False
            proc.kill()
            proc.communicate()
            return True
        time.sleep(0.02)
    return False


def run_with_kills(args, machine_dir: pathlib.Path, num_shards: int, rng: random.Random,
                   max_kills: int = 3) -> list[dict | None]:
    """Runs the runner with ``args`` until it completes, SIGKILLing up to ``max_kills`` of its
    starts at random moments; returns the checkpoint found after each kill (None: none yet)."""
    at_kills = []
    for _ in range(12):
        proc = subprocess.Popen([sys.executable, "-m", "runners.tpu_host", *args], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if len(at_kills) < max_kills and kill_at_a_random_moment(proc, machine_dir, num_shards, rng):
            checkpoint = machine_dir / "checkpoint.json"
            at_kills.append(json.loads(checkpoint.read_text()) if checkpoint.exists() else None)
            continue
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        if COMPLETED in stdout:
            return at_kills
    raise AssertionError("the run did not complete in 12 starts")


def stats_files(machine_dir: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((machine_dir / "index").glob("shard_*_stats.parquet"))}


FOUR_SITES = "hook_resid_mid,attn.hook_z,hook_mlp_out,hook_resid_post"


def test_kill_9_at_random_moments_then_resume_gives_identical_output(arc_streams, tiny_checkpoints, tmp_path):
    # 60 records in windows of 3, ~30 shards: shards are stored all through the run, so kills
    # land in start-up, between shards and during a shard's store. Four sites at every layer.
    records = long_stream(arc_streams, tmp_path / "long.jsonl", copies=5)

    def args_for(out):
        return ["--machine_id", "0", "--dataset_stream", str(tmp_path / "long.jsonl"), "--model_path",
                tiny_checkpoints["gqa_tied"], "--output_dir", str(out), "--shard_size_gb", "0.0008",
                "--batch_size", "2", "--window", "3", "--max_seq_length", "160", "--dtype", "float32",
                "--sites", FOUR_SITES]

    baseline = run_host_cli(*args_for(tmp_path / "baseline"))
    assert baseline.returncode == 0, baseline.stderr
    expected_shards = shard_contents(tmp_path / "baseline" / "machine_000")
    expected_bytes = shard_bytes(tmp_path / "baseline" / "machine_000")
    expected_index = index_rows(tmp_path / "baseline" / "machine_000")
    expected_stats = stats_files(tmp_path / "baseline" / "machine_000")
    assert len(expected_stats) == len(expected_shards) > 10
    assert_statistics_of_the_arrays(tmp_path / "baseline", tmp_path / "baseline_index.parquet", len(records))
    rng = random.Random(1234)
    progress_at_kills = []
    for trial in range(3):
        for attempt in range(3):  # a kill aimed at the last shard may come after the run ended: again
            out = tmp_path / f"trial{trial}_{attempt}"
            at_kills = run_with_kills(args_for(out), out / "machine_000", len(expected_shards), rng)
            if at_kills:
                break
        assert at_kills
        progress_at_kills += [c["total_shards"] if c else 0 for c in at_kills]
        checkpoint = json.loads((out / "machine_000" / "checkpoint.json").read_text())
        assert checkpoint["status"] == COMPLETED
        assert shard_contents(out / "machine_000") == expected_shards
        assert shard_bytes(out / "machine_000") == expected_bytes  # the files, not only what they hold
        assert index_rows(out / "machine_000") == expected_index
        assert stats_files(out / "machine_000") == expected_stats  # so their merge is the same too
        files = sorted(p.name for p in (out / "machine_000").rglob("*") if p.is_file())
        assert not [f for f in files if f.endswith(".tmp")]
        # No orphans: the files of the uninterrupted run, no more.
        assert files == sorted(p.name for p in (tmp_path / "baseline" / "machine_000").rglob("*") if p.is_file())
    # Some kills landed mid-run: after some shards were stored but before the last.
    assert any(0 < n < len(expected_shards) for n in progress_at_kills), progress_at_kills


def long_stream(arc_streams, path, copies=80) -> list[dict]:
    """A stream of many records (stream 0 repeated under new ids), slow enough to interrupt."""
    base = read_streams(arc_streams, 2)[0]
    records = [{**r, "sample_id": r["sample_id"] + (k << 50)} for k in range(copies) for r in base]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_sigterm_stores_the_buffer_and_exits_with_the_stopped_code(arc_streams, tiny_checkpoints, tmp_path):
    records = long_stream(arc_streams, tmp_path / "long.jsonl", copies=4)
    args = ["--machine_id", "0", "--dataset_stream", str(tmp_path / "long.jsonl"), "--model_path",
            tiny_checkpoints["gqa_tied"], "--output_dir", str(tmp_path), "--shard_size_gb", "0.002",
            "--batch_size", "1", "--window", "1", "--max_seq_length", "160", "--dtype", "float32",
            "--store_memory_gb", "0.003",  # under two shards: each stored before the next fills
            "--stopped_exit_code", "143"]  # as the fleet's gke pods run it
    gate = tmp_path / "gate"
    proc = gated_runner(args, tmp_path / "machine_000", gate)
    while not list((tmp_path / "machine_000").glob("shard_*")):  # held there until the gate opens
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    gate.touch()
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert "stopped by signal" in stdout
    machine = tmp_path / "machine_000"
    checkpoint = json.loads((machine / "checkpoint.json").read_text())
    stored = [e["sample_id"] for p in sorted(machine.glob("shard_*.pkl.gz")) for e in load_shard(str(p))[0]]
    assert checkpoint["status"] == "in_progress"
    assert len(stored) == checkpoint["total_samples_processed"] > 0
    status = json.loads((machine / "status.json").read_text())
    assert status["state"] == "stopped" and status["samples_done"] == len(stored) and status["error"] is None
    assert stored == [r["sample_id"] for r in records[:len(stored)]]
    # Resuming finishes the stream with every sample exactly once, in order, and exits 0.
    result = run_host_cli(*args)
    assert result.returncode == 0, result.stderr
    ids = [e["sample_id"] for p in sorted(machine.glob("shard_*.pkl.gz")) for e in load_shard(str(p))[0]]
    assert ids == [r["sample_id"] for r in records]
