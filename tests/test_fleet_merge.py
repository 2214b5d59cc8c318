"""``runners.fleet merge``'s completeness check through the streams' id sidecars and through the full
read of the streams (what an older prepare's manifest gets): the same verdict line on the same fleet,
whether the streams are single files or in parts.

The fleets are the files a completed runner leaves (``completed_machine_files``) for chosen records
of the ``arc_streams`` (2 machines, 24 samples); no model runs.
"""

import json
import logging
import shutil

import pytest

from common.files import join, read_optional
from common.stream_format import ids_sidecar, json_line, sidecar_record
from fleet.config import FleetConfig
from fleet.merge import merge
from host.rejected import REJECTED_FILE
from tests.conftest import read_streams
from tests.test_fleet_errors import upload_streams
from tests.test_fleet_tpu_vm import completed_machine_files
from tests.test_stream_reader import split_stream


@pytest.fixture
def streams(arc_streams, tmp_path):
    """A copy of the session's streams, free to tamper with."""
    return shutil.copytree(arc_streams, tmp_path / "streams")


def write_machines(out, stored: list[list[dict]]) -> None:
    for machine, records in enumerate(stored):
        for name, data in completed_machine_files(records, machine).items():
            path = out / f"machine_{machine:03d}" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def older_manifest(manifest: dict) -> dict:
    """The manifest as a prepare without sidecars wrote it."""
    return {**manifest, "machines": [{k: v for k, v in e.items() if k != "ids"} for e in manifest["machines"]]}


def verdict_lines(streams_dir: str, out: str, limit: int | None = None) -> tuple[str, str]:
    """(merge's line through the sidecars, through the full read)."""
    manifest = json.loads(read_optional(join(streams_dir, "manifest.json")))
    config = FleetConfig(name="m", num_machines=manifest["num_machines"], streams_dir=streams_dir, output=out)
    return merge(config, manifest, None, limit)[1], merge(config, older_manifest(manifest), None, limit)[1]


def ids(records: list[dict]) -> str:
    return ", ".join(str(r["sample_id"]) for r in records)


EXTRA_ID = 1 << 50  # in no stream

FLEETS = {  # name -> (records each machine stores, the start of the verdict line)
    "complete": (lambda s: [s[0], s[1]], lambda s: "fleet m complete: 2 machines, 24 samples, "),
    "missing": (lambda s: [s[0], s[1][:-2]],
                lambda s: f"fleet m INCOMPLETE: machine 001: 2 sample(s) missing: {ids(s[1][-2:])}; partial index"),
    "duplicate": (lambda s: [s[0], s[1] + s[0][:1]],
                  lambda s: f"fleet m INCOMPLETE: 1 sample id(s) stored more than once: {ids(s[0][:1])}; "
                            f"machine 001: 1 sample(s) not in its stream: {ids(s[0][:1])}; no index written"),
    "unexpected": (lambda s: [s[0] + [{**s[0][0], "sample_id": EXTRA_ID}], s[1]],
                   lambda s: f"fleet m INCOMPLETE: machine 000: 1 sample(s) not in its stream: {EXTRA_ID}; "
                             "partial index"),
}


@pytest.mark.parametrize("name", FLEETS)
def test_sidecars_and_the_full_read_give_the_same_verdict(streams, tmp_path, name):
    stored, line = FLEETS[name]
    records = read_streams(streams, 2)
    write_machines(tmp_path / "out", stored(records))
    via_sidecars, full_read = verdict_lines(str(streams), str(tmp_path / "out"))
    assert via_sidecars == full_read
    assert via_sidecars.startswith(line(records)), via_sidecars


def test_skipped_records_and_max_samples_alike(streams, tmp_path):
    records = read_streams(streams, 2)
    out = tmp_path / "out"
    write_machines(out, [records[0][1:5], records[1][:4]])  # machine 0 skipped its first record
    (out / "machine_000" / REJECTED_FILE).write_text(json_line({"sample_id": records[0][0]["sample_id"]}))
    via_sidecars, full_read = verdict_lines(str(streams), str(out), limit=5)
    assert via_sidecars == full_read
    assert via_sidecars.startswith(f"fleet m INCOMPLETE: machine 001: 1 sample(s) missing: {ids(records[1][4:5])}")


def test_max_samples_takes_the_first_records_in_stream_order(tmp_path):
    """The sidecar keeps stream order: with a limit, the records expected are the stream's first,
    not the smallest ids (a hand-written stream need not be sorted)."""
    records = [{"sample_id": i, "input_ids": [7], "num_tokens": 1, "source": f"s{i}"} for i in (5, 3, 9, 1)]
    stream = "".join(json_line(r) for r in records).encode()
    sidecar = ids_sidecar([r["sample_id"] for r in records])
    streams = tmp_path / "streams"
    streams.mkdir()
    (streams / "stream_000.jsonl").write_bytes(stream)
    (streams / "stream_000.ids.npy").write_bytes(sidecar)
    (streams / "manifest.json").write_text(json.dumps({"num_machines": 1, "machines": [
        {"machine": 0, "samples": 4, "stream_bytes": len(stream), "ids": sidecar_record(0, sidecar, 4)}]}))
    write_machines(tmp_path / "out", [records[:2]])
    via_sidecars, full_read = verdict_lines(str(streams), str(tmp_path / "out"), limit=2)
    assert via_sidecars == full_read and via_sidecars.startswith("fleet m complete: 1 machines, 2 samples")


def test_the_sidecars_spare_reading_the_streams(streams, tmp_path):
    write_machines(tmp_path / "out", read_streams(streams, 2))
    for m in range(2):  # junk of the same size: only a read of the stream would notice
        path = streams / f"stream_{m:03d}.jsonl"
        path.write_bytes(b" " * (path.stat().st_size - 1) + b"\n")
    via_sidecars, full_read = verdict_lines(str(streams), str(tmp_path / "out"))
    assert via_sidecars.startswith("fleet m complete: 2 machines, 24 samples")
    assert full_read.startswith("fleet m INCOMPLETE: machine 000: its stream has 0 records, the manifest says ")


def test_streams_without_sidecars_are_read_in_full_with_one_log_line(streams, tmp_path, caplog):
    write_machines(tmp_path / "out", read_streams(streams, 2))
    manifest = json.loads((streams / "manifest.json").read_text())
    (streams / "manifest.json").write_text(json.dumps(older_manifest(manifest)))
    for m in range(2):
        (streams / f"stream_{m:03d}.ids.npy").unlink()
    with caplog.at_level(logging.INFO, logger="runners.fleet"):
        via_sidecars, full_read = verdict_lines(str(streams), str(tmp_path / "out"))
    assert via_sidecars == full_read and via_sidecars.startswith("fleet m complete: 2 machines, 24 samples")
    said = [r.getMessage() for r in caplog.records if "sidecar" in r.getMessage()]
    assert said == [f"2 of 2 streams in {streams} have no id sidecar (an older pipeline.prepare): "
                    "reading them in full"] * 2  # once per merge: both of verdict_lines' manifests lack them


@pytest.mark.parametrize("tamper, warning", [
    pytest.param(lambda s: (s / "stream_001.ids.npy").write_bytes(ids_sidecar([1, 2, 3])),
                 "machine 001: stream_001.ids.npy is not the one the manifest describes (sha256); "
                 "reading its stream in full", id="another sidecar"),
    pytest.param(lambda s: (s / "stream_001.ids.npy").unlink(),
                 "machine 001: no stream_001.ids.npy; reading its stream in full", id="no sidecar"),
    pytest.param(lambda s: open(s / "stream_001.jsonl", "a").write(json_line({"sample_id": EXTRA_ID})),
                 "machine 001: {streams}/stream_001.jsonl is {size} bytes, the manifest says", id="another stream"),
])
def test_a_sidecar_that_does_not_fit_is_not_trusted(streams, tmp_path, caplog, tamper, warning):
    write_machines(tmp_path / "out", read_streams(streams, 2))
    tamper(streams)
    with caplog.at_level(logging.WARNING, logger="runners.fleet"):
        via_sidecars, full_read = verdict_lines(str(streams), str(tmp_path / "out"))
    assert via_sidecars == full_read
    [said] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said.startswith(warning.format(streams=streams, size=(streams / "stream_001.jsonl").stat().st_size))


def test_a_missing_stream_is_one_problem_either_way(streams, tmp_path):
    write_machines(tmp_path / "out", read_streams(streams, 2))
    (streams / "stream_001.jsonl").unlink()
    via_sidecars, full_read = verdict_lines(str(streams), str(tmp_path / "out"))
    assert via_sidecars == full_read
    assert via_sidecars.startswith(f"fleet m INCOMPLETE: machine 001: no stream {streams / 'stream_001.jsonl'}")


def test_on_gcs(streams, gcs):
    records = read_streams(streams, 2)
    bucket = gcs.client().bucket("acts")
    for machine, stored in enumerate([records[0], records[1][:-1]]):
        for name, data in completed_machine_files(stored, machine).items():
            bucket.blob(f"run/machine_{machine:03d}/{name}").upload_from_string(data)
    via_sidecars, full_read = verdict_lines(upload_streams(gcs, streams), "gs://acts/run")
    assert via_sidecars == full_read
    assert via_sidecars == (f"fleet m INCOMPLETE: machine 001: 1 sample(s) missing: {ids(records[1][-1:])}; "
                            "partial index gs://acts/run/index.parquet")


def test_streams_in_parts_give_the_verdicts_of_single_files(streams, tmp_path, caplog):
    records = read_streams(streams, 2)
    parted = shutil.copytree(streams, tmp_path / "parted")
    for m in range(2):
        split_stream(parted, m, [4, 8])
    for name in ("complete", "missing", "unexpected"):
        write_machines(tmp_path / name, FLEETS[name][0](records))
        single = verdict_lines(str(streams), str(tmp_path / name))
        assert verdict_lines(str(parted), str(tmp_path / name)) == single
        assert single[0] == single[1] and single[0].startswith(FLEETS[name][1](records))
    # A part that is not what the manifest says: its stream is read in full, the part named.
    part = parted / "stream_001" / "part-00001.jsonl"
    size = part.stat().st_size
    with open(part, "a") as f:
        f.write(json_line({"sample_id": EXTRA_ID}))
    with caplog.at_level(logging.WARNING, logger="runners.fleet"):
        via_sidecars, full_read = verdict_lines(str(parted), str(tmp_path / "complete"))
    assert via_sidecars == full_read
    assert via_sidecars.startswith("fleet m INCOMPLETE: machine 001: its stream has 13 records, the manifest says 12")
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"machine 001: {part} is {part.stat().st_size} bytes, the manifest says {size}; "
        "reading its stream in full"]
    part.unlink()
    via_sidecars, full_read = verdict_lines(str(parted), str(tmp_path / "complete"))
    assert via_sidecars == full_read and via_sidecars.startswith(f"fleet m INCOMPLETE: machine 001: no stream {part}")


def test_a_machine_completed_under_a_smaller_limit_is_not_complete(streams, tmp_path):
    records = read_streams(streams, 2)
    out = tmp_path / "out"
    write_machines(out, [records[0][:3], records[1]])
    path = out / "machine_000" / "checkpoint.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_samples": 3}))
    via_sidecars, _ = verdict_lines(str(streams), str(out))
    assert via_sidecars.startswith("fleet m INCOMPLETE: machine 000 completed under a smaller --max_samples "
                                   "than the runner flags ask for; machine 000: 9 sample(s) missing: ")
    limited, _ = verdict_lines(str(streams), str(out), limit=3)  # machine 001 stored more than asked
    assert limited.startswith("fleet m INCOMPLETE: machine 001: 9 sample(s) not in")
