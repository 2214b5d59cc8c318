"""Bad input to ``runners.fleet``: one line naming the problem, exit status 2, nothing created."""

import pathlib

import pytest

from tests.conftest import run_in_process
from tests.test_host_errors import one_line_error


def fleet(*args, env=None):
    return run_in_process("runners.fleet", *args, env=env)


def fleet_error(result, expected: str) -> None:
    one_line_error(result, expected, prog="runners.fleet")


def upload_streams(emulator, streams: pathlib.Path, bucket: str = "acts", prefix: str = "streams") -> str:
    """The prepare output copied to the GCS emulator; returns its gs:// URL."""
    client_bucket = emulator.client().bucket(bucket)
    for path in sorted(streams.iterdir()):
        if path.is_file():
            client_bucket.blob(f"{prefix}/{path.name}").upload_from_filename(str(path))
    return f"gs://{bucket}/{prefix}"


def local_args(streams, out, *extra):
    return ["--name", "bad", "--streams_dir", str(streams), "--output", str(out), *extra,
            "--", "--model_path", "some/model"]


def test_num_machines_different_from_the_manifest(arc_streams, tmp_path):
    result = fleet("launch", *local_args(arc_streams, tmp_path / "out", "--num_machines", "3"))
    fleet_error(result, "--num_machines 3 does not match the prepare manifest's num_machines 2")
    assert not (tmp_path / "out").exists()


def test_unknown_backend(arc_streams, tmp_path):
    fleet_error(fleet("launch", *local_args(arc_streams, tmp_path / "out", "--backend", "slurm")),
                "argument --backend: invalid choice: 'slurm'")


def test_a_bucket_that_does_not_exist(arc_streams, gcs, tmp_path):
    streams = upload_streams(gcs, arc_streams)
    result = fleet("launch", "--backend", "tpu-vm", "--project", "p", "--zone", "z", "--tpu_api_endpoint",
                   "http://127.0.0.1:9", *local_args(streams, "gs://no-such-bucket/run"))
    fleet_error(result, "GCS bucket 'no-such-bucket' of --output does not exist")


def test_gke_launch_without_an_image(arc_streams, gcs):
    streams = upload_streams(gcs, arc_streams)
    fleet_error(fleet("launch", "--backend", "gke", *local_args(streams, "gs://acts/run")),
                "--backend gke needs --image")


def test_cloud_backend_with_a_local_output(arc_streams, tmp_path):
    fleet_error(fleet("launch", "--backend", "tpu-vm", *local_args(arc_streams, tmp_path)),
                "--backend tpu-vm needs a gs:// --streams_dir")


def test_teardown_of_a_fleet_that_was_never_launched(arc_streams, tmp_path):
    fleet_error(fleet("teardown", *local_args(arc_streams, tmp_path / "out")),
                "fleet 'bad' was never launched: no runner processes recorded in")


@pytest.mark.parametrize("runner, expected", [
    (["--machine_id", "3"], "runner flag --machine_id is set by the fleet"),
    (["--batch_size", "0"], "runner flags: --batch_size must be at least 1"),
    (["--bogus", "1"], "runner flags: unrecognized arguments: --bogus 1"),
])
def test_runner_flags_are_checked_before_anything_starts(arc_streams, tmp_path, runner, expected):
    result = fleet("launch", "--name", "bad", "--streams_dir", str(arc_streams), "--output",
                   str(tmp_path / "out"), "--", "--model_path", "m", *runner)
    fleet_error(result, expected)
    assert not (tmp_path / "out").exists()


def test_config_file_errors(arc_streams, tmp_path):
    config = tmp_path / "fleet.yaml"
    config.write_text("name: x\nstreams_dir: s\nmax_paralel: 2\n")
    fleet_error(fleet("status", "--config", str(config)), "unknown setting(s) max_paralel")
    fleet_error(fleet("status", "--config", str(tmp_path / "nope.yaml")), "does not exist")
    config.write_text("name: x\noutput: o\nnum_machines: 2\nprovisioning: preemptible\n")
    fleet_error(fleet("status", "--config", str(config)), "argument --provisioning: invalid choice: 'preemptible'")
    config.write_text("name: x\noutput: o\nnum_machines: 2\ngke: {gke_spot: 'false'}\n")
    fleet_error(fleet("status", "--config", str(config)), "gke_spot must be true or false, got 'false'")
    fleet_error(fleet("status", "--name", "Bad_Name", "--output", str(tmp_path)), "--name must be")
