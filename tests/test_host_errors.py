"""The runner's user errors: one clear line, and nothing already done is lost."""

import json

import pytest

from tests.test_host import host_args, run_host_cli, shard_contents

pytestmark = pytest.mark.slow


def one_line_error(result, expected: str, prog: str = "runners.tpu_host") -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert lines and lines[-1].startswith(f"{prog}: error:") and expected in lines[-1], lines
    assert not any("Traceback" in line for line in lines)


def test_malformed_line_is_reported_with_its_number_and_nothing_inconsistent_is_written(
        arc_streams, tiny_checkpoints, tmp_path):
    lines = (arc_streams / "stream_000.jsonl").read_text().splitlines()
    lines[7] = lines[7][:40]  # cut mid-record
    (tmp_path / "streams").mkdir()
    (tmp_path / "streams" / "stream_000.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    result = run_host_cli(*host_args(tmp_path / "streams", out, 0, tiny_checkpoints["gqa_tied"],
                                     "--window", "2", "--batch_size", "1"))
    one_line_error(result, "stream_000.jsonl:8: malformed JSON")
    status = json.loads((out / "machine_000" / "status.json").read_text())
    assert status["state"] == "failed"
    assert result.stderr.strip().splitlines()[-1] == f"runners.tpu_host: error: {status['error']}"
    checkpoint = json.loads((out / "machine_000" / "checkpoint.json").read_text())
    stored = [e[0] for shard in shard_contents(out / "machine_000").values() for e in shard[0]]
    assert checkpoint["status"] == "in_progress" and checkpoint["total_samples_processed"] == len(stored) < 7
    expected = [json.loads(line)["sample_id"] for line in lines[:len(stored)]]
    assert stored == expected
    assert sorted(p.name for p in (out / "machine_000").glob("shard_*")) == \
        [s["filename"] for s in checkpoint["shards"]]


def test_a_stream_that_is_not_utf8(arc_streams, tiny_checkpoints, tmp_path):
    lines = (arc_streams / "stream_000.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "streams").mkdir()
    (tmp_path / "streams" / "stream_000.jsonl").write_bytes(b"".join(lines[:2]) + b"\xff\xfe{\n")
    result = run_host_cli(*host_args(tmp_path / "streams", tmp_path / "out", 0, tiny_checkpoints["gqa_tied"]))
    one_line_error(result, "stream_000.jsonl:3: not UTF-8 text")


def test_machine_without_stream(arc_streams, tiny_checkpoints, tmp_path):
    result = run_host_cli(*host_args(arc_streams, tmp_path, 5, tiny_checkpoints["gqa_tied"]))
    one_line_error(result, "no stream file for machine 5")


def test_corrupted_checkpoint_keeps_the_shards(arc_streams, tiny_checkpoints, tmp_path):
    args = host_args(arc_streams, tmp_path, 1, tiny_checkpoints["gqa_tied"], "--max_samples", "4")
    assert run_host_cli(*args).returncode == 0
    machine = tmp_path / "machine_001"
    before = shard_contents(machine)
    (machine / "checkpoint.json").write_text('{"total_shards": 3, "sta')
    one_line_error(run_host_cli(*args), "corrupted checkpoint")
    assert shard_contents(machine) == before and before


def test_unwritable_output_dir(arc_streams, tiny_checkpoints, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    one_line_error(run_host_cli(*host_args(arc_streams, blocker / "out", 0, tiny_checkpoints["gqa_tied"])),
                   "is not writable")


def test_layer_past_the_model_and_bad_flags(arc_streams, tiny_checkpoints, tmp_path):
    one_line_error(run_host_cli(*host_args(arc_streams, tmp_path, 0, tiny_checkpoints["gqa_tied"],
                                           "--layers_to_extract", "1,9")),
                   "layer 9 does not exist: the model has 4 layers")
    one_line_error(run_host_cli(*host_args(arc_streams, tmp_path, 0, tiny_checkpoints["gqa_tied"],
                                           "--upload_to_gcs")), "--upload_to_gcs needs --gcs_bucket")


def test_a_resume_with_other_output_settings_is_refused(arc_streams, tiny_checkpoints, tmp_path):
    args = host_args(arc_streams, tmp_path, 1, tiny_checkpoints["gqa_tied"])  # --dtype float32
    assert run_host_cli(*args, "--max_samples", "3", "--layers_to_extract", "0", "1", "2", "3").returncode == 0
    # The same settings in other words: all layers, auto (float32 on CPU). It goes on.
    assert run_host_cli(*args, "--max_samples", "4", "--dtype", "auto").returncode == 0
    before = shard_contents(tmp_path / "machine_001")
    one_line_error(run_host_cli(*args, "--max_samples", "6", "--long_samples", "skip",
                                "--layers_to_extract", "1"),
                   "this machine's stored output was made with other settings (--layers_to_extract "
                   "[0, 1, 2, 3] -> [1]; --long_samples 'truncate' -> 'skip')")
    assert shard_contents(tmp_path / "machine_001") == before


def test_a_stream_changed_under_a_resume_is_refused(arc_streams, tiny_checkpoints, tmp_path):
    (tmp_path / "streams").mkdir()
    stream = tmp_path / "streams" / "stream_000.jsonl"
    lines = (arc_streams / "stream_000.jsonl").read_text().splitlines()
    stream.write_text("\n".join(lines) + "\n")
    args = host_args(tmp_path / "streams", tmp_path / "out", 0, tiny_checkpoints["gqa_tied"])
    assert run_host_cli(*args, "--max_samples", "4", "--shard_size_gb", "0.00001").returncode == 0
    checkpoint = json.loads((tmp_path / "out" / "machine_000" / "checkpoint.json").read_text())
    done = checkpoint["total_samples_processed"]
    changed = json.loads(lines[done - 1])
    lines[done - 1] = json.dumps({**changed, "sample_id": changed["sample_id"] + 1})
    stream.write_text("\n".join(lines) + "\n")
    one_line_error(run_host_cli(*args), f"changed since the checkpoint: line {done} is no longer sample")


def test_gcs_prefix_takes_the_machine_id():
    from common.cli import UserError
    from host.config import HostConfig
    config = HostConfig(machine_id=7, streams_dir="s", model_path="m", upload_to_gcs=True, gcs_bucket="b",
                        gcs_prefix="run/machine_{machine_id:03d}")
    config.validate()
    assert config.prefix == "run/machine_007"
    assert HostConfig(machine_id=7, gcs_prefix="plain/prefix").prefix == "plain/prefix"
    bad = HostConfig(machine_id=7, streams_dir="s", model_path="m", gcs_prefix="run/{machine}")
    with pytest.raises(UserError, match=r"--gcs_prefix 'run/\{machine\}': the only field"):
        bad.validate()


def test_float16_storage_of_values_past_its_range_is_refused_before_anything_is_stored(
        arc_streams, tiny_checkpoints, tmp_path):
    """Embeddings scaled so that the stream exceeds float16's +-65504 (as Gemma's does)."""
    import shutil

    from safetensors.numpy import load_file, save_file
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["gqa_tied"], model)
    tensors = load_file(model / "model.safetensors")
    tensors["model.embed_tokens.weight"] *= 1e7
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    result = run_host_cli(*host_args(arc_streams, out, 0, str(model), "--activation_dtype", "float16",
                                     "--layers_to_extract", "0,3"))
    one_line_error(result, "--activation_dtype float16: layer 0 holds values past float16's range (+-65504), "
                           "which would be stored as inf; store this model's activations as bfloat16")
    assert not list((out / "machine_000").glob("shard_*"))
