"""Uploading to a real local GCS API server (gcp-storage-emulator)."""

import json
import os
import socket
import time

import numpy as np
import pytest

from activations.reader import iter_activations, load_shard, loads_shard, read_activations
from tests.conftest import gated_runner, read_streams, run_in_process
from tests.test_host import SHARD_GB, host_args, long_stream, run_host_cli, shard_contents
from tests.test_host_errors import one_line_error
from common.states import COMPLETED

pytestmark = pytest.mark.slow


def bucket_names(gcs, prefix="activations/machine_000/"):
    return sorted(b.name[len(prefix):] for b in gcs.client().list_blobs("acts", prefix=prefix))


def test_upload_verify_and_delete_local(arc_streams, tiny_checkpoints, tmp_path, gcs):
    result = run_host_cli(*host_args(arc_streams, tmp_path, 0, tiny_checkpoints["gqa_tied"],
                                     "--upload_to_gcs", "--gcs_bucket", "acts",
                                     "--delete_local_after_upload"))
    assert result.returncode == 0, result.stderr
    machine = tmp_path / "machine_000"
    metadata = json.loads((machine / "metadata.json").read_text())
    shards = [s["filename"] for s in metadata["shards"]]
    names = bucket_names(gcs)
    assert set(names) == {"checkpoint.json", "metadata.json", "status.json", *shards,
                          *(f"index/{s.replace('.pkl.gz', '.parquet')}" for s in shards),
                          *(f"index/{s.replace('.pkl.gz', '_arrays.parquet')}" for s in shards),
                          *(f"index/{s.replace('.pkl.gz', '_stats.parquet')}" for s in shards),
                          *(f"index/{s.replace('.pkl.gz', '_tokens.parquet')}" for s in shards)}
    assert not list(machine.glob("shard_*"))  # deleted after verified upload
    remote = json.loads(gcs.client().bucket("acts").blob("activations/machine_000/metadata.json")
                        .download_as_bytes())
    assert remote == metadata and metadata["shards"][0]["gcs_path"] == \
        f"gs://acts/activations/machine_000/{shards[0]}"
    status = json.loads(gcs.client().bucket("acts").blob("activations/machine_000/status.json")
                        .download_as_bytes())
    assert status == json.loads((machine / "status.json").read_text()) and status["state"] == COMPLETED
    # Read back through gs:// only: merge the uploaded indexes, then look samples up.
    index_path = tmp_path / "index.parquet"
    merged = run_in_process("pipeline.index", "--activations_dir", "gs://acts/activations", "--output",
                            str(index_path))
    assert merged.returncode == 0, merged.stderr
    stream = read_streams(arc_streams, 2)[0]
    got = dict(iter_activations(str(index_path), [r["sample_id"] for r in stream[::5]], layer=2))
    assert list(got) == [r["sample_id"] for r in stream[::5]]
    assert all(got[r["sample_id"]].shape == (r["num_tokens"], 64) for r in stream[::5])
    first = load_shard(metadata["shards"][0]["gcs_path"])[2][0]
    np.testing.assert_array_equal(first["activation"], got[stream[0]["sample_id"]])
    ranged = read_activations(str(tmp_path / "index_arrays.parquet"), [stream[0]["sample_id"]], [2])
    np.testing.assert_array_equal(ranged[(stream[0]["sample_id"], 2)], first["activation"])


def test_a_lost_local_disk_resumes_from_the_uploaded_checkpoint(arc_streams, tiny_checkpoints, tmp_path, gcs):
    args = host_args(arc_streams, tmp_path, 1, tiny_checkpoints["gqa_tied"], "--upload_to_gcs",
                     "--gcs_bucket", "acts", "--delete_local_after_upload")
    assert run_host_cli(*args, "--max_samples", "5").returncode == 0
    import shutil
    shutil.rmtree(tmp_path / "machine_001")  # a preempted VM comes back without its disk
    result = run_host_cli(*args)
    assert result.returncode == 0, result.stderr
    assert "resuming after" in result.stderr
    remote = json.loads(gcs.client().bucket("acts").blob("activations/machine_001/checkpoint.json")
                        .download_as_bytes())
    ids = [e["sample_id"] for s in remote["shards"] for e in loads_shard(
        gcs.client().bucket("acts").blob(f"activations/machine_001/{s['filename']}").download_as_bytes())[0]]
    assert remote["status"] == COMPLETED
    assert ids == [r["sample_id"] for r in read_streams(arc_streams, 2)[1]]


def test_missing_bucket_is_one_line(arc_streams, tiny_checkpoints, tmp_path, gcs):
    one_line_error(run_host_cli(*host_args(arc_streams, tmp_path, 0, tiny_checkpoints["gqa_tied"],
                                           "--upload_to_gcs", "--gcs_bucket", "no-such-bucket")),
                   "GCS bucket 'no-such-bucket' does not exist")
    assert not list((tmp_path / "machine_000").glob("shard_*"))


def test_emulator_stopped_mid_run_fails_clearly_then_resumes(arc_streams, tiny_checkpoints, tmp_path, gcs):
    records = long_stream(arc_streams, tmp_path / "long.jsonl", copies=4)
    args = ["--machine_id", "0", "--dataset_stream", str(tmp_path / "long.jsonl"), "--model_path",
            tiny_checkpoints["gqa_tied"], "--output_dir", str(tmp_path), "--shard_size_gb", SHARD_GB,
            "--max_seq_length", "160", "--dtype", "float32", "--upload_to_gcs", "--gcs_bucket", "acts",
            "--upload_retries", "2", "--batch_size", "1",
            "--store_memory_gb", str(1.5 * float(SHARD_GB))]  # under two shards: each stored before the next fills
    gate = tmp_path / "gate"
    proc = gated_runner(args, tmp_path / "machine_000", gate)
    while not [n for n in bucket_names(gcs) if n.startswith("shard_")]:  # the first shard is up
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    gcs.stop()
    gate.touch()
    stdout, stderr = proc.communicate(timeout=120)
    lines = stderr.strip().splitlines()
    assert proc.returncode == 2 and "runners.tpu_host: error: GCS" in lines[-1], lines[-3:]
    assert "failed after 2 attempts" in lines[-1]
    gcs.start()
    result = run_host_cli(*args)
    assert result.returncode == 0, result.stderr
    checkpoint = json.loads((tmp_path / "machine_000" / "checkpoint.json").read_text())
    ids = [e[0] for shard in shard_contents(tmp_path / "machine_000").values() for e in shard[0]]
    assert checkpoint["status"] == COMPLETED
    assert ids == [r["sample_id"] for r in records]
    remote = bucket_names(gcs)
    assert [n for n in remote if n.startswith("shard_")] == [s["filename"] for s in checkpoint["shards"]]


def test_answers_broken_off_mid_body_are_retried(gcs):
    from host.storage import GcsStore
    store = GcsStore("acts", "m", retries=2, backoff_s=0.0)
    gcs.fault("POST", r"m/shard_0000\.pkl\.gz", action="cut")  # stored, then the answer breaks off
    gcs.fault("GET", r"m/shard_0000\.pkl\.gz", action="cut")   # the verifying read breaks off too
    assert store.upload("shard_0000.pkl.gz", b"0123456789") == "gs://acts/m/shard_0000.pkl.gz"
    assert gcs._faults(None, method="GET")["fired"] == 2
    assert gcs.client().bucket("acts").blob("m/shard_0000.pkl.gz").download_as_bytes() == b"0123456789"


def test_the_emulator_restarts_on_a_new_port_when_its_own_was_taken(gcs):
    gcs.client().bucket("acts").blob("kept").upload_from_string(b"kept")
    gcs.stop()
    with socket.socket() as taker:  # e.g. another connection given the free port as its source
        taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taker.bind(("127.0.0.1", gcs.port))
        taker.listen()
        old = gcs.port
        gcs.start()
    assert gcs.port != old and os.environ["STORAGE_EMULATOR_HOST"] == gcs.host
    assert gcs.client().bucket("acts").blob("kept").download_as_bytes() == b"kept"
