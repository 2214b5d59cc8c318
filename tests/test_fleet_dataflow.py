"""The dataflow backend: ``launch`` submits ``pipeline.extract`` through Beam's ``DataflowRunner``
to a local server of the Dataflow REST API (``tests/fake_dataflow.py``), staging on the GCS
emulator; ``status``, ``supervise`` and ``teardown`` ask that server through
``google-cloud-dataflow-client``. No job runs: a test scripts the job's states and stores what
its machines would have written.
"""

import json

import pytest
from apache_beam.portability.api import beam_runner_api_pb2

from fleet.machines import parse_time
from host.status import iso_time
from tests.conftest import read_streams, run_in_process
from tests.fake_dataflow import FakeDataflow
from tests.test_fleet_errors import fleet_error, upload_streams
from tests.test_fleet_tpu_vm import completed_machine_files

IMAGE = "us-docker.pkg.dev/proj/repo/worker:1"
SERVICE_OPTION = "worker_accelerator=type:tpu-v5-lite-podslice;topology:2x4"
HOUR_S = 3600


@pytest.fixture
def dataflow(arc_streams, gcs):
    """(the fake API, the fleet's flags, the streams' records per machine)."""
    with FakeDataflow() as api:
        args = ["--name", "t", "--backend", "dataflow", "--project", "proj", "--region", "us-central1",
                "--tpu_type", "v5e", "--topology", "2x4", "--image", IMAGE, "--dataflow_endpoint", api.endpoint,
                "--streams_dir", upload_streams(gcs, arc_streams), "--output", "gs://acts/run", "--interval", "0.01",
                "--", "--model_path", "Qwen/Qwen2.5-7B", "--layers_to_extract", "6"]
        yield api, args, read_streams(arc_streams, 2)


def fleet(command, args, *extra):
    """``runners.fleet command`` with the fleet's flags, then ``extra`` (which win), then the runner's."""
    cut = args.index("--")
    return run_in_process("runners.fleet", command, *args[:cut], *extra, *args[cut:])


def launched(api, args) -> str:
    result = fleet("launch", args)
    assert result.returncode == 0, result.stderr[-3000:]
    return list(api.jobs())[-1]


def store_completion(gcs, records: list[dict], machine: int, started_at: str, updated_at: str) -> None:
    """What a runner that ran from ``started_at`` to ``updated_at`` and completed leaves on GCS."""
    files = completed_machine_files(records, machine)
    status = json.loads(files["status.json"])
    files["status.json"] = json.dumps({**status, "hostname": "worker-1", "started_at": started_at,
                                       "updated_at": updated_at}).encode()
    for name, data in files.items():
        gcs.client().bucket("acts").blob(f"run/machine_{machine:03d}/{name}").upload_from_string(data)


def test_launch_submits_one_job_on_the_tpu_workers(dataflow, gcs):
    api, args, _ = dataflow
    job_id = launched(api, args)
    [job] = api.created
    assert job["name"].startswith("t-") and job["labels"] == {"fleet": "t"}
    environment = job["environment"]
    assert environment["serviceOptions"] == [SERVICE_OPTION]
    assert "no_use_multiple_sdk_containers" in environment["experiments"]
    [pool] = environment["workerPools"]
    assert pool["machineType"] == "ct5lp-hightpu-8t" and pool["workerHarnessContainerImage"] == IMAGE
    assert pool["numThreadsPerWorker"] == 1 and pool["autoscalingSettings"]["maxNumWorkers"] == 2
    options = environment["sdkPipelineOptions"]["options"]
    assert options["temp_location"].startswith("gs://acts/run/_fleet/dataflow_tmp/t-") and options["project"] == "proj"
    # The pipeline itself is staged on GCS, where the service reads it.
    staged = options["pipelineUrl"].removeprefix("gs://acts/")
    pipeline = beam_runner_api_pb2.Pipeline.FromString(gcs.client().bucket("acts").blob(staged).download_as_bytes())
    steps = {t.unique_name for t in pipeline.components.transforms.values()}
    assert {f"ExtractMachines/{s}" for s in ("ListMachines", "Reshuffle", "ExtractMachine", "Merge")} <= steps
    record = json.loads(gcs.client().bucket("acts").blob("run/_fleet/dataflow_job.json").download_as_bytes())
    [entry] = record["jobs"]
    assert entry["job_id"] == job_id and entry["machines"] == [0, 1] and entry["region"] == "us-central1"
    again = fleet("launch", args)
    assert again.returncode == 0 and "nothing to launch" in again.stdout and len(api.created) == 1


def test_dry_run_shows_the_options_and_asks_nothing(dataflow):
    api, args, _ = dataflow
    plan = fleet("launch", args, "--dry_run", "--tpu_type", "v6e", "--topology", "1x1", "--reservation", "r1",
                 "--worker_zone", "us-central1-b")
    assert plan.returncode == 0, plan.stderr
    lines = [line.strip().rstrip(" \\") for line in plan.stdout.splitlines()]
    assert lines[1] == "python -m pipeline.extract" and "--machines 0,1" in lines and "--runner DataflowRunner" in lines
    assert "--worker_machine_type ct6e-standard-1t" in lines and "--worker_zone us-central1-b" in lines
    assert "--dataflow_service_options 'worker_accelerator=type:tpu-v6e-slice;topology:1x1;reservation:r1'" in lines
    assert not api.created and api.gets == 0


REFUSED = [  # (flags, the one line), none of which may reach Dataflow
    (["--tpu_type", "v5p", "--topology", "2x4"],
     "--tpu_type v5p --topology 2x4 is not a TPU worker Dataflow offers; v5p offers --topology 2x2x1"),
    (["--topology", "4x4"], "--tpu_type v5e --topology 4x4 is a multi-host slice: Dataflow's TPU workers are "
                            "single-host; v5e offers --topology 1x1, 2x2, 2x4"),
    (["--image", ""], "--backend dataflow needs --image"),
    (["--output", "/tmp/acts"], "--backend dataflow needs a gs:// --output"),
    (["--reservation", "r1"], "--reservation needs --worker_zone, the reservation's zone"),
    (["--region", ""], "--backend dataflow needs --project and --region"),
]


def test_what_dataflow_cannot_run_is_one_line(dataflow):
    api, args, _ = dataflow
    for flags, expected in REFUSED:
        fleet_error(fleet("launch", args, *flags), expected)
    assert not api.created and api.gets == 0


def test_status_shows_the_job_and_its_newest_error(dataflow, gcs):
    api, args, streams = dataflow
    job_id = launched(api, args)
    api.script(job_id, "JOB_STATE_RUNNING")
    api.error(job_id, "Error processing work item: OSError: /dev/vfio/0: Device or resource busy\nTraceback ...")
    store_completion(gcs, streams[0], 0, "2026-11-22T10:00:00+00:00", "2026-11-22T10:30:00+00:00")
    status = fleet("status", args)
    assert status.returncode == 2, status.stderr  # machine 001 has written nothing yet
    assert "000      COMPLETED" in status.stdout and "001      MISSING" in status.stdout
    job_line = status.stdout.splitlines()[-1]
    assert job_line.startswith("dataflow job t-") and f"({job_id}): JOB_STATE_RUNNING" in job_line
    assert job_line.endswith("; last error: Error processing work item: OSError: /dev/vfio/0: Device or resource busy")
    api.script(job_id, "JOB_STATE_FAILED")
    document = json.loads(fleet("status", args, "--json").stdout)
    assert f"({job_id}): JOB_STATE_FAILED; last error: " in document["job"]


def test_supervise_waits_for_the_job_then_merges_and_counts_the_hours(dataflow, gcs):
    api, args, streams = dataflow
    job_id = launched(api, args)
    submitted = json.loads(gcs.client().bucket("acts").blob("run/_fleet/dataflow_job.json")
                           .download_as_bytes())["jobs"][0]["submitted_at"]
    # Each machine's runner ran for half an hour, from a second after the submission.
    start_s = parse_time(submitted) + 1
    start, end = iso_time(start_s), iso_time(start_s + HOUR_S / 2)
    for machine in (0, 1):
        store_completion(gcs, streams[machine], machine, start, end)
    api.script(job_id, "JOB_STATE_RUNNING", "JOB_STATE_RUNNING", "JOB_STATE_RUNNING", "JOB_STATE_DONE")
    supervised = fleet("supervise", args)
    assert supervised.returncode == 0, supervised.stderr[-3000:]
    said = [line.split(f"dataflow job {job_id} ")[1] for line in supervised.stderr.splitlines()
            if f"dataflow job {job_id} " in line]
    assert [s.split(": ")[1] for s in said] == ["JOB_STATE_RUNNING", "JOB_STATE_DONE"]
    assert supervised.stderr.index("JOB_STATE_DONE") < supervised.stderr.index("merging")
    assert "fleet t complete: 2 machines, 24 samples" in supervised.stdout
    document = json.loads(fleet("status", args, "--json", "--price_per_hour", "2").stdout)
    for machine in document["machines"]:
        assert machine["accelerator_hours"] == pytest.approx(0.5) and machine["cost"] == pytest.approx(1.0)
    assert document["job"].endswith("JOB_STATE_DONE")


def test_a_failed_job_is_one_line_with_its_newest_error(dataflow):
    api, args, _ = dataflow
    job_id = launched(api, args)
    api.script(job_id, "JOB_STATE_RUNNING", "JOB_STATE_FAILED")
    api.error(job_id, "a first work item failed")
    api.error(job_id, "Workflow failed. Causes: S01:ExtractMachines/ExtractMachine failed.")
    result = fleet("supervise", args)
    fleet_error(result, "dataflow job t-")
    assert (f"({job_id}) ended JOB_STATE_FAILED: Workflow failed. Causes: S01:ExtractMachines/ExtractMachine "
            "failed.; fix it, then run launch") in result.stderr.splitlines()[-1]


def test_teardown_cancels_the_job_and_launch_submits_the_rest_again(dataflow):
    api, args, _ = dataflow
    fleet_error(fleet("teardown", args), "fleet 't' was never launched: no Dataflow jobs recorded in "
                                         "gs://acts/run/_fleet/dataflow_job.json")
    job_id = launched(api, args)
    listed = fleet("teardown", args, "--dry_run")
    assert "would cancel 2 machine(s) of fleet t" in listed.stdout and not api.updates
    down = fleet("teardown", args)
    assert down.returncode == 0 and "fleet t: cancelled 2 machine(s)" in down.stdout, down.stderr
    assert api.updates == [(job_id, "JOB_STATE_CANCELLED")]
    again = fleet("teardown", args)
    assert "cancelled 0 machine(s)" in again.stdout and len(api.updates) == 1  # nothing left to cancel
    relaunched = launched(api, args)  # neither machine completed: both go in a new job
    assert relaunched != job_id and len(api.created) == 2
