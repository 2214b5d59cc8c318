"""One machine made of two processes (4 CPU devices each, a localhost coordinator): each stores
only its own rows, the union equals a one-process run, and a dead process fails the other."""

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from activations.reader import load_shard
from fixtures.gcs_emulator import free_port
from tests.conftest import REPO, run_cli
from tests.test_host import long_stream
from common.states import COMPLETED
from model.config import MESH_TYPES

pytestmark = pytest.mark.slow
FOUR_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
COPIES = 3  # 36 records: several windows of 16 and shards all through the run
WINDOW = 16


def runner_args(stream, out, model, *extra):
    return ["--machine_id", "0", "--dataset_stream", str(stream), "--model_path", model,
            "--output_dir", str(out), "--shard_size_gb", "0.0003", "--batch_size", "2", "--window", str(WINDOW),
            "--max_seq_length", "160", "--dtype", "float32", "--heartbeat_s", "1", *extra]


def start_slice(args, port, timeout_s=100) -> list[subprocess.Popen]:
    """The same command on two 'hosts' (processes 0 and 1 of one machine)."""
    distributed = ["--coordinator_address", f"localhost:{port}", "--num_processes", "2",
                   "--distributed_timeout_s", str(timeout_s)]
    env = {**os.environ, **FOUR_DEVICES}
    return [subprocess.Popen([sys.executable, "-m", "runners.tpu_host", *args, *distributed,
                              "--process_id", str(p)], cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for p in (0, 1)]


def run_slice(args) -> None:
    procs = start_slice(args, free_port())
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]


def stored(folder: pathlib.Path) -> dict[int, dict[int, np.ndarray]]:
    """{sample id: {layer: activation}} of every shard under ``folder``; each id once."""
    out: dict[int, dict[int, np.ndarray]] = {}
    for path in sorted(folder.rglob("shard_*.pkl.gz")):
        for layer, entries in load_shard(str(path)).items():
            for e in entries:
                assert layer not in out.setdefault(e["sample_id"], {}), f"sample {e['sample_id']} twice"
                out[e["sample_id"]][layer] = e["activation"]
    return out


@pytest.fixture(scope="module")
def stream(arc_streams, tmp_path_factory):
    path = tmp_path_factory.mktemp("slice_stream") / "long.jsonl"
    return path, long_stream(arc_streams, path, copies=COPIES)


@pytest.fixture(scope="module")
def one_process(stream, tiny_checkpoints, tmp_path_factory):
    """The reference: one process over 8 devices (the same global mesh and batches)."""
    runs = {}
    for mesh in MESH_TYPES:
        out = tmp_path_factory.mktemp(f"one_process_{mesh}")
        result = run_cli("runners.tpu_host", *runner_args(stream[0], out, tiny_checkpoints["gqa_tied"],
                                                          "--mesh_type", mesh))
        assert result.returncode == 0, result.stderr
        runs[mesh] = out / "machine_000"
    return runs


@pytest.fixture(scope="module")
def two_processes(stream, tiny_checkpoints, tmp_path_factory):
    runs = {}
    for mesh in MESH_TYPES:
        out = tmp_path_factory.mktemp(f"two_processes_{mesh}")
        run_slice(runner_args(stream[0], out, tiny_checkpoints["gqa_tied"], "--mesh_type", mesh))
        runs[mesh] = out
    return runs


@pytest.mark.parametrize("mesh", ["1d", "2d"])
def test_union_of_the_processes_equals_one_process(stream, one_process, two_processes, mesh):
    machine = two_processes[mesh] / "machine_000"
    assert sorted(p.name for p in machine.iterdir() if p.is_dir()) == ["process_00", "process_01"]
    parts = [stored(machine / f"process_{p:02d}") for p in (0, 1)]
    assert parts[0] and parts[1] and not set(parts[0]) & set(parts[1])  # each stores its own rows
    union = {**parts[0], **parts[1]}
    reference = stored(one_process[mesh])
    assert sorted(union) == sorted(r["sample_id"] for r in stream[1]) == sorted(reference)
    for sample_id, layers in reference.items():
        for layer, expected in layers.items():
            got = union[sample_id][layer]
            assert got.shape == expected.shape
            assert np.max(np.abs(got - expected)) <= 1e-6 * max(1.0, np.max(np.abs(expected)))
    # Each process's checkpoint covers the whole stream; the machine's status reports both.
    for p in (0, 1):
        checkpoint = json.loads((machine / f"process_{p:02d}" / "checkpoint.json").read_text())
        assert checkpoint["status"] == COMPLETED and checkpoint["total_samples_processed"] == len(stream[1])
    status = json.loads((machine / "status.json").read_text())
    assert status["state"] == COMPLETED and status["num_processes"] == 2
    assert [p["process_id"] for p in status["processes"]] == [0, 1]
    assert status["samples_done"] == len(stream[1]) and status["device_count"] == 8


def test_merged_index_lists_every_sample_once(stream, two_processes, tmp_path):
    out = tmp_path / "index.parquet"
    result = run_cli("pipeline.index", "--activations_dir", str(two_processes["1d"]), "--output", str(out))
    assert result.returncode == 0, result.stderr
    table = pq.read_table(out).to_pylist()
    assert sorted(r["sample_id"] for r in table) == sorted(r["sample_id"] for r in stream[1])
    assert {r["machine_id"] for r in table} == {0}
    assert {"/process_00/" in r["shard_path"] or "/process_01/" in r["shard_path"] for r in table} == {True}
    merged = json.loads((tmp_path / "merged_metadata.json").read_text())
    assert merged["total_machines"] == 1 and merged["completed_machines"] == [0]


def test_kill_9_one_process_fails_the_other_then_both_resume_exactly_once(stream, two_processes,
                                                                          tiny_checkpoints, tmp_path):
    args = runner_args(stream[0], tmp_path, tiny_checkpoints["gqa_tied"], "--mesh_type", "1d")
    machine = tmp_path / "machine_000"
    procs = start_slice(args, free_port(), timeout_s=5)
    while len(list((machine / "process_01").glob("shard_*"))) < 2:  # mid-run
        assert procs[1].poll() is None, procs[1].communicate()[1][-3000:]
        time.sleep(0.05)
    procs[1].kill()
    killed_at = time.monotonic()
    _, stderr = procs[0].communicate(timeout=120)
    waited = time.monotonic() - killed_at
    assert procs[0].returncode != 0 and waited < 5 + 55, (procs[0].returncode, waited)
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("runners.tpu_host: error: process 0 of machine 0 ended by SIGABRT"), last
    status = json.loads((machine / "status.json").read_text())
    assert status["state"] == "failed" and "ended by SIGABRT" in status["error"]
    procs[1].communicate()
    # The same command on both hosts resumes; the result is the uninterrupted run's, shard for shard.
    run_slice(args)
    reference = two_processes["1d"] / "machine_000"
    for p in ("process_00", "process_01"):
        names = sorted(x.name for x in (machine / p).glob("shard_*"))
        assert names == sorted(x.name for x in (reference / p).glob("shard_*"))
        for name in names:
            assert load_shard(str(machine / p / name)).keys() == load_shard(str(reference / p / name)).keys()
        mine, theirs = stored(machine / p), stored(reference / p)
        assert sorted(mine) == sorted(theirs)
        assert all(np.array_equal(mine[i][l], theirs[i][l]) for i in theirs for l in theirs[i])
        assert not list((machine / p).rglob("*.tmp"))
    assert json.loads((machine / "status.json").read_text())["state"] == COMPLETED


def test_fleet_reads_a_machine_of_two_processes_as_one(stream, two_processes):
    from fleet.config import FleetConfig
    from fleet.machines import fleet_views, read_fleet
    from fleet.merge import rejected_ids
    files = read_fleet(FleetConfig(name="t", output=str(two_processes["2d"]), num_machines=1))
    assert [d.rsplit("/", 1)[1] for d in files[0].dirs] == ["process_00", "process_01"]
    assert files[0].checkpoint_status() == COMPLETED and rejected_ids(files[0].dirs) == []
    shards = sum(len(list((two_processes["2d"] / "machine_000" / p).glob("shard_*")))
                 for p in ("process_00", "process_01"))
    view, = fleet_views(files)
    assert (view.state, view.samples_done, view.shards) == (COMPLETED, len(stream[1]), shards)


def test_slice_detection_and_layout_errors(tmp_path, metadata_server):
    from host.config import HostConfig
    from host.distributed import slice_hosts, wants_distributed
    from host.run import check_layout
    assert slice_hosts({"TPU_WORKER_HOSTNAMES": "t1k-0,t1k-1,t1k-2,t1k-3"}) == 4
    assert slice_hosts({}, tpu_present=False) == 1  # off a TPU VM nothing is asked
    on_the_vm = {"GCE_METADATA_HOST": metadata_server.host}
    assert slice_hosts(on_the_vm, tpu_present=True) == 1  # a single-host TPU VM: no endpoints
    metadata_server.attributes["worker-network-endpoints"] = "unknown:unknown:10.0.0.2,unknown:unknown:10.0.0.3"
    assert slice_hosts(on_the_vm, tpu_present=True) == 2
    config = HostConfig(machine_id=0, streams_dir="s", model_path="m", output_dir=str(tmp_path))
    assert not wants_distributed(config, {})
    assert wants_distributed(HostConfig(**{**config.__dict__, "coordinator_address": "h:1"}), {})
    assert wants_distributed(HostConfig(**{**config.__dict__, "distributed": "on"}), {})
    assert not wants_distributed(HostConfig(**{**config.__dict__, "distributed": "off"}),
                                 {"TPU_WORKER_HOSTNAMES": "a,b"})
    two = HostConfig(**{**config.__dict__, "num_processes": 2, "process_id": 1})
    assert two.process_dir == str(tmp_path / "machine_000" / "process_01")
    (tmp_path / "machine_000" / "process_00").mkdir(parents=True)
    check_layout(two)
    with pytest.raises(Exception, match="holds a run of 1 processes .*resume it with as many"):
        check_layout(config)
    (tmp_path / "machine_000" / "process_02").mkdir()
    with pytest.raises(Exception, match="more than 2 processes"):
        check_layout(two)


def test_a_gke_slice_runs_with_the_coordinator_its_jobset_derives(stream, two_processes, tiny_checkpoints,
                                                                  tmp_path):
    """The 2-host JobSet of a v5e 2x4 on its 4-chip machine type: each pod's distributed flags are
    its manifest's, as the client reads it, with ``$(JOB_COMPLETION_INDEX)`` expanded for pod p as
    the kubelet does; the coordinator's DNS name resolves to this computer, as cluster DNS resolves
    it to pod 0 (the only substitution). Output: the same as ``start_slice``'s."""
    from fleet.config import FleetConfig
    from fleet.gke import GkeBackend
    from tests.fake_kubernetes import expanded_command
    from tests.test_fleet_gke import deserialize, flag_value
    port = free_port()
    config = FleetConfig(name="s", backend="gke", image="i", streams_dir="gs://b/s", output="gs://b/o",
                         num_machines=1, gke_accelerator="tpu-v5-lite-podslice", gke_topology="2x4", tpu_chips=4,
                         gke_coordinator_port=port)
    [jobset] = GkeBackend(config).manifests()
    job = deserialize(jobset["spec"]["replicatedJobs"][0]["template"], "V1JobTemplateSpec").spec
    assert job.completions == job.parallelism == 2
    [container] = job.template.spec.containers
    coordinator = flag_value(container.command, "--coordinator_address")
    assert coordinator == f"s-000-slice-0-0.s-000:{port}"
    procs = []
    for p in (0, 1):
        pod = {"metadata": {"name": f"s-000-slice-0-{p}-x"}, "spec": {"containers": [
            {"command": container.command, "env": [{"name": "JOB_COMPLETION_INDEX", "value": str(p)}]}]}}
        command = expanded_command(pod)
        flags = [w for name in ("--machine_id", "--num_processes", "--process_id")
                 for w in (name, flag_value(command, name))]
        flags += ["--coordinator_address", coordinator.replace("s-000-slice-0-0.s-000", "localhost")]
        args = runner_args(stream[0], tmp_path, tiny_checkpoints["gqa_tied"], "--mesh_type", "1d",
                           "--max_samples", str(WINDOW), *flags)  # the first window: as in the reference
        procs.append(subprocess.Popen([sys.executable, "-m", "runners.tpu_host", *args], cwd=REPO,
                                      env={**os.environ, **FOUR_DEVICES}, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))
    for proc in procs:
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
    machine, reference = tmp_path / "machine_000", two_processes["1d"] / "machine_000"
    status = json.loads((machine / "status.json").read_text())
    assert status["state"] == COMPLETED and status["num_processes"] == 2
    parts = {p: set(stored(machine / p)) for p in ("process_00", "process_01")}
    assert parts["process_00"] | parts["process_01"] == {r["sample_id"] for r in stream[1][:WINDOW]}
    for p, ids in parts.items():  # each host stored the rows the reference's process p stored
        assert ids and ids <= set(stored(reference / p))
