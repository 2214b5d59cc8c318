"""The store path (host/writer.py) on synthetic samples: several shards in flight, in order, within
the memory budget, byte-identical to the in-memory encoding; a failure stops later commits."""

import json
import multiprocessing
import os
import random
import shutil
import time

import numpy as np
import pytest

from activations.shards import encode_shard, shard_dict
from common.states import COMPLETED
from host.checkpoint import Checkpoint, load_checkpoint
from host.run import remove_orphans
from host.rejected import RejectedLog
from host.storage import Crc32c, GcsStore, StorageError
from host.store_stats import StoreStats
from host.writer import CHECKPOINT_FILE, RATE_SHARDS, ShardSettings, ShardWriter, rates_report
from model.statistics import sample_statistics

LAYERS, HIDDEN = (0, 2), 16


def sample(i: int, tokens: int = 64) -> dict:
    rng = np.random.default_rng(i)
    activations = {layer: rng.standard_normal((tokens, HIDDEN)).astype(np.float32) for layer in LAYERS}
    return {"sample_id": 1000 + i, "source": f"s{i}", "text_preview": f"text {i}", "num_tokens": tokens,
            "truncated": False, "original_num_tokens": tokens, "activations": activations,
            "statistics": sample_statistics(activations)}


SAMPLE_BYTES = 64 * HIDDEN * 4 * len(LAYERS)  # 8 KiB


def writer_for(tmp_path, shards_of: int, budget_shards: float, store=None, threads=2, compress=True,
               write_threads=2, statistics=True):
    out = tmp_path / "machine_000"
    (out / "index").mkdir(parents=True, exist_ok=True)
    settings = ShardSettings(0, str(out), shards_of * SAMPLE_BYTES, compress, LAYERS, HIDDEN, "float32", False, 1,
                             {"run": "test"}, memory_budget_bytes=int(budget_shards * shards_of * SAMPLE_BYTES),
                             compression_threads=threads, upload_threads=3, write_threads=write_threads,
                             statistics=statistics)
    stored = []
    writer = ShardWriter(settings, Checkpoint(), store, RejectedLog(str(out), store),
                         on_stored=lambda shard: stored.append(shard["shard_id"]), stats=StoreStats())
    return writer, out, stored


@pytest.mark.parametrize("compress", [True, False])
def test_shards_in_flight_commit_in_order_and_equal_the_in_memory_encoding(tmp_path, compress):
    writer, out, stored = writer_for(tmp_path, shards_of=3, budget_shards=10, compress=compress)
    samples = [sample(i) for i in range(14)]
    held = []
    for s in samples:
        writer.add(s)
        held.append(writer._held + writer._buffer_bytes)
    writer.finalize()
    writer.close()
    assert stored == [1, 2, 3, 4, 5]  # 3+3+3+3+2 samples, committed in order
    checkpoint = json.loads((out / "checkpoint.json").read_text())
    assert checkpoint["total_samples_processed"] == 14 and checkpoint["total_shards"] == 5
    assert [s["first_sample_id"] for s in checkpoint["shards"]] == [1000, 1003, 1006, 1009, 1012]
    for k, shard in enumerate(checkpoint["shards"]):
        expected = encode_shard(shard_dict([sample(i) for i in range(3 * k, min(3 * k + 3, 14))], LAYERS), compress)
        assert (out / shard["filename"]).read_bytes() == expected.data
    assert max(held) <= 10 * 3 * SAMPLE_BYTES
    report = writer.stats.snapshot()
    assert report["activations_gb"] == pytest.approx(14 * SAMPLE_BYTES / 1e9, abs=1e-4)
    assert report["in_flight_shards"] == 0 and report["in_flight_gb"] == 0


def test_the_budget_bounds_what_is_held(tmp_path):
    """Two shards of budget: whenever a sample is added, what the store path holds (the filling
    shard and those not yet written) stays within it, plus the sample that fills a shard."""
    writer, out, stored = writer_for(tmp_path, shards_of=4, budget_shards=2, threads=1)
    for i in range(40):
        writer.add(sample(i))
        assert writer._held + writer._buffer_bytes <= 2 * 4 * SAMPLE_BYTES + SAMPLE_BYTES
    writer.finalize()
    writer.close()
    assert stored == list(range(1, 11))


def test_a_failed_write_stops_every_later_commit_and_reaches_the_forward(tmp_path):
    writer, out, stored = writer_for(tmp_path, shards_of=2, budget_shards=100)
    for i in range(4):
        writer.add(sample(i))
    writer.wait()
    assert stored == [1, 2]
    shutil.rmtree(out)  # the disk goes away: the next shard cannot be written
    with pytest.raises(OSError):
        for i in range(4, 12):
            writer.add(sample(i))
        writer.finalize()
        writer.wait()
    writer.close()  # raises nothing more: the failure was reported once
    assert stored == [1, 2]


def test_uploads_verify_by_crc32c_and_a_mismatch_is_refused(tmp_path, gcs):
    store = GcsStore("acts", "run/machine_000")
    writer, out, stored = writer_for(tmp_path, shards_of=2, budget_shards=100, store=store)
    for i in range(9):
        writer.add(sample(i))
    writer.finalize()
    writer.close()
    assert stored == [1, 2, 3, 4, 5]
    bucket = gcs.client().bucket("acts")
    for shard in json.loads((out / "checkpoint.json").read_text())["shards"]:
        local = (out / shard["filename"]).read_bytes()
        assert bucket.blob(f"run/machine_000/{shard['filename']}").download_as_bytes() == local
        assert shard["gcs_path"] == f"gs://acts/run/machine_000/{shard['filename']}"
    assert writer.stats.snapshot()["uploaded_gb"] > 0
    name = "shard_0001.pkl.gz"
    size = (out / name).stat().st_size
    assert store.verify(name, size, crc32c=crc32c((out / name).read_bytes()))
    with pytest.raises(StorageError, match="did not verify"):
        store.verify(name, size, crc32c=crc32c((out / "shard_0002.pkl.gz").read_bytes()))


def crc32c(data: bytes) -> str:
    checksum = Crc32c()
    checksum.update(data)
    return checksum.base64()


def test_the_runner_process_asks_glibc_for_one_malloc_arena():
    from host.allocator import one_malloc_arena
    assert one_malloc_arena()  # glibc's mallopt accepted it (this machine runs glibc, as TPU VMs do)


@pytest.mark.parametrize("compress", [True, False])
def test_shards_written_side_by_side_store_the_bytes_of_one_write_thread_and_commit_in_order(tmp_path, compress):
    """One write thread held a GPU's raw output to 1.7 GB/s; shards are now written several at
    once, each file by one thread: the same files, committed in stream order."""
    files, orders = [], []
    for threads in (1, 3):
        shutil.rmtree(tmp_path / "machine_000", ignore_errors=True)  # the same path: the indexes name it
        writer, out, stored = writer_for(tmp_path, shards_of=2, budget_shards=10, compress=compress,
                                         write_threads=threads)
        for i in range(11):
            writer.add(sample(i))
        writer.finalize()
        writer.close()
        assert writer.stats.snapshot()["write_threads"] == threads
        orders.append(stored)
        files.append({p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("shard_*"))})
    assert orders == [[1, 2, 3, 4, 5, 6]] * 2
    assert files[0] == files[1] and len(files[0]) == 6 * 5  # a shard and its four index files, each


def test_statistics_off_stores_no_statistics_and_a_sample_without_them_is_refused(tmp_path):
    writer, out, _ = writer_for(tmp_path / "off", shards_of=2, budget_shards=10, statistics=False)
    for i in range(3):
        writer.add({k: v for k, v in sample(i).items() if k != "statistics"})
    writer.finalize()
    writer.close()
    assert sorted(p.name for p in (out / "index").iterdir()) == [
        f"shard_{k:04d}{suffix}.parquet" for k in (1, 2) for suffix in ("", "_arrays", "_tokens")]
    writer, out, _ = writer_for(tmp_path / "on", shards_of=2, budget_shards=10)
    with pytest.raises(ValueError, match="sample 1000 comes without statistics"):
        writer.add({k: v for k, v in sample(0).items() if k != "statistics"})
    writer.close()


def test_the_rates_are_told_three_shards_after_the_first(tmp_path, capsys):
    writer, out, _ = writer_for(tmp_path, shards_of=2, budget_shards=10)
    for i in range(2 * (RATE_SHARDS + 1) - 1):
        writer.add(sample(i))
    assert "the store path took" not in capsys.readouterr().out
    writer.add(sample(99))  # hands over shard RATE_SHARDS + 1
    writer.close()
    told = capsys.readouterr().out.splitlines()
    assert len(told) == 1 and told[0].startswith("machine 0: the store path took ") and "gzip shards in" in told[0]


def test_a_forward_waiting_for_the_store_is_told_what_to_store_less_of(tmp_path):
    settings = writer_for(tmp_path, shards_of=2, budget_shards=10)[0].settings
    line, warning = rates_report(settings, elapsed=10.0, waited=5.0, handed=10 * 10**9)
    assert line == (f"machine 0: the store path took 1.000 GB/s of activations (gzip shards in "
                    f"{settings.machine_dir}); the forward waited 50% of the time")
    assert warning == ("the store path is the limit: it took 1.000 GB/s while the forward waited 50% of the time; "
                       "store fewer bytes a token: --activation_dtype bfloat16, fewer layers or sites, a --tokens "
                       "selection")
    # Keeping up: no warning, and the forward's own rate, its waits taken out.
    line, warning = rates_report(settings, elapsed=10.0, waited=1.0, handed=9 * 10**9)
    assert warning is None and line.endswith("the forward waited 10% of the time and produces 1.000 GB/s")


def test_segments_are_written_in_order_through_short_writes(tmp_path, monkeypatch):
    """``write_segments`` goes on where a ``writev`` stopped, inside a segment or between two."""
    import host.writer
    segments = [b"opcodes", memoryview(np.arange(10, dtype=np.float32)).cast("B"), b"", b"x" * 3, b"end"]
    writev = os.writev
    monkeypatch.setattr(host.writer.os, "writev", lambda fd, views: writev(fd, [bytes(b"".join(views)[:5])]))
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    assert host.writer.write_segments(fd, segments) == sum(len(s) for s in segments)
    os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"".join(segments)


KILLS = 16  # kill -9 trials of each mode, gzip and raw


def kill_trial_records() -> list[dict]:
    """A stream for the kill trials: samples of 40-64 rows (one statistics compile), every 9th
    record a rejection (``rejected.jsonl``)."""
    rng = np.random.default_rng(7)
    return [{"sample_id": 1000 + i, "reason": "too long"} if i % 9 == 8 else sample(i, int(rng.integers(40, 65)))
            for i in range(40)]


def store_stream(out, records: list[dict], compress: bool) -> None:
    """What the runner does around its ShardWriter (host/run.py): resume from the checkpoint on the
    disk (orphans and temporary files removed, rejected lines cut back to it), store the records
    after it, close, and mark the checkpoint completed."""
    checkpoint = load_checkpoint(str(out / CHECKPOINT_FILE)) or Checkpoint()
    remove_orphans(str(out), None, checkpoint.total_shards)
    rejected = RejectedLog(str(out), None)
    rejected.load(checkpoint.total_skipped)
    settings = ShardSettings(0, str(out), 5 * SAMPLE_BYTES, compress, LAYERS, HIDDEN, "float32", False, 1,
                             {"run": "test"}, memory_budget_bytes=20 * SAMPLE_BYTES, compression_threads=2,
                             write_threads=2)
    writer = ShardWriter(settings, checkpoint, None, rejected, stats=StoreStats())
    try:
        for record in records[checkpoint.total_samples_processed:]:
            writer.skip(record) if "reason" in record else writer.add(record)
        writer.finalize()
    finally:
        writer.close()
    checkpoint.status = COMPLETED
    writer.write_state()


FORKS = multiprocessing.get_context("forkserver")
# What the children run, imported once in the server (not __main__, pytest's), and pandas, which
# pyarrow's pa.table imports on its first call (seconds, a child's whole run otherwise).
FORKS.set_forkserver_preload([__name__, "pandas"])


def in_a_child(run, args: tuple, kill_after: float | None = None) -> bool:
    """Runs ``run(*args)`` in a child process, SIGKILLed ``kill_after`` seconds after its start
    (None: never); True if the kill ended it, False if it ended first (then it must have succeeded).
    The children fork from a small server process (``forkserver``), not from this one: forking a
    test worker that holds models costs ~0.5 s a child here (its page tables), more than a trial."""
    child = FORKS.Process(target=run, args=args)
    child.start()
    child.join(kill_after if kill_after is not None else 120)
    killed = child.is_alive()
    if killed:
        assert kill_after is not None, "the child did not end in 120 s"
        child.kill()
        child.join()
    assert killed or child.exitcode == 0, "the child failed (its traceback above)"
    return killed


def stored_files(out) -> dict[str, bytes]:
    """Every file of a machine directory, the checkpoint and metadata without their time stamps."""
    files = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name in ("checkpoint.json", "metadata.json"):
            data = json.dumps([{k: v for k, v in s.items() if k != "stored_at"}
                               for s in json.loads(data)["shards"]]).encode() + data.split(b'"shards"')[0]
        files[path.relative_to(out).as_posix()] = data
    return files


@pytest.mark.parametrize("compress", [True, False], ids=["gzip", "raw"])
def test_kill_9_at_random_moments_then_resume_stores_every_file_byte_identical(tmp_path, compress):
    """Processes storing a stream are SIGKILLed at random moments (in start-up, between shards,
    while members compress, files are written, indexes and checkpoints committed), each resumed by
    the next, up to 3 kills a run: after ``KILLS`` kills, every file of every run (shards, their
    index, arrays, statistics and tokens files, rejected.jsonl, the checkpoint) is byte for byte
    that of an uninterrupted run."""
    records = kill_trial_records()  # (measured in this process: the children only merge them)
    out = tmp_path / "machine_000"  # every run the same path: the indexes name their shards by it

    (out / "index").mkdir(parents=True)
    assert not in_a_child(time.sleep, (0,))  # the server started: the run below is timed alone
    start = time.perf_counter()
    assert not in_a_child(store_stream, (out, records, compress))
    whole = time.perf_counter() - start
    expected = stored_files(out)
    shards = sum(name.startswith("shard_") for name in expected)
    assert shards == 6 and "rejected.jsonl" in expected
    rng = random.Random(69)
    at_kills: list[int] = []  # shards committed when each kill came
    while len(at_kills) < KILLS:
        shutil.rmtree(out)
        (out / "index").mkdir(parents=True)
        kills = len(at_kills)
        for _ in range(3):
            if not in_a_child(store_stream, (out, records, compress), kill_after=rng.uniform(0.0, whole)):
                break  # it stored to the end before the kill
            checkpoint = out / CHECKPOINT_FILE
            at_kills.append(json.loads(checkpoint.read_text())["total_shards"] if checkpoint.exists() else 0)
        else:
            assert not in_a_child(store_stream, (out, records, compress))
        if len(at_kills) > kills:
            assert stored_files(out) == expected, f"a run killed at {at_kills[kills:]} shards"
    assert any(0 < n < shards for n in at_kills), at_kills  # kills landed between the first shard and the last
