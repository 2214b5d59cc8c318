import concurrent.futures
import gzip
import os
import pickle

import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest

from activations.index import merge_index_files, shard_index, typed_columns, write_index
from activations.reader import UnsafeShardError, load_shard, loads_shard
from activations.shards import (DEFAULT_COMPRESSION_LEVEL, DEFAULT_COMPRESSOR, CompressedArray, encode_shard,
                                gzip_member_compressor, shard_dict, shard_filename, shard_segments,
                                stored_segments)


def samples(n=3, hidden=4, dtype=np.float32):
    rng = np.random.default_rng(0)
    return [{"sample_id": 100 + i, "source": f"t{i}:0", "text_preview": f"prompt {i}", "num_tokens": i + 1,
             "truncated": i == 1, "original_num_tokens": 10 * i + 1,
             "activations": {layer: rng.standard_normal((i + 1, hidden)).astype(dtype) for layer in (2, 5)}}
            for i in range(n)]


def test_shard_layout_and_plain_pickle_gzip_reading(tmp_path):
    shard = shard_dict(samples(), (2, 5))
    path = tmp_path / shard_filename(7)
    path.write_bytes(encode_shard(shard, compress=True).data)
    assert path.name == "shard_0007.pkl.gz"
    loaded = pickle.load(gzip.open(path))
    assert sorted(loaded) == [2, 5]
    for layer in (2, 5):
        assert [e["sample_id"] for e in loaded[layer]] == [100, 101, 102]
        entry = loaded[layer][1]
        assert entry["sample_idx"] == 101 and entry["shape"] == (2, 4) and entry["source"] == "t1:0"
        np.testing.assert_array_equal(entry["activation"], shard[layer][1]["activation"])


def test_bytes_are_deterministic_and_uncompressed_is_plain_pickle():
    shard = shard_dict(samples(), (2, 5))
    assert encode_shard(shard, True).data == encode_shard(shard, True).data
    raw = encode_shard(shard, compress=False).data
    assert pickle.loads(raw)[5][2]["text_preview"] == "prompt 2"


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_restricted_loader_reads_every_activation_dtype(tmp_path, dtype):
    shard = shard_dict(samples(dtype=dtype), (2, 5))
    path = tmp_path / "s.pkl.gz"
    path.write_bytes(encode_shard(shard, True).data)
    loaded = load_shard(str(path))
    assert loaded[2][0]["activation"].dtype == dtype
    np.testing.assert_array_equal(loaded[5][2]["activation"], shard[5][2]["activation"])


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/should_not_exist",))


def test_restricted_loader_refuses_code():
    payload = pickle.dumps({2: [{"activation": Exploit()}]})
    with pytest.raises(UnsafeShardError, match="posix.system|os.system"):
        loads_shard(payload)
    with pytest.raises(UnsafeShardError):
        loads_shard(gzip.compress(payload))


def test_index_rows_and_merge(tmp_path):
    first = shard_index(samples(2), machine_id=1, shard_id=1, shard_path="/x/shard_0001.pkl.gz",
                        layers=(2, 5), hidden_size=4, dtype="float32")
    later = shard_index([{**s, "sample_id": s["sample_id"] - 50} for s in samples(2)], machine_id=0,
                        shard_id=1, shard_path="/y/shard_0001.pkl.gz", layers=(2, 5), hidden_size=4,
                        dtype="float32")
    write_index(first, str(tmp_path / "a.parquet"))
    write_index(later, str(tmp_path / "b.parquet"))
    merged = merge_index_files([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]).to_pylist()
    assert [(r["sample_id"], r["machine_id"], r["position"]) for r in merged] == [
        (50, 0, 0), (51, 0, 1), (100, 1, 0), (101, 1, 1)]
    assert merged[0]["layers"] == [2, 5] and merged[2]["num_tokens"] == 1
    assert [(r["truncated"], r["original_num_tokens"]) for r in merged] == [
        (False, 1), (True, 11), (False, 1), (True, 11)]


def test_indexes_written_before_the_truncation_columns_still_merge(tmp_path):
    current = shard_index(samples(1), machine_id=0, shard_id=2, shard_path="/x/shard_0002.pkl.gz",
                          layers=(2, 5), hidden_size=4, dtype="float32")
    older = current.drop_columns(["truncated", "original_num_tokens"]).set_column(
        0, "sample_id", pa.array([7], pa.int64()))
    write_index(older, str(tmp_path / "old.parquet"))
    write_index(current, str(tmp_path / "new.parquet"))
    merged = merge_index_files([str(tmp_path / "old.parquet"), str(tmp_path / "new.parquet")]).to_pylist()
    assert [(r["sample_id"], r["truncated"], r["original_num_tokens"]) for r in merged] == [
        (7, None, None), (100, False, 1)]


def test_kept_columns_are_typed_columns_of_the_index_even_where_a_shard_has_no_value(tmp_path):
    def shard(shard_id, labels, **kw):
        rows = [{**s, "sample_id": 10 * shard_id + i, "columns": {"label": label, "topic": "t"}}
                for i, (s, label) in enumerate(zip(samples(len(labels)), labels))]
        path = str(tmp_path / f"{shard_id}.parquet")
        write_index(shard_index(rows, 0, shard_id, "/x", (2,), 4, "float32", **kw), path)
        return path
    typed = merge_index_files([shard(1, [None], column_types={"label": "int64"}), shard(2, [3, None])])
    assert typed.schema.field("label").type == pa.int64() and typed["label"].to_pylist() == [None, 3, None]
    assert typed.column_names[-2:] == ["label", "topic"]  # after the index's own columns
    untyped = merge_index_files([shard(3, [None]), shard(4, [None])])  # no manifest said: by the values
    assert untyped.schema.field("label").type == pa.null()
    recorded = typed_columns(untyped, [{"machine_id": 0, "columns": {"label": "float64", "topic": "string"}}])
    assert recorded.schema.field("label").type == pa.float64() and recorded["topic"].to_pylist() == ["t", "t"]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_segments_are_the_standard_pickle_with_the_arrays_not_copied(dtype):
    # Arrays of 1 row (SHORT_BINBYTES, under 256 bytes) and larger (BINBYTES); previews that
    # hold the marker's tag and repeated strings (the pickle memoises them).
    rng = np.random.default_rng(1)
    items = [{"sample_id": i, "source": "t:0", "text_preview": "\x00activation-bytes\x00" * i,
              "activations": {layer: rng.standard_normal((n, 8)).astype(dtype) for layer in (0, 3)}}
             for i, n in enumerate([1, 40, 2, 300])]
    shard = shard_dict(items, (0, 3))
    segments, entries = shard_segments(shard)
    assert b"".join(segments) == pickle.dumps(shard, protocol=3)
    expected = [shard[layer][k]["activation"] for layer in (0, 3) for k in range(4)]  # pickling order
    assert len(entries) == len(expected) and all(e.array is a for e, a in zip(entries, expected))
    for k, entry in enumerate(entries):  # segment 2k + 1 is array k's own memory
        assert np.shares_memory(np.frombuffer(segments[2 * k + 1], np.uint8), entry.array)
    gz = encode_shard(shard, compress=True, threads=3)
    assert gzip.decompress(gz.data) == pickle.dumps(shard, protocol=3)
    assert gz.data == encode_shard(shard, compress=True, threads=1).data
    # Arrays compressed ahead (the host writer's way) give the same file.
    compress = gzip_member_compressor(DEFAULT_COMPRESSOR, DEFAULT_COMPRESSION_LEVEL)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ahead = [{**item, "activations": {layer: CompressedArray.of(a, compress, pool)
                                          for layer, a in item["activations"].items()}} for item in items]
        segments, _ = shard_segments(shard_dict(ahead, (0, 3)))
        assert b"".join(stored_segments(segments, compress, pool)) == gz.data


def test_a_view_of_a_larger_batch_is_stored_without_its_padding():
    batch = np.arange(2 * 3 * 5 * 4, dtype=np.float32).reshape(2, 3, 5, 4)  # [layers, rows, S, H]
    items = [{"sample_id": row, "source": "s", "text_preview": "",
              "activations": {layer: batch[layer, row, :row + 2] for layer in (0, 1)}} for row in range(3)]
    shard = shard_dict(items, (0, 1))
    segments, _ = shard_segments(shard)
    assert np.shares_memory(np.frombuffer(segments[1], np.uint8), batch)
    loaded = pickle.loads(b"".join(segments))
    np.testing.assert_array_equal(loaded[1][2]["activation"], batch[1, 2, :4])
    assert loaded[1][2]["shape"] == (4, 4)
