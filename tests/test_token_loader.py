"""The shuffled token loader over stored shards (written by the runner's own ShardWriter)."""

import json
import os
import tracemalloc

import numpy as np
import pytest

from activations.token_buffer import TokenBuffer
from activations.token_loader import LoaderConfig, TokenLoader, row_bytes
from common.cli import UserError
from fixtures.stored_activations import StoredSpec, storage_order, stored_tokens, stream_token_ids, write_stored

SPEC = StoredSpec(num_machines=3, samples_per_machine=10, lengths=(1, 40), hidden_size=16, layers=(1, 3),
                  shard_size_bytes=12_000, vocab_size=50)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    index = write_stored(str(tmp_path_factory.mktemp("stored")), SPEC)
    return index, stored_tokens(index, SPEC.layers)


def all_tokens(arrays):
    return sorted((s, p) for (s, layer), a in arrays.items() if layer == SPEC.layers[0] for p in range(len(a)))


def read_epoch(loader, epoch=0):
    batches = list(loader.batches(epoch))
    order = [(s, p) for b in batches for s, p in zip(b.sample_ids.tolist(), b.positions.tolist())]
    return batches, order


def test_every_token_exactly_once_per_epoch_with_its_own_values(stored):
    index, arrays = stored
    shards = {p for p in os.popen(f"find {os.path.dirname(index)} -name 'shard_*.pkl.gz'").read().split()}
    assert len(shards) >= 3
    loader = TokenLoader(LoaderConfig(index=index, layers=SPEC.layers, batch_tokens=32, buffer_tokens=100,
                                      seed=0, with_token_ids=True))
    ids = stream_token_ids(os.path.dirname(index))
    for epoch in (0, 1):
        batches, order = read_epoch(loader, epoch)
        assert sorted(order) == all_tokens(arrays) and len(set(order)) == len(order)
        assert [len(b) for b in batches[:-1]] == [32] * (len(batches) - 1)
        for b in batches:
            for row, (s, p) in enumerate(zip(b.sample_ids.tolist(), b.positions.tolist())):
                for layer in SPEC.layers:
                    assert np.array_equal(b.activations[layer][row], arrays[(s, layer)][p])
                assert b.token_ids[row] == ids[s][p]
    assert loader.total_tokens == len(order) == loader.stats.tokens_returned // 2


def test_shuffles_across_shards_and_reproducibly(stored):
    index, _ = stored
    # Blocks of about one sample (a block is a run of neighbours in a shard, read at once).
    config = LoaderConfig(index=index, layers=(3,), batch_tokens=32, buffer_tokens=200, seed=7, block_bytes=1500)
    _, first = read_epoch(TokenLoader(config))
    _, again = read_epoch(TokenLoader(config))
    _, other_seed = read_epoch(TokenLoader(LoaderConfig(**{**config.__dict__, "seed": 8})))
    _, next_epoch = read_epoch(TokenLoader(config), epoch=1)
    assert first == again
    assert first != other_seed and first != next_epoch
    # The first batch already mixes many samples, from every machine (sample id mod 3).
    head = first[:32]
    assert len({s for s, _ in head}) >= 8 and {s % 3 for s, _ in head} == {0, 1, 2}


def test_no_seed_is_storage_order_with_one_read_per_shard(stored):
    index, arrays = stored
    loader = TokenLoader(LoaderConfig(index=index, layers=(1,), batch_tokens=50, seed=None))
    batches, order = read_epoch(loader)
    assert order == [(s, p) for s in storage_order(index) for p in range(len(arrays[(s, 1)]))]
    assert all(len(b) == 50 for b in batches[:-1]) and 0 < len(batches[-1]) <= 50
    assert loader.stats.blocks_read == len(loader.stored.shard_paths)  # neighbours read together


def test_a_buffer_of_b_tokens_fills_to_b_and_memory_follows_the_buffer_not_the_data(tmp_path):
    spec = StoredSpec(num_machines=2, samples_per_machine=80, lengths=(100, 400), hidden_size=256,
                      layers=(0, 1), shard_size_bytes=1_000_000)
    index = write_stored(str(tmp_path), spec)
    token_bytes = row_bytes([256, 256], with_token_ids=False)
    peaks = {}
    for buffer_tokens in (1000, 4000):
        loader = TokenLoader(LoaderConfig(index=index, layers=(0, 1), batch_tokens=100, buffer_tokens=buffer_tokens,
                                          seed=0, read_threads=2, read_ahead=2, block_bytes=64 << 10))
        tracemalloc.start()
        tokens = sum(len(b) for b in loader)
        peaks[buffer_tokens] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert tokens == loader.total_tokens and loader.stats.peak_buffered_tokens == buffer_tokens
    data_bytes = loader.total_tokens * token_bytes
    # Besides the buffer: 4 blocks (2 read ahead, the one consumed, the one before it until its name
    # is rebound), each one array per layer past the 64 kB cap (at most 400 x 256 x 4 bytes), held
    # compressed and decoded; a few batches (drawn, and the rows moved into the holes).
    others = 4 * 2 * (2 * 400 * 256 * 4) + 4 * 100 * token_bytes
    assert peaks[1000] < 1000 * token_bytes + others < data_bytes / 8
    # Three thousand more buffered tokens cost their bytes, give or take the blocks in flight.
    assert abs(peaks[4000] - peaks[1000] - 3000 * token_bytes) < others


def test_filters_drop_first_positions_and_token_ids_and_count_them(stored):
    index, arrays = stored
    ids = stream_token_ids(os.path.dirname(index))
    excluded = (0, 1, 2, 3, 4)
    loader = TokenLoader(LoaderConfig(index=index, layers=(1,), batch_tokens=20, buffer_tokens=60, seed=1,
                                      exclude_first_positions=2, exclude_token_ids=excluded, with_token_ids=True))
    batches, order = read_epoch(loader)
    expected = [(s, p) for s, p in all_tokens(arrays) if p >= 2 and ids[s][p] not in excluded]
    assert sorted(order) == expected and loader.total_tokens == len(expected)
    assert not any(np.isin(b.token_ids, excluded).any() for b in batches)
    first = sum(min(2, len(a)) for (s, layer), a in arrays.items() if layer == 1)
    assert loader.stats.dropped == {"selection": 0, "first_positions": first,
                                    "token_ids": len(all_tokens(arrays)) - first - len(expected)}


def test_max_tokens_and_drop_last(stored):
    index, _ = stored
    capped = TokenLoader(LoaderConfig(index=index, layers=(1,), batch_tokens=32, buffer_tokens=64, seed=0,
                                      max_tokens=100))
    assert [len(b) for b in capped] == [32, 32, 32, 4] and capped.total_tokens == 100
    dropping = TokenLoader(LoaderConfig(index=index, layers=(1,), batch_tokens=32, buffer_tokens=64, seed=0,
                                        drop_last=True))
    sizes = [len(b) for b in dropping]
    assert set(sizes) == {32} and sum(sizes) == dropping.total_tokens


def test_arrays_of_one_layer_numpy_or_torch_run_on_across_epochs(stored):
    index, _ = stored
    loader = TokenLoader(LoaderConfig(index=index, layers=(3,), batch_tokens=64, buffer_tokens=128, seed=0,
                                      drop_last=True))
    per_epoch = loader.total_tokens // 64
    one_epoch = list(loader.arrays(epochs=1))
    assert len(one_epoch) == per_epoch and all(isinstance(a, np.ndarray) for a in one_epoch)
    stream = loader.arrays(as_torch=True)
    tensors = [next(stream) for _ in range(per_epoch + 3)]
    assert all(t.shape == (64, SPEC.hidden_size) and str(t.dtype) == "torch.float32" for t in tensors)
    assert all(np.array_equal(a, t.numpy()) for a, t in zip(one_epoch, tensors))  # epoch 0 both times
    with pytest.raises(UserError, match="name the layer"):
        next(TokenLoader(LoaderConfig(index=index, layers=(1, 3))).arrays())


def test_over_gcs(gcs, tmp_path):
    from activations.index import arrays_path
    from common.files import write_bytes
    index = write_stored(str(tmp_path), SPEC, gcs_bucket="acts")
    for path in (index, arrays_path(index), os.path.join(os.path.dirname(index), "merged_metadata.json")):
        write_bytes(f"gs://acts/{os.path.basename(path)}", open(path, "rb").read())
    arrays = stored_tokens(index, (1,))
    loader = TokenLoader(LoaderConfig(index="gs://acts/index.parquet", layers=(1,), batch_tokens=32,
                                      buffer_tokens=96, seed=0))
    assert all(p.startswith("gs://acts/activations/machine_") for p in loader.stored.shard_paths)
    batches, order = read_epoch(loader)
    assert sorted(order) == all_tokens(arrays)
    for b in batches:
        for row, (s, p) in enumerate(zip(b.sample_ids.tolist(), b.positions.tolist())):
            assert np.array_equal(b.activations[1][row], arrays[(s, 1)][p])


@pytest.mark.parametrize("kwargs, message", [
    (dict(layers=(2,)), r"layer 2 not stored under this index \(it has layer 1, layer 3\)"),
    (dict(layers=("blocks.1.hook_mlp_out",)), r"blocks.1.hook_mlp_out not stored under this index \(it has layer 1,"),
    (dict(layers=(1,), batch_tokens=64, buffer_tokens=32), "must hold at least one batch"),
    (dict(layers=(1,), index="/nonexistent/index.parquet"), "no merged index at"),
    (dict(layers=(1,), with_token_ids=True, streams_dir="/nonexistent"), "cannot open stream"),
    (dict(layers=(1, 1)), "named twice"),
    (dict(layers=(1, "blocks.1.hook_resid_post")), "named twice"),
    (dict(layers=("blocks.1.hook_nothing",)), "names no stored array"),
    (dict(layers=(1,), normalize="whiten"), "normalize must be one of none, mean_norm, standardize"),
    (dict(layers=(1,), seed=-1), "seed must be >= 0"),
    (dict(layers=()), "at least one layer"),
])
def test_bad_configurations_are_one_line_errors(stored, kwargs, message):
    with pytest.raises(UserError, match=message):
        TokenLoader(LoaderConfig(**{"index": stored[0], **kwargs}))


def test_shuffle_buffer_draws_each_row_once_and_keeps_columns_aligned():
    rng = np.random.default_rng(0)
    buffer = TokenBuffer(10, {"x": ((2,), np.dtype(np.float32)), "id": ((), np.dtype(np.int64))}, rng)
    out, next_id = [], 0
    while next_id < 40:
        ids = np.arange(next_id, next_id + min(5, buffer.free, 40 - next_id))
        buffer.put({"x": np.stack([ids, -ids], axis=1).astype(np.float32), "id": ids})
        next_id += len(ids)
        while buffer.free == 0:
            out.append(buffer.take(4))
    while buffer.size:
        out.append(buffer.take(min(4, buffer.size)))
    ids = np.concatenate([o["id"] for o in out])
    xs = np.concatenate([o["x"] for o in out])
    assert sorted(ids.tolist()) == list(range(40)) and ids.tolist() != list(range(40))
    assert np.array_equal(xs[:, 0], ids) and np.array_equal(xs[:, 1], -ids)
    assert buffer.peak == 10


def test_arrival_order_buffer_wraps_without_losing_order():
    buffer = TokenBuffer(7, {"id": ((), np.dtype(np.int64))}, None)
    out, next_id = [], 0
    for size in (3, 2, 4, 1, 5, 2, 6, 3):
        while size:
            k = min(size, buffer.free)
            buffer.put({"id": np.arange(next_id, next_id + k)})
            next_id, size = next_id + k, size - k
            if buffer.free == 0:
                out.extend(buffer.take(5)["id"].tolist())
    out.extend(buffer.take(buffer.size)["id"].tolist())
    assert out == list(range(next_id))


def test_token_ids_must_come_from_the_streams_that_run_read(stored, tmp_path):
    index, _ = stored
    source = os.path.join(os.path.dirname(index), "streams")
    for name, edit in (("short", lambda r: {**r, "input_ids": r["input_ids"][:1], "num_tokens": 1}),
                       ("other", lambda r: {**r, "sample_id": r["sample_id"] + 10**6})):
        streams = tmp_path / name
        streams.mkdir()
        for file in os.listdir(source):
            lines = [json.loads(line) for line in open(os.path.join(source, file))]
            lines = [edit(r) if r["num_tokens"] > 1 else r for r in lines]
            (streams / file).write_text("".join(json.dumps(r) + "\n" for r in lines))
        with pytest.raises(UserError, match="not the stream that run read"):
            TokenLoader(LoaderConfig(index=index, layers=(1,), with_token_ids=True, streams_dir=str(streams)))


def test_bfloat16_batches_become_torch_bfloat16_tensors(stored):
    import torch
    index, arrays = stored
    loader = TokenLoader(LoaderConfig(index=index, layers=(3,), batch_tokens=40, seed=None, dtype="bfloat16"))
    tensor = next(loader.arrays(as_torch=True))
    first = storage_order(index)[0]
    expected = torch.from_numpy(arrays[(first, 3)][:40].astype(np.float32)).to(torch.bfloat16)
    assert tensor.dtype == torch.bfloat16 and torch.equal(tensor[:len(expected)], expected)


def test_a_missing_shard_is_a_one_line_error(tmp_path):
    index = write_stored(str(tmp_path), SPEC)
    loader = TokenLoader(LoaderConfig(index=index, layers=(1,), batch_tokens=32, buffer_tokens=64, seed=0))
    os.remove(loader.stored.shard_paths[1])
    with pytest.raises(UserError, match=r"cannot read .*shard_\d{4}\.pkl\.gz \(bytes \d+\.\.\d+\)"):
        list(loader)
