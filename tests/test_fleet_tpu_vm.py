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
from tests.conftest import read_streams, run_in_process, wait_for
from tests.cloud_fakes import FakeTpuApi
from tests.test_fleet_errors import upload_streams
from fleet.machines import parse_time
from common.states import COMPLETED

QR_PARENT = "projects/proj/locations/us-central2-b"


def completed_machine_files(records: list[dict], machine: int) -> dict[str, bytes]:
    """What a runner that stored ``records`` in one shard leaves under machine_NNN/ on GCS."""
    shard = f"gs://acts/run/machine_{machine:03d}/shard_0001.pkl.gz"
    samples = [{**r, "text_preview": "", "truncated": False, "original_num_tokens": None} for r in records]
    checkpoint = {"status": COMPLETED, "total_shards": 1, "total_samples_processed": len(records),
                  "total_tokens": sum(len(r["input_ids"]) for r in records),
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


def store_completion(gcs, streams, machine: int) -> None:
    bucket = gcs.client().bucket("acts")
    for name, data in completed_machine_files(streams[machine], machine).items():
        bucket.blob(f"run/machine_{machine:03d}/{name}").upload_from_string(data)


@pytest.fixture
def fake_tpu(arc_streams, gcs):
    """``start(boot)``: the fake TPU API, each created VM "booting" by ``boot(node_id, boots,
    complete)`` on a thread (``complete(machine)`` stores that machine's completed files); returns
    (API, fleet flags, boots per node)."""
    streams = read_streams(arc_streams, 2)
    servers = []

    def start(boot):
        boots: dict[str, int] = {}

        def on_create(node_id: str) -> None:
            boots[node_id] = boots.get(node_id, 0) + 1
            boot(node_id, boots, lambda machine: store_completion(gcs, streams, machine))

        api = FakeTpuApi(on_create=on_create).start()
        servers.append(api)
        args = ["--name", "t", "--backend", "tpu-vm", "--project", "proj", "--zone", "us-central2-b",
                "--accelerator_type", "v5litepod-8", "--provisioning", "spot", "--stagger_s", "0",
                "--tpu_api_endpoint", api.endpoint, "--streams_dir", upload_streams(gcs, arc_streams),
                "--output", "gs://acts/run", "--interval", "0.2",
                "--", "--model_path", "Qwen/Qwen2.5-7B", "--layers_to_extract", "6"]
        return api, args, boots

    yield start
    for api in servers:
        api.close()


@pytest.fixture
def tpu_fleet(fake_tpu):
    """Machine 1's first VM is preempted (by the test) before it stores anything; every other VM
    completes its stream."""
    def boot(node_id, boots, complete):
        if node_id == "t-001" and boots[node_id] == 1:
            return  # preempted (below) before its runner stored anything
        complete(int(node_id.rsplit("-", 1)[1]))
    return fake_tpu(boot)


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
    # the preempted one, then each, completed, is released
    assert sorted(api.deleted) == [f"{QR_PARENT}/queuedResources/t-00{i}" for i in (0, 1, 1)]
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


def hours_by_node(api: FakeTpuApi) -> dict[str, float]:
    """The fake's billed hours per node (all its incarnations)."""
    out: dict[str, float] = {}
    for interval in api.active:
        out[interval["node_id"]] = out.get(interval["node_id"], 0.0) + (interval["end"] - interval["start"]) / 3600
    return out


def test_each_machine_is_released_as_soon_as_its_completion_is_stored(fake_tpu):
    """Machine 1 completes only once machine 0's queued resource is gone: so machine 0 was
    deleted while machine 1 still ran, not at the end."""
    def boot(node_id, boots, complete):
        if node_id == "t-001":
            wait_for(lambda: f"{QR_PARENT}/queuedResources/t-000" in api.deleted)
        complete(int(node_id.rsplit("-", 1)[1]))

    api, args, boots = fake_tpu(boot)
    assert fleet("launch", args).returncode == 0
    supervised = fleet("supervise", args, "--price_per_hour", "1.5")
    assert supervised.returncode == 0, supervised.stderr
    released = [line for line in supervised.stderr.splitlines() if "completed and stored; deleted" in line]
    assert [line.split("machine ")[1][:3] for line in released] == ["000", "001"]
    assert api.deleted == [f"{QR_PARENT}/queuedResources/t-00{i}" for i in range(2)] and not api.queued_resources()
    assert boots == {"t-000": 1, "t-001": 1} and "fleet t complete" in supervised.stdout

    status = fleet("status", args, "--json", "--price_per_hour", "1.5")
    assert status.returncode == 0, status.stderr
    document = json.loads(status.stdout)
    billed = hours_by_node(api)
    for machine in document["machines"]:
        assert machine["state"] == COMPLETED and machine["released"] and not machine["active"]
        # the ledger ends an incarnation just before it asks for the deletion
        assert machine["accelerator_hours"] == pytest.approx(billed[f"t-{machine['machine_id']:03d}"], abs=1 / 3600)
        assert machine["cost"] == pytest.approx(1.5 * machine["accelerator_hours"])
    total = document["fleet"]
    assert total["accelerator_hours"] == pytest.approx(sum(billed.values()), abs=2 / 3600)
    assert total["cost"] == total["projected_cost"] == pytest.approx(1.5 * total["accelerator_hours"])
    assert total["tokens_per_accelerator_hour"] == pytest.approx(total["tokens_done"] / total["accelerator_hours"])
    table = fleet("status", args, "--price_per_hour", "1.5")
    assert "000      COMPLETED (released)" in table.stdout and "(at 1.5 per machine-hour)" in table.stdout


def test_keep_completed_keeps_them_and_a_preemption_is_billed_until_it(tpu_fleet, gcs):
    api, args, boots = tpu_fleet
    assert fleet("launch", args).returncode == 0
    api.preempt("t-001")
    supervised = fleet("supervise", args, "--keep_completed")
    assert supervised.returncode == 0, supervised.stderr
    assert api.deleted == [f"{QR_PARENT}/queuedResources/t-001"]  # the preempted one, recreated
    assert sorted(api.queued_resources()) == [f"{QR_PARENT}/queuedResources/t-00{i}" for i in range(2)]
    document = json.loads(fleet("status", args, "--json").stdout)
    by_machine = {m["machine_id"]: m for m in document["machines"]}
    assert by_machine[0]["active"] and not by_machine[0]["released"]
    assert by_machine[1]["active"] and by_machine[1]["cost"] is None
    assert fleet("teardown", args).returncode == 0 and not api.queued_resources()

    usage = json.loads(gcs.client().bucket("acts").blob("run/_fleet/usage.json").download_as_bytes())
    fake = {}  # node -> its intervals, in creation order
    for interval in api.active:
        fake.setdefault(interval["node_id"], []).append(interval)
    for machine, incarnations in usage["machines"].items():
        assert len(incarnations["incarnations"]) == len(fake[f"t-{machine}"])
        for ours, theirs in zip(incarnations["incarnations"], fake[f"t-{machine}"]):
            assert parse_time(ours["started_at"]) == pytest.approx(theirs["start"], abs=1)  # the API's time
            if (machine, theirs) == ("001", fake["t-001"][0]):
                assert parse_time(ours["ended_at"]) >= theirs["end"] - 1  # preempted: seen at the next look
            else:  # deleted (by teardown): ended as the deletion was asked for
                assert parse_time(ours["ended_at"]) == pytest.approx(theirs["end"], abs=2)
    after = json.loads(fleet("status", args, "--json").stdout)
    assert not any(m["active"] for m in after["machines"])
