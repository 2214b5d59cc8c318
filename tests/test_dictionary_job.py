"""The dictionary training job on a store: what it writes (metrics each step once, SAELens's files
SAELens loads), a kill -9 at any moment costing nothing (the resumed run's weights bitwise those of
an uninterrupted one), and bad input refused in one line before anything is written."""

from __future__ import annotations

import csv
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from fixtures.stored_activations import StoredSpec, write_stored
from tests.conftest import run_in_process

sae_lens = pytest.importorskip("sae_lens")

# A transcoder's pair: hook_mlp_out is a fixed linear map of ln2.hook_normalized plus a little noise.
STORE = StoredSpec(num_machines=2, samples_per_machine=10, lengths=(8, 24), hidden_size=8, layers=(0,),
                   sites=("hook_resid_post", "ln2.hook_normalized", "hook_mlp_out"),
                   linked=("ln2.hook_normalized", "hook_mlp_out"), shard_size_bytes=4_000)
SAE = ("--site", "blocks.0.hook_resid_post", "--architecture", "topk", "--k", "3", "--expansion", "4",
       "--steps", "24", "--batch_tokens", "32", "--buffer_tokens", "128", "--checkpoint_every", "5",
       "--log_every", "6", "--lr", "3e-3", "--dead_feature_window", "4", "--eval_tokens", "48")


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> str:
    return write_stored(str(tmp_path_factory.mktemp("store")), STORE)


def train(index: str, output_dir, *flags: str):
    return run_in_process("runners.train_dictionary", "--index", index, "--output_dir", str(output_dir), *flags)


def metric_steps(output_dir) -> list[int]:
    with open(os.path.join(output_dir, "metrics.csv"), newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def test_an_sae_trains_logs_every_step_once_and_saelens_loads_it(index, tmp_path):
    done = train(index, tmp_path / "sae", *SAE)
    assert done.returncode == 0, done.stderr
    assert "runners.train_dictionary: topk, 24 steps; blocks.0.hook_resid_post: 8 -> 32 latents -> 8" in done.stdout
    assert metric_steps(tmp_path / "sae") == list(range(24))
    events = b"".join(p.read_bytes() for p in (tmp_path / "sae" / "tensorboard").iterdir())
    assert all(f"train/{name}".encode() in events for name in ("loss", "explained_variance", "l0", "dead"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = sae_lens.SAE.load_from_disk(str(tmp_path / "sae"))
    assert type(loaded).__name__ == "TopKSAE" and loaded.cfg.metadata.hook_name == "blocks.0.hook_resid_post"
    again = train(index, tmp_path / "sae", *SAE)  # a finished run: nothing left, the same files
    assert again.returncode == 0 and "(resumed at 24)" in again.stdout


@pytest.mark.slow  # 150 steps; the transcoder's files and losses are checked fast elsewhere
def test_a_transcoder_between_two_sites_learns_their_map(index, tmp_path):
    done = train(index, tmp_path / "tc", "--site", "blocks.0.ln2.hook_normalized", "--target",
                 "blocks.0.hook_mlp_out", "--architecture", "batchtopk", "--k", "4", "--expansion", "4",
                 "--steps", "150", "--batch_tokens", "32", "--lr", "1e-2", "--log_every", "50", "--eval_tokens", "48")
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "tc" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    first, last = (np.mean([float(r["explained_variance"]) for r in part]) for part in (rows[:10], rows[-10:]))
    assert last > first + 0.3, (first, last)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = sae_lens.SAE.load_from_disk(str(tmp_path / "tc"))
    assert type(loaded).__name__ == "JumpReLUTranscoder"
    assert loaded.cfg.metadata.hook_name_out == "blocks.0.hook_mlp_out"


@pytest.mark.parametrize("flags, message", [
    (("--site", "blocks.0.hook_attn_out"), "blocks.0.hook_attn_out"),
    (("--site", "blocks.0.hook_resid_post", "--architecture", "gated"), "unknown architecture 'gated'"),
    (("--site", "blocks.0.ln2.hook_normalized", "--target", "blocks.0.hook_mlp_out", "--architecture", "topk"),
     "SAELens has no TopK transcoder"),
    (("--site", "blocks.0.hook_resid_post", "--steps", "10", "--lr_warm_up_steps", "8", "--lr_decay_steps", "4"),
     "exceed the training's 10 steps"),
])
def test_bad_input_is_one_line_and_writes_nothing(index, tmp_path, flags, message):
    result = train(index, tmp_path / "out", *flags)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1].startswith("runners.train_dictionary: error:"), result.stderr
    assert message in lines[-1] and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_a_resume_with_changed_settings_is_refused(index, tmp_path):
    assert train(index, tmp_path / "sae", *SAE).returncode == 0
    changed = train(index, tmp_path / "sae", *SAE, "--k", "4")
    assert changed.returncode == 2 and "--k 3.0 -> 4.0" in changed.stderr.splitlines()[-1], changed.stderr


@pytest.mark.slow
def test_kill_9_at_random_moments_then_the_same_command_ends_with_the_uninterrupted_weights(index, tmp_path):
    """Runner processes SIGKILLed at random moments (start-up, steps, checkpoints, metrics), each
    resumed by the next: the final weights are bitwise the uninterrupted run's, every step in
    metrics.csv once."""
    def command(out) -> list[str]:
        return [sys.executable, "-m", "runners.train_dictionary", "--index", index, "--output_dir", str(out), *SAE]
    start = time.perf_counter()
    assert subprocess.run(command(tmp_path / "whole"), capture_output=True).returncode == 0
    whole = time.perf_counter() - start
    expected = (tmp_path / "whole" / "sae_weights.safetensors").read_bytes()
    rng, kills = random.Random(70), 0
    for trial in range(3):
        out = tmp_path / f"trial_{trial}"
        while True:
            process = subprocess.Popen(command(out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                process.wait(timeout=rng.uniform(0.1, 0.8) * whole)
                break
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGKILL)
                process.wait()
                kills += 1
        assert process.returncode == 0
        assert (out / "sae_weights.safetensors").read_bytes() == expected
        assert metric_steps(out) == list(range(24))
    assert kills >= 1  # the resume path ran (how many kills land depends on how each run's time varies)
