"""status.json of a real run, read while it runs (the way a fleet watches its hosts)."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.conftest import REPO, read_streams
from fixtures.hf_reference import random_sequences
from common.states import COMPLETED
from host.store_stats import STAGES

pytestmark = pytest.mark.slow
PHASE = {"starting": 0, "loading": 1, "compiling": 2, "running": 2, COMPLETED: 3, "stopped": 3, "failed": 3}
TRANSITIONS = {("starting", "loading"), ("loading", "running"), ("running", "compiling"),
               ("compiling", "running"), ("running", COMPLETED)}


def watch(args, status_path, env=None, poll_s=0.02, command=None):
    """Runs the runner (in ``env``, default this one; ``command``: python's arguments instead of
    ``-m runners.tpu_host args``) while polling its status.json; (exit code, stdout, stderr, the
    distinct statuses seen, in order)."""
    out, err = (tempfile.TemporaryFile("w+") for _ in range(2))  # a pipe could fill and block it
    proc = subprocess.Popen([sys.executable, *(command or ["-m", "runners.tpu_host", *args])], cwd=REPO,
                            text=True, stdout=out, stderr=err, env=env)
    seen = []
    while proc.poll() is None:
        try:
            status = json.loads(status_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            status = None
        if status and (not seen or status["updated_at"] != seen[-1]["updated_at"]):
            seen.append(status)
        time.sleep(poll_s)
    seen.append(json.loads(status_path.read_text()))
    out.seek(0)
    err.seek(0)
    return proc.returncode, out.read(), err.read(), seen


def test_states_in_order_with_the_machine_id_from_the_metadata_server(arc_streams, tiny_checkpoints,
                                                                      tmp_path, metadata_server):
    metadata_server.attributes["machine-id"] = "1"
    env = {k: v for k, v in os.environ.items() if k != "JOB_COMPLETION_INDEX"}
    env["GCE_METADATA_HOST"] = metadata_server.host
    args = ["--machine_id", "auto", "--streams_dir", str(arc_streams), "--model_path",
            tiny_checkpoints["gqa_tied"], "--output_dir", str(tmp_path), "--shard_size_gb", "0.0002",
            "--batch_size", "1", "--window", "2", "--max_seq_length", "160", "--dtype", "float32",
            "--heartbeat_s", "0.1"]
    code, stdout, stderr, seen = watch(args, tmp_path / "machine_001" / "status.json", env)
    assert code == 0, stderr
    assert "machine id 1 from metadata attribute machine-id '1'" in stderr
    states = [s["state"] for s in seen]  # as polled: a short state may fall between two looks
    assert [PHASE[s] for s in states] == sorted(PHASE[s] for s in states), states  # never backwards
    assert "running" in states and states[-1] == COMPLETED, states
    final = seen[-1]
    history = [h["state"] for h in final["history"]]  # every transition
    assert {"loading", "compiling", "running"} <= set(history), history
    assert history[0] == "starting" and history[-1] == COMPLETED
    assert all(pair in TRANSITIONS for pair in zip(history, history[1:])), history
    stream = read_streams(arc_streams, 2)[1]
    checkpoint = json.loads((tmp_path / "machine_001" / "checkpoint.json").read_text())
    assert final["machine_id"] == 1 and final["error"] is None
    assert final["samples_done"] == final["samples_total"] == final["samples_computed"] == len(stream)
    assert all(s["samples_computed"] >= s["samples_done"] for s in seen if "samples_computed" in s)
    assert final["tokens_done"] == sum(r["num_tokens"] for r in stream)
    assert final["shards"] == checkpoint["total_shards"] > 1
    assert final["truncated"] == sum(r["truncated"] for r in stream) and final["skipped"] == 0
    assert final["compiles"] >= 1 and final["compile_s"] > 0 and final["host_rss_gb"] > 0.1
    assert (final["backend"], final["device_count"]) == ("cpu", 8)
    assert final["tokens_per_s"]["since_start"] > 0
    assert final["started_at"] < final["updated_at"]
    store = final["store"]  # the store path's figures: every stage, the bytes it moved
    assert list(store["stage_s"]) == list(STAGES)
    assert all(store["stage_s"][stage] > 0 for stage in ("encode", "compress", "write", "fsync", "commit"))
    stored_mb = sum(shard["file_size_mb"] for shard in checkpoint["shards"])
    assert store["written_gb"] == pytest.approx(stored_mb * 2**20 / 1e9, abs=1e-4)
    assert store["activations_gb"] > 0 and store["uploaded_gb"] == 0 and store["in_flight_shards"] == 0
    assert 0 <= store["forward_waited_fraction"] < 1 and store["compression_threads"] >= 1
    # While it ran, samples_total was known and samples_done only grew.
    running = [s for s in seen if s["state"] == "running"]
    assert any(s["samples_total"] == len(stream) for s in running)
    assert [s["samples_done"] for s in seen] == sorted(s["samples_done"] for s in seen)


# The runner, its start-up held open until the test signals it (a start-up that reads a long
# stream before the model loads): when the signal lands must not depend on this machine's speed.
HELD_START_UP = """
import pathlib, time
import host.run
def held_check_lengths(*args, **kwargs):
    pathlib.Path({gate!r}).touch()
    time.sleep(120)  # the signal's handler raises out of the sleep
host.run.check_lengths = held_check_lengths
from common.cli import run_main
from runners.tpu_host import main
run_main("runners.tpu_host", main, {args!r})
"""


def test_sigterm_during_start_up_stops_at_once(tiny_checkpoints, tmp_path):
    stream = tmp_path / "small.jsonl"
    stream.write_text("".join(json.dumps({"sample_id": i, "input_ids": [7] * 20, "num_tokens": 20, "source": "s",
                                          "text_preview": ""}) + "\n" for i in range(4)))
    args = ["--machine_id", "0", "--dataset_stream", str(stream), "--model_path", tiny_checkpoints["gqa_tied"],
            "--output_dir", str(tmp_path / "out"), "--long_samples", "error", "--max_seq_length", "64"]
    gate = tmp_path / "in_start_up"
    proc = subprocess.Popen([sys.executable, "-c", HELD_START_UP.format(gate=str(gate), args=args)], cwd=REPO,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while not gate.exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "stopped: received SIGTERM before any sample was computed" in stdout
    status = json.loads((tmp_path / "out" / "machine_000" / "status.json").read_text())
    assert status["state"] == "stopped" and "loading" not in [h["state"] for h in status["history"]]
    assert not list((tmp_path / "out" / "machine_000").glob("shard_*"))


# The runner, with every batch's copy back to the host made slow on purpose (as a long batch on a
# big model is): the test must not depend on how fast this machine computes.
SLOW_BATCHES = """
import time
from model.extract import Extractor
collect = Extractor.collect
def slow_collect(self, batch):
    time.sleep({seconds})
    return collect(self, batch)
Extractor.collect = slow_collect
from common.cli import run_main
from runners.tpu_host import main
run_main("runners.tpu_host", main, {args!r})
"""


def test_the_heartbeat_goes_on_during_a_long_batch(tiny_checkpoints, tmp_path):
    sequences = random_sequences([40] * 8, seed=5)  # one global batch: 1 per device x 8 devices
    stream = tmp_path / "long.jsonl"
    stream.write_text("".join(json.dumps({"sample_id": i, "input_ids": ids, "num_tokens": len(ids),
                                          "source": f"r{i}", "text_preview": ""}) + "\n"
                              for i, ids in enumerate(sequences)))
    args = ["--machine_id", "0", "--dataset_stream", str(stream), "--model_path", tiny_checkpoints["gqa_tied"],
            "--output_dir", str(tmp_path / "out"), "--batch_size", "1", "--max_seq_length", "64",
            "--dtype", "float32", "--heartbeat_s", "0.05"]
    script = SLOW_BATCHES.format(seconds=2.0, args=args)
    code, _, stderr, seen = watch(args, tmp_path / "out" / "machine_000" / "status.json",
                                  command=["-c", script])
    assert code == 0, stderr
    compiled_at = [h["at"] for h in seen[-1]["history"] if h["state"] == "running"][-1]  # then the batch
    during_batch = [s for s in seen if s["state"] == "running" and s["samples_done"] == 0
                    and s["updated_at"] > compiled_at]
    # 2 s at a beat every 0.05 s is 40 beats; 5 leave room for a busy machine's scheduling.
    assert len(during_batch) >= 5, [(s["state"], s["samples_done"], s["updated_at"]) for s in seen]
    assert seen[-1]["state"] == COMPLETED and seen[-1]["samples_done"] == 8
