"""The gke backend: the Indexed Job and the slices' JobSets as the ``kubernetes`` client's own
models read them, and their life through the client against a local server of the Kubernetes
API whose controllers run the pods (``tests/fake_kubernetes.py``).

A pod "runs" by calling the test's hook: it writes the files a completed runner leaves on the GCS
emulator and exits 0, or, preempted, exits with the ``--stopped_exit_code`` its command passes,
as the runner does after a signal.
"""

import json
import shlex

import pytest
import yaml

from common.cli import UserError
from tests.conftest import read_streams, run_cli, run_in_process, wait_for
from tests.fake_kubernetes import FakeKubernetesApi, expanded_command, pod_env
from tests.test_fleet_errors import upload_streams
from tests.test_fleet_tpu_vm import completed_machine_files


def deserialize(document: dict, model: str):
    """``document`` deserialised into a ``kubernetes.client`` model, as the client does with an
    API answer (unknown or mistyped fields are lost or rejected here)."""
    from kubernetes.client import ApiClient

    class Answer:
        data = json.dumps(document)
    return ApiClient().deserialize(Answer(), model)


def as_v1_job(manifest: dict):
    return deserialize(manifest, "V1Job")


@pytest.fixture
def streams_on_gcs(arc_streams, gcs):
    return upload_streams(gcs, arc_streams)


def gke_args(streams, *extra, topology="2x2", chips=("--tpu_chips", "4")):
    return ["--name", "qwen-run", "--backend", "gke", "--image", "us-docker.pkg.dev/p/r/extract:1",
            "--streams_dir", streams, "--output", "gs://acts/run", "--gke_accelerator", "tpu-v6e-slice",
            "--gke_topology", topology, *chips, "--max_restarts", "5", "--grace_period_s", "90",
            *extra, "--", "--model_path", "Qwen/Qwen2.5-0.5B", "--layers_to_extract", "6", "12"]


def flag_value(command: list[str], name: str) -> str | None:
    """The value the runner's parser would take for ``name``: its last occurrence's."""
    values = [command[i + 1] for i, word in enumerate(command[:-1]) if word == name]
    return values[-1] if values else None


def runner_exit(command: list[str]) -> int:
    """What a runner a signal stopped exits with, given its command."""
    return int(flag_value(command, "--stopped_exit_code") or 0)


@pytest.fixture
def in_process_client(monkeypatch):
    """Points this process's ``kubernetes`` client at a fake API (what KUBECONFIG does for a new
    process: the client reads it when first imported)."""
    import kubernetes.config.kube_config

    def point(api: FakeKubernetesApi, tmp_path) -> None:
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION",
                            api.kubeconfig(str(tmp_path / "kubeconfig-in-process")))
    return point


def test_the_job_field_by_field(streams_on_gcs, tmp_path):
    path = tmp_path / "job.yaml"
    result = run_in_process("runners.fleet", "launch", *gke_args(streams_on_gcs, "--manifest", str(path)))
    assert result.returncode == 0, result.stderr
    assert f"kubectl apply -f {path}" in result.stdout
    job = as_v1_job(yaml.safe_load(path.read_text()))
    assert (job.api_version, job.kind, job.metadata.name, job.metadata.namespace) == \
        ("batch/v1", "Job", "qwen-run", "default")
    assert job.metadata.labels["fleet"] == "qwen-run"
    spec = job.spec
    assert spec.completion_mode == "Indexed" and spec.completions == spec.parallelism == 2
    assert spec.backoff_limit_per_index == 5 and spec.max_failed_indexes == 2
    assert spec.pod_replacement_policy == "Failed"
    preempted, stopped = spec.pod_failure_policy.rules
    assert preempted.action == "Ignore" and [(c.type, c.status) for c in preempted.on_pod_conditions] == \
        [("DisruptionTarget", "True")]
    assert stopped.action == "Ignore" and (stopped.on_exit_codes.container_name, stopped.on_exit_codes.operator,
                                           stopped.on_exit_codes.values) == ("runner", "In", [143])
    pod = spec.template.spec
    assert pod.restart_policy == "Never" and pod.termination_grace_period_seconds == 90
    assert pod.node_selector == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                 "cloud.google.com/gke-tpu-topology": "2x2", "cloud.google.com/gke-spot": "true"}
    assert [(t.key, t.effect) for t in pod.tolerations] == [("google.com/tpu", "NoSchedule"),
                                                            ("cloud.google.com/gke-spot", "NoSchedule")]
    [container] = pod.containers
    assert container.name == "runner" and container.image == "us-docker.pkg.dev/p/r/extract:1"
    assert container.resources.limits == container.resources.requests == {"google.com/tpu": "4"}
    command = container.command
    assert command[:3] == ["python", "-m", "runners.tpu_host"]
    assert shlex.join(command[3:]).startswith(
        f"--machine_id auto --streams_dir {streams_on_gcs} --output_dir /tmp/activation-extraction "
        "--upload_to_gcs --gcs_bucket acts --gcs_prefix 'run/machine_{machine_id:03d}' "
        "--delete_local_after_upload --compilation_cache_dir gs://acts/run/_fleet/xla_cache "
        "--stopped_exit_code 143")
    assert command[-5:] == ["--model_path", "Qwen/Qwen2.5-0.5B", "--layers_to_extract", "6", "12"]


def test_dry_run_prints_the_manifest_and_creates_nothing(streams_on_gcs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_in_process("runners.fleet", "launch", "--dry_run", *gke_args(streams_on_gcs))
    assert result.returncode == 0, result.stderr
    job = as_v1_job(yaml.safe_load(result.stdout))
    assert job.spec.completion_mode == "Indexed" and not list(tmp_path.glob("*.yaml"))


@pytest.mark.slow  # runners.fleet in processes of its own: launch, supervise, teardown
def test_apply_and_teardown_through_the_kubernetes_client(streams_on_gcs, tmp_path):
    # Processes of their own: the Kubernetes client reads KUBECONFIG when it is first imported.
    with FakeKubernetesApi() as api:
        env = {"KUBECONFIG": api.kubeconfig(str(tmp_path / "kubeconfig"))}
        args = gke_args(streams_on_gcs)
        manifest = ["--manifest", str(tmp_path / "job.yaml")]
        applied = run_cli("runners.fleet", "launch", "--apply", *manifest, *args, env=env)
        assert applied.returncode == 0, applied.stderr
        assert list(api.jobs) == [("default", "qwen-run")]
        assert api.jobs["default", "qwen-run"]["spec"]["completionMode"] == "Indexed"
        again = run_cli("runners.fleet", "launch", "--apply", *manifest, *args, env=env)
        assert again.returncode == 0 and "nothing to launch" in again.stdout, again.stderr
        api.set_job_status("default", "qwen-run", {"failedIndexes": "0-1"})
        watched = run_cli("runners.fleet", "supervise", "--interval", "0.1", *args, env=env)
        assert watched.returncode == 2 and "machine(s) 000, 001 did not complete" in watched.stderr
        assert "machine 001: index 1 failed 6 times (backoffLimitPerIndex)" in watched.stderr
        down = run_cli("runners.fleet", "teardown", *args, env=env)
        assert down.returncode == 0 and "deleted 2 machine(s)" in down.stdout, down.stderr
        assert not api.jobs and not api.pods


@pytest.fixture
def machine_files(arc_streams, gcs):
    """write(machine): the files a completed runner of that machine leaves on GCS."""
    streams = read_streams(arc_streams, 2)
    bucket = gcs.client().bucket("acts")

    def write(machine: int) -> None:
        for name, data in completed_machine_files(streams[machine], machine).items():
            bucket.blob(f"run/machine_{machine:03d}/{name}").upload_from_string(data)
    return write


@pytest.mark.slow  # a whole fleet through runners.fleet processes
def test_a_preempted_index_runs_again_uncounted_and_the_fleet_completes(streams_on_gcs, machine_files,
                                                                        tmp_path, in_process_client):
    runs: dict[int, int] = {}

    def run_pod(pod: dict) -> int:
        machine = int(pod_env(pod)["JOB_COMPLETION_INDEX"])  # what --machine_id auto reads
        runs[machine] = runs.get(machine, 0) + 1
        if machine == 1 and runs[machine] == 1:
            return runner_exit(expanded_command(pod))  # SIGTERM before it stored anything
        machine_files(machine)
        return 0

    with FakeKubernetesApi(run_pod) as api:
        env = {"KUBECONFIG": api.kubeconfig(str(tmp_path / "kubeconfig"))}
        args = gke_args(streams_on_gcs)
        applied = run_cli("runners.fleet", "launch", "--apply", "--manifest", str(tmp_path / "job.yaml"), *args,
                          env=env)
        assert applied.returncode == 0, applied.stderr
        supervised = run_cli("runners.fleet", "supervise", "--interval", "0.1", *args, env=env)
        assert supervised.returncode == 0, supervised.stderr
        assert "fleet qwen-run complete: 2 machines, 24 samples" in supervised.stdout
        first, second = api.pods_of("default", "batch.kubernetes.io/job-completion-index=1")
        assert [p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] for p in (first, second)] \
            == [143, 0]
        # Ignored by the podFailurePolicy: recreated, no failure counted against backoffLimitPerIndex.
        assert second["metadata"]["annotations"]["batch.kubernetes.io/job-index-failure-count"] == "0"
        assert second["metadata"]["annotations"]["batch.kubernetes.io/job-index-ignored-failure-count"] == "1"
        status = api.jobs["default", "qwen-run"]["status"]
        assert status["completedIndexes"] == "0-1" and "failed" not in status and "failedIndexes" not in status
        assert [c["type"] for c in status["conditions"]] == ["Complete"]

        from fleet.config import FleetConfig
        from fleet.gke import GkeBackend
        in_process_client(api, tmp_path)
        config = FleetConfig(name="qwen-run", backend="gke", image="i", output="gs://acts/run", num_machines=2,
                             gke_accelerator="tpu-v6e-slice", gke_topology="2x2")
        lives = GkeBackend(config).incarnations()
        assert sorted(lives) == [0, 1] and len(lives[0]) == 1
        assert [life.key for life in lives[1]] == [first["metadata"]["uid"], second["metadata"]["uid"]]
        assert all(not life.active and life.ended_at >= life.started_at for m in lives for life in lives[m])


def test_a_runner_forced_to_exit_0_when_stopped_is_reported_in_one_line(tmp_path, in_process_client):
    from fleet.config import FleetConfig
    from fleet.gke import GkeBackend
    with FakeKubernetesApi(lambda pod: runner_exit(expanded_command(pod))) as api:  # every pod stopped
        in_process_client(api, tmp_path)
        config = FleetConfig(name="q", backend="gke", image="i", streams_dir="gs://b/s", output="gs://b/o",
                             num_machines=1, gke_topology="2x2", runner=("--stopped_exit_code", "0"))
        backend = GkeBackend(config)
        backend.create([0])
        wait_for(lambda: api.jobs["default", "q"]["status"].get("completedIndexes") == "0")
        [health] = backend.healths([0]).values()
        assert health.kind == "gone" and "the runner flags set --stopped_exit_code 0" in health.detail



# -- multi-host slices --------------------------------------------------------------------------


def test_gke_topologies_in_hosts_and_chips():
    from fleet.tpu_topology import slice_shape
    shape = slice_shape("tpu-v5-lite-podslice", "4x4")
    assert (shape.chips, shape.hosts, shape.chips_per_host, shape.multi_host) == (16, 4, 4, True)
    assert slice_shape("tpu-v5-lite-podslice", "2x4").hosts == 1  # ct5lp-hightpu-8t
    assert slice_shape("tpu-v5-lite-podslice", "2x4", 4).hosts == 2  # ct5lp-hightpu-4t
    assert (slice_shape("tpu-v6e-slice", "1x1").chips_per_host, slice_shape("tpu-v6e-slice", "2x2").hosts) == (1, 1)
    assert slice_shape("tpu-v4-podslice", "2x2x1").hosts == 1 and slice_shape("tpu-v5p-slice", "2x2x2").hosts == 2
    assert slice_shape("tpu-v4-podslice", "4x4x8").hosts == 32
    for args, message in [(("tpu-v7", "2x2"), "'tpu-v7' is not a TPU accelerator this fleet knows"),
                          (("tpu-v4-podslice", "2x4"), "tpu-v4-podslice topologies have 3 dimensions, e.g. 2x2x1"),
                          (("tpu-v6e-slice", "1x2"), "--gke_topology 1x2 (2 chips) is not a slice GKE offers"),
                          (("tpu-v5-lite-podslice", "4x4", 8), "--tpu_chips 8 does not fit --gke_topology 4x4 of "
                           "tpu-v5-lite-podslice (16 chips): chips per host must be 4 (4 hosts)")]:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            slice_shape(*args)


def test_a_topology_the_fleet_does_not_know_is_one_line(streams_on_gcs):
    result = run_in_process("runners.fleet", "launch", "--dry_run",
                            *gke_args(streams_on_gcs, chips=("--tpu_chips", "8")))
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        "runners.fleet: error: --tpu_chips 8 does not fit --gke_topology 2x2 of tpu-v6e-slice (4 chips): "
        "chips per host must be 4 (1 host)")


def test_the_slice_jobset_of_a_v5e_4x4_field_by_field(streams_on_gcs, tmp_path):
    path = tmp_path / "slices.yaml"
    args = gke_args(streams_on_gcs, "--gke_accelerator", "tpu-v5-lite-podslice", "--manifest", str(path),
                    topology="4x4", chips=())
    result = run_in_process("runners.fleet", "launch", *args)
    assert result.returncode == 0, result.stderr
    assert "2 JobSet manifest(s)" in result.stdout and f"kubectl apply -f {path}" in result.stdout
    jobsets = list(yaml.safe_load_all(path.read_text()))
    assert [js["metadata"]["name"] for js in jobsets] == ["qwen-run-000", "qwen-run-001"]
    jobset = jobsets[1]
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert jobset["metadata"]["labels"]["fleet"] == "qwen-run" and jobset["metadata"]["labels"]["fleet-machine"] == "1"
    assert jobset["metadata"]["annotations"] == {"alpha.jobset.sigs.k8s.io/exclusive-topology":
                                                 "cloud.google.com/gke-nodepool"}
    spec = jobset["spec"]
    assert spec["network"] == {"enableDNSHostnames": True}
    assert spec["failurePolicy"] == {"maxRestarts": 5, "rules": [
        {"name": "preempted", "action": "RestartJobSetAndIgnoreMaxRestarts",
         "onJobFailureReasons": ["PodFailurePolicy"]}]}
    [replicated] = spec["replicatedJobs"]
    assert (replicated["name"], replicated["replicas"]) == ("slice", 1)
    template = deserialize(replicated["template"], "V1JobTemplateSpec").spec
    assert template.completion_mode == "Indexed" and template.completions == template.parallelism == 4
    assert template.backoff_limit == 0
    assert [(r.action, r.on_pod_conditions and r.on_pod_conditions[0].type,
             r.on_exit_codes and r.on_exit_codes.values) for r in template.pod_failure_policy.rules] == \
        [("FailJob", "DisruptionTarget", None), ("FailJob", None, [143])]
    pod = template.template
    assert pod.metadata.labels == {"fleet": "qwen-run", "fleet-machine": "1"}
    assert pod.spec.node_selector["cloud.google.com/gke-tpu-topology"] == "4x4"
    [container] = pod.spec.containers
    assert container.resources.limits == container.resources.requests == {"google.com/tpu": "4"}  # per host
    command = container.command
    assert flag_value(command, "--machine_id") == "1" and flag_value(command, "--stopped_exit_code") == "143"
    assert (flag_value(command, "--coordinator_address"), flag_value(command, "--num_processes"),
            flag_value(command, "--process_id")) == ("qwen-run-001-slice-0-0.qwen-run-001:8476", "4",
                                                     "$(JOB_COMPLETION_INDEX)")
    assert command[-5:] == ["--model_path", "Qwen/Qwen2.5-0.5B", "--layers_to_extract", "6", "12"]


@pytest.mark.slow  # a whole fleet through runners.fleet processes
def test_a_preempted_slice_restarts_whole_uncounted_and_the_fleet_completes(streams_on_gcs, machine_files,
                                                                            tmp_path, in_process_client):
    def run_pod(pod: dict) -> int:
        command = expanded_command(pod)
        machine, host = int(flag_value(command, "--machine_id")), int(flag_value(command, "--process_id"))
        attempt = pod["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"]
        assert pod["spec"]["hostname"] == f"qwen-run-{machine:03d}-slice-0-{host}"
        assert pod["spec"]["subdomain"] == f"qwen-run-{machine:03d}"
        if machine == 1 and attempt == "0":  # host 2 preempted: the slice's processes stop together
            return runner_exit(command)
        if host == 0:
            machine_files(machine)
        return 0

    with FakeKubernetesApi(run_pod) as api:
        env = {"KUBECONFIG": api.kubeconfig(str(tmp_path / "kubeconfig"))}
        args = gke_args(streams_on_gcs, "--gke_accelerator", "tpu-v5-lite-podslice", topology="4x4", chips=())
        applied = run_cli("runners.fleet", "launch", "--apply", "--manifest", str(tmp_path / "slices.yaml"), *args,
                          env=env)
        assert applied.returncode == 0, applied.stderr
        assert [body["kind"] for body in api.created] == ["JobSet", "JobSet"]
        supervised = run_cli("runners.fleet", "supervise", "--interval", "0.1", *args, env=env)
        assert supervised.returncode == 0, supervised.stderr
        assert "fleet qwen-run complete: 2 machines, 24 samples" in supervised.stdout
        for machine, restarts in ((0, 0), (1, 1)):
            status = api.jobsets["default", f"qwen-run-{machine:03d}"]["status"]
            assert (status["terminalState"], status["restarts"], status["restartsCountTowardsMax"]) == \
                ("Completed", restarts, 0)
        # The first attempt's Job and pods were deleted with the restart; the second's 4 remain.
        pods = api.pods_of("default", "fleet-machine=1")
        assert len(pods) == 4 and {p["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"] for p in pods} == {"1"}

        from fleet.config import FleetConfig
        from fleet.gke import GkeBackend
        in_process_client(api, tmp_path)
        config = FleetConfig(name="qwen-run", backend="gke", image="i", output="gs://acts/run", num_machines=2,
                             gke_accelerator="tpu-v5-lite-podslice", gke_topology="4x4")
        backend = GkeBackend(config)
        assert backend.existing() == {0, 1}
        uid = api.jobsets["default", "qwen-run-001"]["metadata"]["uid"]
        [life] = backend.incarnations()[1]
        assert life.key == f"{uid}/restart-1" and not life.active and life.ended_at >= life.started_at
        down = run_cli("runners.fleet", "teardown", *args, env=env)
        assert down.returncode == 0 and "deleted 2 machine(s)" in down.stdout, down.stderr
        assert not api.jobsets and not api.jobs and not api.pods


def test_slice_health_from_the_jobset_status(tmp_path, in_process_client):
    from fleet.config import FleetConfig
    from fleet.gke import GkeBackend
    with FakeKubernetesApi() as api:
        in_process_client(api, tmp_path)
        config = FleetConfig(name="q", backend="gke", image="i", streams_dir="gs://b/s", output="gs://b/o",
                             num_machines=3, gke_topology="4x4", max_restarts=2)
        backend = GkeBackend(config)
        assert backend.healths([0, 1]) == {0: backend.health(0), 1: backend.health(1)}
        assert backend.health(0).kind == "absent"
        assert backend.create([0, 1, 2]) == [0, 1, 2]
        assert len(api.pods_of("default", "fleet=q")) == 12  # pending: no hook schedules them
        api.set_jobset_status("default", "q-001", {"restarts": 3, "restartsCountTowardsMax": 2,
                                                   "terminalState": "Failed"})
        api.set_jobset_status("default", "q-002", {"terminalState": "Completed"})
        healths = backend.healths([0, 1, 2])
        assert healths[0].kind == "alive"
        assert healths[1].kind == "gone" and healths[1].detail == \
            "JobSet q-001 failed after 3 restart(s) (maxRestarts 2, preemptions not counted)"
        assert healths[2].kind == "gone" and "--stopped_exit_code 0" in healths[2].detail
        assert backend.incarnations() == {}  # nothing started
        backend.delete([1])
        assert sorted(backend.existing()) == [0, 2] and len(api.pods_of("default", "fleet=q")) == 8
