"""``runners.fleet status`` on hand-written machine directories, one per state."""

import datetime
import json
import pathlib

import pytest

from tests.conftest import run_in_process
from common.states import COMPLETED


def iso(seconds_ago: float) -> str:
    at = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=seconds_ago)
    return at.isoformat(timespec="milliseconds")


def write_machine(out: pathlib.Path, machine: int, state: str, age_s: float, done: int, total: int,
                  shards: int, completed: bool = False, error: str | None = None,
                  max_samples: int | None = None) -> None:
    folder = out / f"machine_{machine:03d}"
    folder.mkdir(parents=True)
    status = {"machine_id": machine, "state": state, "error": error, "updated_at": iso(age_s),
              "heartbeat_s": 60.0, "samples_done": done, "samples_total": total, "tokens_done": done * 100,
              "tokens_per_s": {"last_minute": 250.0, "since_start": 200.0}, "shards": shards}
    history = [{"shard_id": i + 1, "total_samples_in_shard": 2, "stored_at": iso(600 - 60 * i)}
               for i in range(shards)]
    checkpoint = {"status": COMPLETED if completed else "in_progress", "total_shards": shards,
                  "total_samples_processed": 2 * shards, "shards": history, "max_samples": max_samples,
                  "total_tokens": 200 * shards}
    (folder / "status.json").write_text(json.dumps(status))
    (folder / "checkpoint.json").write_text(json.dumps(checkpoint))


@pytest.fixture
def fleet_dir(tmp_path):
    out = tmp_path / "out"
    write_machine(out, 0, COMPLETED, 30, 10, 10, 5, completed=True)
    write_machine(out, 1, "running", 5, 4, 10, 2)
    write_machine(out, 2, "running", 500, 6, 10, 3)            # heartbeat 500 s old > 3 x 60 s
    write_machine(out, 3, "failed", 10, 2, 10, 1, error="SampleTooLong: sample 7 has 3000 tokens")
    return out                                                   # machine 4: no file at all


def status(out, machines, *extra):
    return run_in_process("runners.fleet", "status", "--name", "t", "--output", str(out),
                   "--num_machines", str(machines), *extra)


def table_rows(stdout: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in stdout.splitlines() if line[:3].isdigit()}


def seconds(text: str) -> int:
    """``8m20s`` -> 500."""
    minutes, _, rest = text.rpartition("m")
    return 60 * int(minutes or 0) + int(rest.rstrip("s"))


def test_every_state_in_the_table_and_exit_code_2(fleet_dir, tmp_path):
    chart = tmp_path / "fleet.png"
    result = status(fleet_dir, 5, "--chart", str(chart))
    assert result.returncode == 2, result.stderr
    rows = table_rows(result.stdout)
    assert [rows[f"{i:03d}"][1] for i in range(5)] == ["COMPLETED", "RUNNING", "STALLED", "FAILED", "MISSING"]
    assert rows["000"][2:5] == ["10/10", "100.0", "5"]
    assert rows["001"][2:6] == ["4/10", "40.0", "2", "250"]
    assert rows["002"][5] == "-"                    # a stalled machine computes nothing
    assert 5 <= seconds(rows["001"][6]) < 60 and 500 <= seconds(rows["002"][6]) < 560  # + start-up
    assert rows["004"][2:] == ["0/?", "-", "0", "-", "-", "0.00"]  # no usage recorded: 0 hours
    assert "machine 003: SampleTooLong: sample 7 has 3000 tokens" in result.stdout
    assert "fleet: 1/5 machines completed, 22/? samples" in result.stdout
    assert "250 tokens/s" in result.stdout
    png = chart.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_exit_code_1_while_running_0_when_all_completed(tmp_path):
    out = tmp_path / "out"
    write_machine(out, 0, COMPLETED, 30, 10, 10, 5, completed=True)
    write_machine(out, 1, "compiling", 5, 4, 10, 2)
    result = status(out, 2)
    assert result.returncode == 1, result.stderr
    # ETA: 6 samples left x 100 tokens each at 250 tokens/s
    assert "ETA 2s" in result.stdout and "5/10" not in result.stdout
    (out / "machine_001" / "checkpoint.json").write_text(json.dumps(
        {"status": COMPLETED, "total_shards": 5, "total_samples_processed": 10, "shards": []}))
    result = status(out, 2)
    assert result.returncode == 0 and "2/2 machines completed, 20/20 samples" in result.stdout
    watched = status(out, 2, "--watch", "--interval", "0.1")  # not a terminal: plain tables
    assert watched.returncode == 0 and watched.stdout.count("machine  state") == 1


def test_progress_over_time_from_files_without_a_samples_history(fleet_dir):
    from fleet.config import FleetConfig
    from fleet.machines import read_fleet
    from fleet.report import progress_curves
    files = read_fleet(FleetConfig(name="t", output=str(fleet_dir), num_machines=5))
    computed, stored = progress_curves(files, None)  # no launch record: from the first shard
    assert stored[0] == (0, 0) and stored[-1][1] == 2 * 11 and stored == sorted(stored)
    # the newest counts (10 + 4 + 6 + 2), at their heartbeats, after the shards
    assert computed[0] == (0, 0) and computed[-1][1] == 22 and computed == sorted(computed)


def write_usage(out: pathlib.Path, machines: dict[int, list[tuple[float, float | None]]],
                released: tuple[int, ...] = ()) -> None:
    """``_fleet/usage.json`` with these incarnations, as (started, ended) seconds ago."""
    document = {"backend": "tpu-vm", "machines": {f"{m:03d}": {
        "incarnations": [{"key": f"node-{m}-{i}", "started_at": iso(start),
                          "ended_at": None if end is None else iso(end)} for i, (start, end) in enumerate(lives)],
        "released_at": iso(lives[-1][1]) if m in released else None} for m, lives in machines.items()}}
    (out / "_fleet").mkdir(parents=True, exist_ok=True)
    (out / "_fleet" / "usage.json").write_text(json.dumps(document))


def test_usage_and_cost(tmp_path):
    out = tmp_path / "out"
    write_machine(out, 0, COMPLETED, 30, 10, 10, 5, completed=True)
    write_machine(out, 1, "running", 5, 4, 10, 2)  # ETA: 6 samples x 100 tokens at 250 tokens/s = 2.4 s
    # machine 0: preempted after 1 h, then 2 h until it completed and was released;
    # machine 1: up for the last 30 minutes
    write_usage(out, {0: [(4 * 3600, 3 * 3600), (3 * 3600, 3600)], 1: [(1800, None)]}, released=(0,))
    result = status(out, 2, "--price_per_hour", "2")
    rows = table_rows(result.stdout)
    assert rows["000"][1:3] == ["COMPLETED", "(released)"] and rows["000"][-2:] == ["3.00", "6.00"]
    assert rows["001"][-2:] == ["0.50", "1.00"]
    assert "usage: 3.50 accelerator-hours, 400 tokens/accelerator-hour" in result.stdout  # 1,400 tokens
    assert "cost 7.00 so far, 7.00 at completion (at 2 per machine-hour)" in result.stdout

    document = json.loads(status(out, 2, "--json", "--price_per_hour", "2").stdout)
    [done, running] = document["machines"]
    assert (done["released"], done["active"], running["active"]) == (True, False, True)
    assert done["accelerator_hours"] == pytest.approx(3.0)
    assert running["accelerator_hours"] == pytest.approx(0.5, abs=1e-3)
    assert done["tokens_per_accelerator_hour"] == pytest.approx(1000 / 3)
    fleet = document["fleet"]
    assert fleet["cost"] == pytest.approx(7.0, abs=0.01) and fleet["price_per_hour"] == 2
    assert fleet["projected_cost"] == pytest.approx(fleet["cost"] + 2 * 2.4 / 3600)
    unpriced = json.loads(status(out, 2, "--json").stdout)["fleet"]
    assert unpriced["cost"] is None and unpriced["projected_cost"] is None


def test_a_machine_completed_under_a_smaller_max_samples_has_more_to_do(tmp_path):
    out = tmp_path / "out"
    write_machine(out, 0, COMPLETED, 30, 4, 4, 2, completed=True, max_samples=4)
    runner = ["--", "--model_path", "some/model"]
    assert status(out, 1, *runner, "--max_samples", "4").returncode == 0
    assert status(out, 1, *runner, "--max_samples", "3").returncode == 0  # 4 covers 3
    for bigger in (["--max_samples", "10"], []):  # none: the whole stream
        result = status(out, 1, *runner, *bigger)
        assert result.returncode == 2 and table_rows(result.stdout)["000"][1] == "UNDER_LIMIT", result.stdout
    # without runner flags: those launch recorded, else no judgement of the limit
    assert status(out, 1).returncode == 0
    (out / "_fleet").mkdir()
    (out / "_fleet" / "fleet.json").write_text(json.dumps({"runner": ["--model_path", "m", "--max_samples", "10"]}))
    assert table_rows(status(out, 1).stdout)["000"][1] == "UNDER_LIMIT"


def test_a_stream_that_ended_before_the_limit_is_done_under_any_larger_one(tmp_path):
    out = tmp_path / "out"
    write_machine(out, 0, COMPLETED, 30, 4, 4, 2, completed=True, max_samples=100)  # 4 records in all
    assert status(out, 1, "--", "--model_path", "some/model").returncode == 0


def test_the_ledger_reopens_a_released_machine_that_runs_again():
    from fleet.backend import Incarnation
    from fleet.usage import Ledger
    ledger = Ledger()
    assert ledger.observe({3: [Incarnation("node@1", 100.0)]}, now=150.0)
    ledger.released_at[3] = 200.0
    assert ledger.observe({}, now=200.0) and not ledger.active(3)  # deleted: ended when first missed
    assert ledger.hours(3, now=999.0) == (200.0 - 100.0) / 3600
    assert ledger.observe({3: [Incarnation("node@300", 300.0)]}, now=310.0)
    assert ledger.active(3) and 3 not in ledger.released_at and ledger.current_start(3) == 300.0
    assert not ledger.observe({3: [Incarnation("node@300", 300.0)]}, now=320.0)  # nothing new
    assert ledger.observe({3: [Incarnation("node@300", 300.0, 330.0, active=False)]}, now=400.0)
    assert ledger.hours(3, now=999.0) == (100.0 + 30.0) / 3600  # the engine's end time, not the look's
