"""The host's state files on their own: checkpoint.json, rejected.jsonl, status.json."""

import json
import time

import pytest

from common.cli import UserError
from host.checkpoint import Checkpoint, covers
from host.rejected import RejectedLog
from host.status import HealthReporter
from common.states import COMPLETED
from tests.conftest import wait_for


@pytest.mark.parametrize("text", ['{"total_samples_processed": "5"}', '{"total_shards": 1, "shards": []}',
                                  '{"status": "done"}', '{"total_skipped": -1}', '{"shards": {}}'])
def test_a_checkpoint_with_wrong_fields_is_one_line(text):
    with pytest.raises(UserError, match="corrupted checkpoint c.json: inconsistent fields"):
        Checkpoint.from_json(text, "c.json")


def test_a_checkpoint_written_before_the_counters_existed_still_loads():
    old = {"last_processed_sample_idx": 4, "total_samples_processed": 5, "total_shards": 0,
           "status": "in_progress", "shards": [], "max_samples": None}
    checkpoint = Checkpoint.from_json(json.dumps(old), "c.json")
    assert (checkpoint.total_tokens, checkpoint.total_truncated, checkpoint.total_skipped) == (0, 0, 0)


def test_rejected_log_keeps_what_the_checkpoint_counts(tmp_path):
    log = RejectedLog(str(tmp_path), store=None)
    log.load(0)
    assert not (tmp_path / "rejected.jsonl").exists()
    log.append([{"sample_id": 1}, {"sample_id": 2}])
    log.append([{"sample_id": 3}])  # say the run died before the checkpoint counted this one
    resumed = RejectedLog(str(tmp_path), store=None)
    resumed.load(2)
    assert (tmp_path / "rejected.jsonl").read_text() == '{"sample_id":1}\n{"sample_id":2}\n'
    RejectedLog(str(tmp_path), store=None).load(0)
    assert not (tmp_path / "rejected.jsonl").exists()
    with pytest.raises(UserError, match="has 0 lines but the checkpoint counts 2 skipped records"):
        RejectedLog(str(tmp_path), store=None).load(2)


def read_status(tmp_path):
    return json.loads((tmp_path / "status.json").read_text())


def test_heartbeat_compiles_and_final_state(tmp_path):
    counters = {"samples_done": 0}
    health = HealthReporter(str(tmp_path), 4, heartbeat_s=0.05, counters=lambda: dict(counters))
    health.start()
    first = read_status(tmp_path)
    assert first["state"] == "starting" and first["machine_id"] == 4 and first["heartbeat_s"] == 0.05
    health.set_state("running")
    with health.compiling(8, 128):
        time.sleep(0.2)  # the compile's time, which compile_s counts below
        wait_for(lambda: read_status(tmp_path)["state"] == "compiling", what="the compiling state's beat")
    seen = set()
    deadline = time.monotonic() + 5
    while len(seen) < 4 and time.monotonic() < deadline:  # beats keep coming without any event
        seen.add(read_status(tmp_path)["updated_at"])
        time.sleep(0.02)
    assert len(seen) >= 4
    counters["samples_done"] = 7
    health.finish(COMPLETED)
    final = read_status(tmp_path)
    assert final["state"] == COMPLETED and final["samples_done"] == 7 and final["error"] is None
    assert final["compiles"] == 1 and final["compile_s"] >= 0.2
    assert [h["state"] for h in final["history"]] == ["starting", "running", "compiling", "running",
                                                       "completed"]


@pytest.mark.parametrize("error, line", [(UserError("bad flag"), "bad flag"),
                                         (ZeroDivisionError("division by zero"),
                                          "ZeroDivisionError: division by zero")])
def test_an_exception_ends_the_status_as_failed_with_its_line(tmp_path, error, line):
    health = HealthReporter(str(tmp_path), 0, heartbeat_s=60, counters=dict)
    with pytest.raises(type(error)):
        with health.reporting():
            raise error
    status = read_status(tmp_path)
    assert status["state"] == "failed" and status["error"] == line


def test_rejected_log_on_gcs_is_appended_and_trimmed_like_the_local_file(tmp_path, gcs):
    from host.storage import GcsStore
    store = GcsStore("acts", "m", retries=2)
    remote = gcs.client().bucket("acts").blob("m/rejected.jsonl")
    log = RejectedLog(str(tmp_path), store)
    log.load(0)
    log.append([{"sample_id": 1}])
    log.append([{"sample_id": 2}, {"sample_id": 3}])  # composed onto the object, not re-sent
    assert remote.download_as_bytes() == (tmp_path / "rejected.jsonl").read_bytes() == \
        b'{"sample_id":1}\n{"sample_id":2}\n{"sample_id":3}\n'
    assert not [b.name for b in gcs.client().list_blobs("acts", prefix="m/rejected.jsonl.part")]
    (tmp_path / "rejected.jsonl").unlink()  # a lost disk; the checkpoint counted two lines
    RejectedLog(str(tmp_path), store).load(2)
    assert remote.download_as_bytes() == (tmp_path / "rejected.jsonl").read_bytes() == \
        b'{"sample_id":1}\n{"sample_id":2}\n'
    RejectedLog(str(tmp_path), store).load(0)
    assert not remote.exists() and not (tmp_path / "rejected.jsonl").exists()


@pytest.mark.parametrize("ran_under, processed, limit, covered", [
    (None, 12, None, True), (None, 12, 5, True),   # no limit: the whole stream
    (5, 5, None, False), (5, 5, 8, False),         # stopped at its limit: more to do
    (5, 5, 5, True), (8, 8, 5, True),              # as much as asked, or more
    (100, 12, None, True), (100, 12, 500, True),   # the stream ended before the limit
])
def test_covers(ran_under, processed, limit, covered):
    assert covers(ran_under, processed, limit) is covered
