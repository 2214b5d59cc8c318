"""The store path (host/writer.py) on synthetic samples: several shards in flight, in order, within
the memory budget, byte-identical to the in-memory encoding; a failure stops later commits."""

import json
import shutil

import numpy as np
import pytest

from activations.shards import encode_shard, shard_dict
from host.checkpoint import Checkpoint
from host.rejected import RejectedLog
from host.storage import Crc32c, GcsStore, StorageError
from host.store_stats import StoreStats
from host.writer import RATE_SHARDS, ShardSettings, ShardWriter, rates_report
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
