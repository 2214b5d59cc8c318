"""The fleet's progress chart: samples computed (``status.json``'s ``samples_history``) and stored
(the checkpoints' shards) over time since the launch."""

import json

from fleet.config import FleetConfig
from fleet.machines import MachineFiles, computed_curve, fleet_views, read_fleet, read_launched_at
from fleet.report import chart, fleet_report, progress_curves, write_chart
from fleet.usage import Ledger
from host.machine_status import combined
from host.progress import Progress, SamplesHistory
from common.states import COMPLETED, RUNNING
from host.status import HealthReporter, iso_time

LAUNCH = 1_800_000_000.0  # seconds since the epoch: every time below is this plus a few seconds


def at(seconds: float) -> str:
    return iso_time(LAUNCH + seconds)


def shards(*stored: tuple[float, int]) -> dict:
    """A checkpoint with shards of (seconds after the launch it was stored, samples in it)."""
    return {"status": "in_progress", "total_samples_processed": sum(n for _, n in stored),
            "shards": [{"stored_at": at(s), "total_samples_in_shard": n} for s, n in stored]}


def test_the_history_keeps_a_bursts_top_and_stays_small():
    history = SamplesHistory(limit=4, spacing_s=1.0)
    for point in [(0.0, 1), (10.0, 2), (10.1, 64), (40.0, 65)]:  # a window's outputs come at once
        history.add(*point)
    assert history.points == [(0.0, 1), (10.0, 2), (10.1, 64)] and history.newest == (40.0, 65)
    for second in range(41, 1000):
        history.add(float(second), second)
    assert len(history.points) <= 4 and history.points[0] == (0.0, 1) and history.spacing_s > 100


def test_status_json_carries_the_history_to_the_computed_curve(tmp_path):
    progress = Progress()
    progress.history = SamplesHistory(spacing_s=0.0)  # a point per change, however fast the machine
    health = HealthReporter(str(tmp_path), 0, 3600.0, progress.snapshot)
    health.start()
    first = json.loads((tmp_path / "status.json").read_text())
    assert [n for _, n in first["samples_history"]] == [0]
    health.set_state(RUNNING)
    for tokens in (5, 6, 7):
        progress.sample_done(tokens)
    health.finish(COMPLETED)
    status = json.loads((tmp_path / "status.json").read_text())
    assert [n for _, n in status["samples_history"]] == [1, 2, 3, 3]  # the last: the final write's
    assert list(status)[-2:] == ["history", "samples_history"]  # the long list last
    curve = computed_curve(MachineFiles(0, status, None))
    assert [n for _, n in curve] == [1, 2, 3, 3, 3] and curve == sorted(curve)


def test_a_windows_batches_count_as_computed_before_the_window_is_emitted():
    progress = Progress()
    progress.before["samples"] = 3  # an earlier run stored 3 records; this one resumed its window at 1
    progress.resume_window(2)
    progress.batch_computed(2)      # records 1 and 2, already stored
    assert (progress.samples_done(), progress.samples_computed()) == (3, 3)
    progress.batch_computed(2)      # records 3 and 4
    assert (progress.samples_done(), progress.samples_computed()) == (3, 5)
    progress.sample_done(10)        # the window emitted: the stored two dropped, the new two passed on
    progress.sample_done(10)
    assert (progress.samples_done(), progress.samples_computed()) == (5, 5)
    assert progress.snapshot()["samples_computed"] == 5


def test_computed_rises_before_anything_is_stored_from_the_launch():
    # machine 0 has computed 8 samples and stored none; machine 1 wrote an older status.json
    # (no samples_history): its count at its last write, and what its shards stored
    busy = {"started_at": at(5), "updated_at": at(35), "samples_done": 8,
            "samples_history": [[at(10), 0], [at(20), 4], [at(30), 8]]}
    old = {"started_at": at(8), "updated_at": at(25), "samples_done": 6}
    files = [MachineFiles(0, busy, None), MachineFiles(1, old, shards((15, 2), (25, 4)))]
    computed, stored = progress_curves(files, LAUNCH)
    assert computed == [(0, 0), (10, 0), (15, 2), (20, 6), (25, 10), (30, 14), (35, 14)]
    assert stored == [(0, 0), (15, 2), (25, 6)]
    # without a launch record: from the earliest time the files give (machine 0's start)
    computed, stored = progress_curves(files, None)
    assert computed[:3] == [(0, 0), (5, 0), (10, 2)] and stored == [(0, 0), (10, 2), (20, 6)]
    # launched again after this work began: the earlier work comes before 0
    computed, stored = progress_curves(files, LAUNCH + 20)
    assert computed[:3] == [(-10, 0), (-5, 2), (0, 6)] and stored == [(-5, 0), (-5, 2), (5, 6)]


def test_a_multi_process_machine_keeps_the_first_process_history():
    documents = [{"process_id": p, "num_processes": 2, "state": RUNNING, "samples_done": 4 - p,
                  "samples_history": [[at(10 + p), 4 - p]]} for p in range(2)]
    assert combined(documents)["samples_history"] == [[at(10), 4]]


def test_the_chart_draws_both_curves_from_the_launch(tmp_path):
    (tmp_path / "_fleet").mkdir()
    (tmp_path / "_fleet" / "fleet.json").write_text(json.dumps({"launched_at": at(0)}))
    config = FleetConfig(name="t", output=str(tmp_path), num_machines=1)
    assert read_launched_at(config) == LAUNCH
    status = {"state": RUNNING, "started_at": at(5), "updated_at": at(40), "heartbeat_s": 60.0,
              "samples_done": 8, "samples_total": 16, "samples_history": [[at(10), 0], [at(30), 8]]}
    (tmp_path / "machine_000").mkdir()
    (tmp_path / "machine_000" / "status.json").write_text(json.dumps(status))
    (tmp_path / "machine_000" / "checkpoint.json").write_text(json.dumps(shards((35, 4))))
    files = read_fleet(config)
    report = fleet_report(fleet_views(files, now=LAUNCH + 41), files, Ledger(), LAUNCH + 41, None,
                          read_launched_at(config))
    figure = chart(report)
    curve = figure.axes[1]
    lines = {line.get_label(): line for line in curve.get_lines()}
    assert list(lines) == ["computed (status.json)", "stored (shards in checkpoints)", "all samples"]
    assert list(lines["computed (status.json)"].get_ydata()) == [0, 0, 8, 8, 8]
    assert list(lines["stored (shards in checkpoints)"].get_xdata()) == [0, 35]  # seconds: a short run
    assert curve.get_xlabel() == "seconds since launch (2027-01-15 08:00 UTC)"
    assert [t.get_text() for t in curve.get_legend().get_texts()] == list(lines)
    write_chart(report, str(tmp_path / "fleet.png"))
    assert (tmp_path / "fleet.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
