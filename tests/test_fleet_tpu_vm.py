"""The tpu-vm backend through the real ``google-cloud-tpu`` client against a local server of the
queued-resource API, with the output on the GCS emulator.

A created TPU VM "runs" by writing the files a completed runner leaves on GCS (index, metadata,
checkpoint, status) for its stream's records; the fake preempts one machine once, and
``supervise`` must recreate exactly that one.
"""

import json
import shlex

import pytest

from activations.index import ARRAYS_SCHEMA, arrays_index_filename, index_filename, parquet_bytes, shard_index
from tests.conftest import read_streams, run_in_process
from tests.cloud_fakes import FakeTpuApi
from tests.test_fleet_errors import upload_streams
from host.states import COMPLETED

QR_PARENT = "projects/proj/locations/us-central2-b"


def completed_machine_files(records: list[dict], machine: int) -> dict[str, bytes]:
    """What a runner that stored ``records`` in one shard leaves under machine_NNN/ on GCS."""
    shard = f"gs://acts/run/machine_{machine:03d}/shard_0001.pkl.gz"
    samples = [{**r, "text_preview": "", "truncated": False, "original_num_tokens": None} for r in records]
    checkpoint = {"status": COMPLETED, "total_shards": 1, "total_samples_processed": len(records),
                  "last_processed_sample_idx": records[-1]["sample_id"],
                  "shards": [{"shard_id": 1, "total_samples_in_shard": len(records)}]}
    metadata = {"machine_id": machine, "status": COMPLETED, "total_shards": 1,
                "total_samples": len(records), "shards": checkpoint["shards"]}
    status = {"machine_id": machine, "state": COMPLETED, "updated_at": "2026-11-22T10:00:00+00:00",
              "heartbeat_s": 60.0, "samples_done": len(records), "samples_total": len(records)}
    return {index_filename(1): parquet_bytes(shard_index(samples, machine, 1, shard, [6], 64, "float32")),
            arrays_index_filename(1): parquet_bytes(ARRAYS_SCHEMA.empty_table()),
            "checkpoint.json": json.dumps(checkpoint).encode(), "metadata.json": json.dumps(metadata).encode(),
            "status.json": json.dumps(status).encode()}


@pytest.fixture
def tpu_fleet(arc_streams, gcs, tmp_path):
    """(fake TPU API, fleet flags, boots per node): machine 1's first VM is preempted before it
    stores anything; every other VM completes its stream."""
    streams = read_streams(arc_streams, 2)
    bucket = gcs.client().bucket("acts")
    boots: dict[str, int] = {}

    def boot(node_id: str) -> None:
        boots[node_id] = boots.get(node_id, 0) + 1
        machine = int(node_id.rsplit("-", 1)[1])
        if node_id == "t-001" and boots[node_id] == 1:
            return  # preempted (below) before its runner stored anything
        for name, data in completed_machine_files(streams[machine], machine).items():
            bucket.blob(f"run/machine_{machine:03d}/{name}").upload_from_string(data)

    with FakeTpuApi(on_create=boot) as api:
        args = ["--name", "t", "--backend", "tpu-vm", "--project", "proj", "--zone", "us-central2-b",
                "--accelerator_type", "v5litepod-8", "--provisioning", "spot", "--stagger_s", "0",
                "--tpu_api_endpoint", api.endpoint, "--streams_dir", upload_streams(gcs, arc_streams),
                "--output", "gs://acts/run", "--interval", "0.2",
                "--", "--model_path", "Qwen/Qwen2.5-7B", "--layers_to_extract", "6"]
        yield api, args, boots


def fleet(command, args, *extra):
    return run_in_process("runners.fleet", command, *extra, *args)


def test_launch_one_queued_resource_per_machine(tpu_fleet, gcs):
    api, args, boots = tpu_fleet
    result = fleet("launch", args)
    assert result.returncode == 0, result.stderr
    assert [body["queuedResourceId"] for body in api.created] == ["t-000", "t-001"]
    for machine, body in enumerate(api.created):
        [spec] = body["tpu"]["nodeSpec"]  # one node per request: never a multislice
        assert spec["parent"] == QR_PARENT and spec["nodeId"] == f"t-{machine:03d}"
        assert "spot" in body and "guaranteed" not in body
        node = spec["node"]
        assert node["acceleratorType"] == "v5litepod-8" and node["runtimeVersion"] == "tpu-ubuntu2204-base"
        assert node["labels"] == {"fleet": "t"} and node["metadata"]["machine-id"] == str(machine)
        script = node["metadata"]["startup-script"]
        assert "gcloud storage cp gs://acts/run/_fleet/activation_extraction-0.1.0-py3-none-any.whl" in script
        assert "python3 -m pip install --quiet 'jax[tpu]'" in script
        runner = next(line for line in script.splitlines() if line.startswith("python3 -m runners.tpu_host"))
        words = shlex.split(runner.rstrip(" &"))
        assert words[3:7] == ["--machine_id", "auto", "--streams_dir", "gs://acts/streams"]
        assert "--upload_to_gcs" in words and words[words.index("--gcs_prefix") + 1] == "run/machine_{machine_id:03d}"
        assert words[-4:] == ["--model_path", "Qwen/Qwen2.5-7B", "--layers_to_extract", "6"]
        assert "LOG_URL=gs://acts/run/machine_$(printf %03d \"$MACHINE\")/logs/" in script
    wheels = [b.name for b in gcs.client().list_blobs("acts", prefix="run/_fleet/")]
    assert "run/_fleet/activation_extraction-0.1.0-py3-none-any.whl" in wheels and "run/_fleet/fleet.json" in wheels
    again = fleet("launch", args)
    assert again.returncode == 0 and "nothing to launch" in again.stdout and len(api.created) == 2


def test_supervise_recreates_exactly_the_preempted_machine_then_merges(tpu_fleet):
    api, args, boots = tpu_fleet
    assert fleet("launch", args).returncode == 0
    api.preempt("t-001")
    status = fleet("status", args)
    assert status.returncode == 2 and "001      MISSING" in status.stdout
    supervised = fleet("supervise", args)
    assert supervised.returncode == 0, supervised.stderr
    actions = [line for line in supervised.stderr.splitlines() if "recreating" in line]
    assert len(actions) == 1 and "machine 001: queued resource SUSPENDED; recreating it (restart 1 of 3)" in actions[0]
    assert api.deleted == [f"{QR_PARENT}/queuedResources/t-001"]
    assert [b["queuedResourceId"] for b in api.created] == ["t-000", "t-001", "t-001"]
    assert boots == {"t-000": 1, "t-001": 2}
    assert "fleet t complete: 2 machines, 24 samples" in supervised.stdout


def test_dry_run_and_teardown(tpu_fleet):
    api, args, boots = tpu_fleet
    plan = fleet("launch", args, "--dry_run")
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.count('"nodeId": "t-') == 2 and not api.created and not boots
    never = fleet("teardown", args)
    assert never.returncode == 2
    assert "fleet 't' was never launched: no queued resources labelled fleet=t" in never.stderr
    assert fleet("launch", args).returncode == 0
    listed = fleet("teardown", args, "--dry_run")
    assert "would delete 2 machine(s) of fleet t" in listed.stdout and not api.deleted
    down = fleet("teardown", args)
    assert down.returncode == 0 and "deleted 2 machine(s)" in down.stdout, down.stderr
    assert sorted(api.deleted) == [f"{QR_PARENT}/queuedResources/t-00{i}" for i in range(2)]
    assert not api.queued_resources()
