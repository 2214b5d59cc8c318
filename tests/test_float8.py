"""Float8 storage (``--activation_dtype float8_e4m3fn``, ``model.quantize``): the rows quantized on
the device against the float32 rows of the same forward, element by element within e4m3's
rounding bound and with exact scales (two families; every token, a pooled selection; the
statistics of the dequantized rows); a float8 store read back by every reader as the documented
plain read's float32 rows; a kill -9 resume; bad input in one line."""

import dataclasses
import gzip
import json
import pickle

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from activations.index import arrays_path
from activations.reader import iter_activations, load_shard, read_activation, read_activations
from activations.site_stats import sample_moments
from activations.token_loader import LoaderConfig, TokenLoader
from common.cli import UserError
from fixtures.stored_activations import StoredSpec, storage_order, write_stored
from model.extract import Extractor
from model.quantize import Float8Rows, dequantize
from model.sites import EXPERT_INDICES, MLP_OUT, RESID_POST, array_key
from model.statistics import StatisticsSpec
from tests.conftest import assert_statistics_close, gated_runner, run_in_process, wait_for
from tests.test_device_statistics import float64_moments
from tests.test_host import index_rows, stats_files

LENGTHS = (40, 7, 33)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    from fixtures.tiny_models import SMALL_VOCAB, write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("gemma3") / "gemma3", "gemma3", seed=5, vocab_size=SMALL_VOCAB)


def e4m3_half_step(scaled: np.ndarray) -> np.ndarray:
    """Half the distance between neighbouring e4m3 values at ``scaled``: 2^(e - 4) for |x| in
    [2^e, 2^(e+1)) (3 mantissa bits), and below 2^-6 half the subnormal step 2^-9."""
    exponent = np.floor(np.log2(np.maximum(np.abs(scaled), 2.0 ** -6)))
    return 2.0 ** (exponent - 4)


def assert_rounded_to_e4m3(values: np.ndarray, scale: np.ndarray, reference: np.ndarray) -> None:
    """``values`` [n, W] float8 and ``scale`` [n] are ``reference`` [n, W] float32's rows: scales
    exact, every element within half an e4m3 step of its row's scaled value (and the float32
    division's own rounding, 2^-24 relative)."""
    assert values.dtype == ml_dtypes.float8_e4m3fn and scale.dtype == np.float32
    np.testing.assert_array_equal(scale, np.abs(reference).max(axis=1) * np.float32(1 / 448))
    scaled = reference.astype(np.float64) / np.where(scale > 0, scale, 1)[:, None]
    error = np.abs(values.astype(np.float64) - scaled)
    assert (error <= e4m3_half_step(scaled) + 2.0 ** -22 * np.abs(scaled)).all(), error.max()
    assert (np.abs(values.astype(np.float32)).max(axis=1) == 448).all()  # each row's largest lands on e4m3's largest


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_float8_rows_are_the_float32_rows_rounded_on_the_device_with_exact_scales(family, tiny_checkpoints,
                                                                                  gemma3):
    checkpoint = tiny_checkpoints["gqa_tied"] if family == "qwen2" else gemma3
    f32 = Extractor.load(checkpoint, layers=[0, 1], dtype="float32", batch_size_per_device=4, max_seq_length=64,
                         min_bucket=64, devices=jax.devices()[:1], activation_dtype="float32",
                         sites=[MLP_OUT, RESID_POST], statistics=StatisticsSpec())
    f8 = dataclasses.replace(f32, activation_dtype=jnp.float8_e4m3fn)  # the same weights and settings
    rng = np.random.default_rng(3)
    sequences = [rng.integers(1, f32.config.vocab_size, n).tolist() for n in LENGTHS]
    reference = dict(f32.extract(enumerate(sequences)))
    stored = {}
    for i, arrays, measured, scales in f8.extract_measured(enumerate(sequences)):
        assert arrays.keys() == scales.keys() == reference[i].keys()
        for key, values in arrays.items():
            assert values.shape == reference[i][key].shape and scales[key].shape == (LENGTHS[i],)
            assert_rounded_to_e4m3(values, scales[key], reference[i][key])
            # The statistics are of what a reader gets back: the dequantized rows.
            assert_statistics_close(sample_moments(measured[key], key)[key],
                                    float64_moments(dequantize(values, scales[key])))
            stored[i, key] = dequantize(values, scales[key])
    assert len(stored) == len(LENGTHS) * 4
    for i, arrays in f8.extract(enumerate(sequences)):  # extract() gives the dequantized rows
        for key, rows in arrays.items():
            assert rows.dtype == np.float32
            np.testing.assert_array_equal(rows, stored[i, key])


def test_a_pooled_selection_quantizes_the_pooled_row(tiny_checkpoints):
    f32 = Extractor.load(tiny_checkpoints["gqa_tied"], layers=[1], dtype="float32", batch_size_per_device=4,
                         max_seq_length=64, min_bucket=64, devices=jax.devices()[:1], activation_dtype="float32",
                         pool="mean")
    f8 = dataclasses.replace(f32, activation_dtype=jnp.float8_e4m3fn)
    rng = np.random.default_rng(4)
    items = [(i, rng.integers(1, f32.config.vocab_size, n).tolist(), np.arange(n // 2, n, dtype=np.int32))
             for i, n in enumerate(LENGTHS)]
    reference = dict(f32.extract(items))
    for i, arrays, _, scales in f8.extract_measured(items):
        assert arrays[1].shape == (1, f32.config.hidden_size)
        assert_rounded_to_e4m3(arrays[1], scales[1], reference[i][1])


def plain_read(shard_path: str, key, position: int) -> np.ndarray:
    """docs/storage.md's read of a float8 store without this project: pickle, gzip, ml_dtypes."""
    import ml_dtypes  # noqa: F401  (numpy then knows float8_e4m3fn)
    entry = pickle.load(gzip.open(shard_path))[key][position]
    return entry["activation"].astype(np.float32) * entry["scale"][:, None]


@pytest.fixture(scope="module")
def float8_store(tmp_path_factory) -> str:
    """A 2-machine float8 store of two sites at two layers, written by the runner's writer."""
    spec = StoredSpec(dtype="float8_e4m3fn", sites=(MLP_OUT, RESID_POST), hidden_size=24, lengths=(1, 30))
    return write_stored(str(tmp_path_factory.mktemp("float8")), spec)


def test_every_reader_returns_the_plain_reads_float32_rows(float8_store):
    import pandas as pd
    arrays = pd.read_parquet(arrays_path(float8_store))
    keys = [1, 3, array_key(MLP_OUT, 3)]
    expected = {}
    for row in arrays.to_dict("records"):
        key = array_key(row["site"], row["layer"])
        expected[row["sample_id"], key] = plain_read(row["shard_path"], key, row["position"])
        assert row["dtype"] == "float8_e4m3fn" and row["scale_offset"] > row["byte_offset"]
        raw = read_activation(row, dequantize=False)
        assert isinstance(raw, Float8Rows) and raw.values.dtype == ml_dtypes.float8_e4m3fn
        np.testing.assert_array_equal(read_activation(row), expected[row["sample_id"], key])
    ids = sorted({sample for sample, _ in expected})
    read = read_activations(arrays_path(float8_store), ids, keys)
    assert read.keys() == {(i, k) for i in ids for k in keys}
    for pair, rows in read.items():
        assert rows.dtype == np.float32
        np.testing.assert_array_equal(rows, expected[pair])
    raw = read_activations(arrays_path(float8_store), ids[:3], [1], dequantize=False)
    for (sample, key), rows in raw.items():
        np.testing.assert_array_equal(rows.dequantized(), expected[sample, key])
    for sample, rows in iter_activations(float8_store, ids, 3):
        np.testing.assert_array_equal(rows, expected[sample, 3])
    loader = TokenLoader(LoaderConfig(index=float8_store, layers=(3, array_key(MLP_OUT, 3)), seed=None,
                                      batch_tokens=10_000))
    (batch,) = list(loader)
    for key in (3, array_key(MLP_OUT, 3)):
        stacked = np.concatenate([expected[i, key] for i in storage_order(float8_store)])
        np.testing.assert_array_equal(batch.activations[key], stacked)


def test_an_entry_holds_a_byte_a_value_then_its_scales_and_statistics_are_of_the_dequantized_rows(float8_store):
    import pandas as pd
    from activations.index import stats_path
    shard = load_shard(pd.read_parquet(float8_store).shard_path.iloc[0])
    entry = shard[3][0]
    assert list(entry)[:4] == ["sample_idx", "sample_id", "activation", "scale"]  # scales right after the rows
    assert entry["activation"].nbytes == entry["activation"].size  # one byte a value
    stats = pd.read_parquet(stats_path(float8_store))
    rows = np.concatenate(list(read_activations(arrays_path(float8_store),
                                                pd.read_parquet(float8_store).sample_id, [3]).values()))
    mean = np.stack(stats[(stats.layer == 3) & (stats.site == RESID_POST)]["mean"].to_numpy())[0]
    np.testing.assert_allclose(mean, rows.astype(np.float64).mean(0), rtol=1e-5, atol=1e-6)


def test_bad_input_is_one_line(float8_store, tiny_checkpoints, tmp_path):
    import shutil
    import pyarrow.parquet as pq
    with pytest.raises(UserError, match="token loader returns rows of one dtype"):
        TokenLoader(LoaderConfig(index=float8_store, layers=(3,), dtype="float8_e4m3fn"))
    # An arrays index that lost its scales (merged by a pipeline.index from before float8): refused, not read raw.
    index = shutil.copy(float8_store, tmp_path / "index.parquet")
    pq.write_table(pq.read_table(arrays_path(float8_store)).drop_columns(["scale_offset", "scale_length"]),
                   arrays_path(str(index)))
    with pytest.raises(UserError, match="merge the index again"):
        read_activations(arrays_path(str(index)), [0], [3])
    with pytest.raises(UserError, match="merge the index again"):
        TokenLoader(LoaderConfig(index=str(index), layers=(3,)))
    with pytest.raises(UserError, match="pools rows into their mean"):
        read_activations(arrays_path(float8_store), [0], [3], tokens="mean", dequantize=False)
    result = run_in_process("runners.tpu_host", "--machine_id", "0", "--streams_dir", "/nonexistent", "--model_path",
                            tiny_checkpoints["gqa_tied"], "--activation_dtype", "float8_e4m3fn",
                            "--sites", f"{RESID_POST},{EXPERT_INDICES}")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        f"--activation_dtype float8_e4m3fn: {EXPERT_INDICES} holds expert ids, which are never quantized; store "
        "them with another --activation_dtype, or leave them out of --sites"), result.stderr


@pytest.mark.slow
def test_a_float8_run_killed_and_resumed_stores_what_an_uninterrupted_one_stores(arc_streams, tiny_checkpoints,
                                                                                 tmp_path):
    def args(out):
        return ["--machine_id", "0", "--streams_dir", str(arc_streams), "--model_path", tiny_checkpoints["gqa_tied"],
                "--output_dir", str(out), "--shard_size_gb", "0.00005", "--batch_size", "2", "--max_seq_length",
                "160", "--dtype", "float32", "--activation_dtype", "float8_e4m3fn", "--store_memory_gb", "0.00008"]
    whole = run_in_process("runners.tpu_host", *args(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    killed = tmp_path / "killed" / "machine_000"
    proc = gated_runner(args(tmp_path / "killed"), killed, tmp_path / "gate")  # held at its first shard
    checkpoint = killed / "checkpoint.json"
    def stored_a_shard_or_ended():
        return proc.poll() is not None or (checkpoint.exists() and json.loads(checkpoint.read_text())["total_shards"])
    wait_for(stored_a_shard_or_ended, what="the first shard checkpointed")
    assert proc.poll() is None, proc.communicate()
    proc.kill()
    proc.communicate()
    resumed = run_in_process("runners.tpu_host", *args(tmp_path / "killed"))
    assert resumed.returncode == 0 and "resuming after" in resumed.stderr, resumed.stderr
    expected = tmp_path / "whole" / "machine_000"
    names = sorted(p.name for p in expected.glob("shard_*"))
    assert len(names) > 2 and names == sorted(p.name for p in killed.glob("shard_*"))
    for name in names:
        assert (killed / name).read_bytes() == (expected / name).read_bytes(), name
    assert index_rows(killed) == index_rows(expected) and stats_files(killed) == stats_files(expected)


def plain_rows(index: str, key) -> dict[int, np.ndarray]:
    """{sample_id: rows} of ``key`` by the documented plain read, shard by shard."""
    import pandas as pd
    frame = pd.read_parquet(index)
    return {int(row.sample_id): plain_read(row.shard_path, key, int(row.position)) for row in frame.itertuples()}


def test_the_exports_hold_the_plain_reads_rows_and_saelens_loads_them(float8_store, tmp_path):
    from activations.flat_layout import FlatExport
    from pipeline.export import main as export_main
    from tests.test_saelens import activations_store, one_epoch
    expected = plain_rows(float8_store, 3)
    assert export_main(["--format", "flat", "--index", float8_store, "--layers", "3", "--seed", "3",
                        "--output_dir", str(tmp_path / "flat")]) == 0
    flat = FlatExport(str(tmp_path / "flat"))
    for shard in range(len(flat.shards)):
        provenance = flat.provenance(shard).to_pydict()
        truth = np.stack([expected[s][p] for s, p in zip(provenance["sample_id"], provenance["position"])])
        values = flat.array(shard, "blocks.3.hook_resid_post")
        assert values.dtype == np.float32
        np.testing.assert_array_equal(values, truth)
    assert export_main(["--format", "saelens", "--index", float8_store, "--layers", "3", "--seed", "none",
                        "--context_size", "8", "--output_dir", str(tmp_path / "saelens")]) == 0
    rows, _ = one_epoch(activations_store(str(tmp_path / "saelens"), "blocks.3.hook_resid_post", d_in=24, context=8,
                                          train_batch_size_tokens=8))
    in_order = np.concatenate([expected[s] for s in sorted(expected)])  # unshuffled: by sample id
    np.testing.assert_array_equal(rows, in_order[:len(rows)])
    assert len(rows) == len(in_order) // 8 * 8
