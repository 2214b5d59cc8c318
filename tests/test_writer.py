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
from host.writer import ShardSettings, ShardWriter

LAYERS, HIDDEN = (0, 2), 16


def sample(i: int, tokens: int = 64) -> dict:
    rng = np.random.default_rng(i)
    return {"sample_id": 1000 + i, "source": f"s{i}", "text_preview": f"text {i}", "num_tokens": tokens,
            "truncated": False, "original_num_tokens": tokens,
            "activations": {layer: rng.standard_normal((tokens, HIDDEN)).astype(np.float32) for layer in LAYERS}}


SAMPLE_BYTES = 64 * HIDDEN * 4 * len(LAYERS)  # 8 KiB


def writer_for(tmp_path, shards_of: int, budget_shards: float, store=None, threads=2, compress=True):
    out = tmp_path / "machine_000"
    (out / "index").mkdir(parents=True, exist_ok=True)
    settings = ShardSettings(0, str(out), shards_of * SAMPLE_BYTES, compress, LAYERS, HIDDEN, "float32", False, 1,
                             {"run": "test"}, memory_budget_bytes=int(budget_shards * shards_of * SAMPLE_BYTES),
                             compression_threads=threads, upload_threads=3)
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


def test_raw_shards_compute_statistics_on_every_store_thread_and_store_the_same(tmp_path):
    """Raw shards' statistics ran on one thread, which held a GPU's raw output to ~0.6 GB/s; they
    now take --compression_threads threads, merged in sample order: the same bytes."""
    files = []
    for threads in (1, 3):
        writer, out, _ = writer_for(tmp_path / str(threads), shards_of=3, budget_shards=10, threads=threads,
                                    compress=False)
        for i in range(7):
            writer.add(sample(i))
        writer.finalize()
        writer.close()
        assert writer.stats.snapshot()["statistics_threads"] == threads
        assert writer.stats.snapshot()["compression_threads"] == 0
        files.append({p.name: p.read_bytes() for p in sorted((out / "index").glob("*_stats.parquet"))})
    assert files[0] == files[1] and len(files[0]) == 3
