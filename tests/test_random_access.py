"""Random access to single activations inside standard pickle.gz shards."""

import gzip
import pickle
import random

import ml_dtypes
import numpy as np
import pytest

import activations.reader as reader
from activations.index import arrays_index, write_index
from activations.reader import CorruptShardError, read_activation, read_activations
from activations.shards import encode_shard, shard_dict

LENGTHS = [3, 3000, 1, 4000, 17, 250, 2]


def make_samples(dtype=np.float32, hidden=64, lengths=LENGTHS):
    rng = np.random.default_rng(7)
    return [{"sample_id": 1000 + i, "source": f"t{i}", "text_preview": "p" * i, "num_tokens": n,
             "activations": {layer: rng.standard_normal((n, hidden)).astype(dtype) for layer in (0, 6, 12)}}
            for i, n in enumerate(lengths)]


def write_shard(tmp_path, compress, dtype=np.float32, name=None):
    shard = shard_dict(make_samples(dtype), (0, 6, 12))
    encoded = encode_shard(shard, compress)
    data, locations = encoded.data, encoded.locations
    path = tmp_path / (name or ("shard_0001.pkl.gz" if compress else "shard_0001.pkl"))
    path.write_bytes(data)
    return shard, path, arrays_index(locations, str(path)).to_pandas()


def assert_same_document(a, b):
    assert sorted(a) == sorted(b)
    for layer in a:
        assert len(a[layer]) == len(b[layer])
        for x, y in zip(a[layer], b[layer]):
            assert sorted(x) == sorted(y)
            for key in x:
                if key == "activation":
                    assert x[key].dtype == y[key].dtype and np.array_equal(x[key], y[key])
                else:
                    assert x[key] == y[key]


def test_plain_readers_get_the_same_dict_as_an_old_style_shard(tmp_path):
    shard, path, _ = write_shard(tmp_path, compress=True)
    old_style = tmp_path / "old.pkl.gz"
    old_style.write_bytes(gzip.compress(pickle.dumps(shard, protocol=4)))
    assert_same_document(pickle.load(gzip.open(path)), pickle.load(gzip.open(old_style)))
    assert_same_document(pickle.load(gzip.open(path)), shard)


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_random_pairs_through_the_index_equal_the_loaded_shard(tmp_path, compress, dtype):
    _, path, index = write_shard(tmp_path, compress, dtype)
    loaded = pickle.load(gzip.open(path)) if compress else pickle.load(open(path, "rb"))
    rows = index.to_dict("records")
    for row in random.Random(0).sample(rows, 12) + [r for r in rows if r["shape"][0] in (3, 3000)]:
        array = read_activation(row)
        expected = loaded[row["layer"]][row["position"]]["activation"]
        assert array.dtype == expected.dtype and array.tobytes() == expected.tobytes()


def test_batched_reads_coalesce_ranges_of_a_shard(tmp_path, monkeypatch):
    _, path, index = write_shard(tmp_path, compress=True)
    calls = []
    real = reader.read_range
    monkeypatch.setattr(reader, "read_range", lambda *a: calls.append(a) or real(*a))
    got = read_activations(index, [1000, 1002, 1004, 1006], layers=[0, 12])
    assert sorted(got) == [(i, l) for i in (1000, 1002, 1004, 1006) for l in (0, 12)]
    assert len(calls) < len(got)
    for (sample_id, layer), array in got.items():
        row = index[(index.sample_id == sample_id) & (index.layer == layer)].iloc[0].to_dict()
        assert np.array_equal(array, read_activation(row))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_or_truncated_shard_names_shard_and_offset(tmp_path, damage):
    _, path, index = write_shard(tmp_path, compress=True)
    row = index[index["shape"].map(lambda s: s[0]) == 3000].iloc[0].to_dict()
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[row["byte_offset"] + row["byte_length"] // 2] ^= 0xFF
    else:
        data = data[:row["byte_offset"] + row["byte_length"] // 2]
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=rf"{path.name} at byte {row['byte_offset']}"):
        read_activation(row)


@pytest.mark.slow
@pytest.mark.parametrize("compress", [True, False])
def test_gcs_ranged_reads(tmp_path, gcs, compress):
    shard, path, _ = write_shard(tmp_path, compress=compress)
    encoded = encode_shard(shard, compress)
    data, locations = encoded.data, encoded.locations
    url = f"gs://acts/m/{path.name}"
    gcs.client().bucket("acts").blob(f"m/{path.name}").upload_from_string(data)
    index = arrays_index(locations, url).to_pandas()
    write_index(arrays_index(locations, url), str(tmp_path / "i.parquet"))
    rows = index.to_dict("records")
    for row in random.Random(1).sample(rows, 6):
        assert read_activation(row).tobytes() == shard[row["layer"]][row["position"]]["activation"].tobytes()
    got = read_activations(str(tmp_path / "i.parquet"), [1001, 1003], [6])
    assert got[(1003, 6)].shape == (4000, 64)
