"""The gke backend: the Indexed Job as the ``kubernetes`` client's own models read it, and its
submission and deletion through the client against a local server of the Jobs API."""

import json
import shlex

import pytest
import yaml

from tests.conftest import run_cli, run_in_process
from tests.test_fleet_errors import upload_streams


def as_v1_job(manifest: dict):
    """The manifest deserialised into ``kubernetes.client.V1Job``, as the client does with an
    API answer (unknown or mistyped fields are lost or rejected here)."""
    from kubernetes.client import ApiClient

    class Answer:
        data = json.dumps(manifest)
    return ApiClient().deserialize(Answer(), "V1Job")


@pytest.fixture
def streams_on_gcs(arc_streams, gcs):
    return upload_streams(gcs, arc_streams)


def gke_args(streams, *extra):
    return ["--name", "qwen-run", "--backend", "gke", "--image", "us-docker.pkg.dev/p/r/extract:1",
            "--streams_dir", streams, "--output", "gs://acts/run", "--gke_accelerator", "tpu-v6e-slice",
            "--gke_topology", "2x2", "--tpu_chips", "4", "--max_restarts", "5", "--grace_period_s", "90",
            *extra, "--", "--model_path", "Qwen/Qwen2.5-0.5B", "--layers_to_extract", "6", "12"]


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
    [rule] = spec.pod_failure_policy.rules
    assert rule.action == "Ignore" and [(c.type, c.status) for c in rule.on_pod_conditions] == \
        [("DisruptionTarget", "True")]
    pod = spec.template.spec
    assert pod.restart_policy == "Never" and pod.termination_grace_period_seconds == 90
    assert pod.node_selector == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                 "cloud.google.com/gke-tpu-topology": "2x2", "cloud.google.com/gke-spot": "true"}
    assert [(t.key, t.effect) for t in pod.tolerations] == [("google.com/tpu", "NoSchedule"),
                                                            ("cloud.google.com/gke-spot", "NoSchedule")]
    [container] = pod.containers
    assert container.image == "us-docker.pkg.dev/p/r/extract:1"
    assert container.resources.limits == container.resources.requests == {"google.com/tpu": "4"}
    command = container.command
    assert command[:3] == ["python", "-m", "runners.tpu_host"]
    assert shlex.join(command[3:]).startswith(
        f"--machine_id auto --streams_dir {streams_on_gcs} --output_dir /tmp/activation-extraction "
        "--upload_to_gcs --gcs_bucket acts --gcs_prefix 'run/machine_{machine_id:03d}' "
        "--delete_local_after_upload --compilation_cache_dir gs://acts/run/_fleet/xla_cache")
    assert command[-5:] == ["--model_path", "Qwen/Qwen2.5-0.5B", "--layers_to_extract", "6", "12"]


def test_dry_run_prints_the_manifest_and_creates_nothing(streams_on_gcs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_in_process("runners.fleet", "launch", "--dry_run", *gke_args(streams_on_gcs))
    assert result.returncode == 0, result.stderr
    job = as_v1_job(yaml.safe_load(result.stdout))
    assert job.spec.completion_mode == "Indexed" and not list(tmp_path.glob("*.yaml"))


def test_apply_and_teardown_through_the_kubernetes_client(streams_on_gcs, tmp_path):
    # Processes of their own: the Kubernetes client reads KUBECONFIG when it is first imported.
    from tests.fake_kubernetes import FakeKubernetesApi
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
        assert not api.jobs
