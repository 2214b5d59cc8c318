"""What reads stored activation sites (``model.sites``) besides block outputs: the token loader by
key and normalised by the stored statistics, the SAELens export of any site, the paired export a
transcoder trains on, and ``runners.train_sae --target_hook_name``. Stored without a model."""

import json
import os
import re
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from activations.index import arrays_path, merged_metadata_path, read_parquet, stats_path
from activations.site_stats import Moments, table_moments
from activations.token_loader import LoaderConfig, TokenLoader
from common.cli import UserError
from fixtures.stored_activations import (StoredSpec, export_order, storage_order, stored_tokens, stream_token_ids,
                                        write_stored)
from tests.conftest import assert_statistics_close, run_in_process
from tests.test_export_saelens import column, export, in_export_order
from tests.test_saelens import activations_store, one_epoch

Z, LN2, MLP_OUT = "blocks.1.attn.hook_z", "blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out"
SPEC = StoredSpec(num_machines=2, samples_per_machine=6, lengths=(5, 30), hidden_size=8, layers=(1,),
                  sites=("attn.hook_z", "ln2.hook_normalized", "hook_mlp_out", "hook_resid_post"),
                  heads_width=12, linked=("ln2.hook_normalized", "hook_mlp_out"), shard_size_bytes=6_000,
                  vocab_size=100)
WIDTHS = {Z: 12, LN2: 8, MLP_OUT: 8, 1: 8}


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    index = write_stored(str(tmp_path_factory.mktemp("stored")), SPEC)
    return index, stored_tokens(index, SPEC.keys)


def copied_index(index, folder, arrays=lambda table: table, stats=True):
    """The merged index's files in ``folder`` (the same shards), its arrays table through ``arrays``."""
    os.makedirs(folder, exist_ok=True)
    copy = os.path.join(folder, "index.parquet")
    shutil.copy(index, copy)
    shutil.copy(merged_metadata_path(index), merged_metadata_path(copy))
    pq.write_table(arrays(pq.read_table(arrays_path(index))), arrays_path(copy))
    if stats:
        shutil.copy(stats_path(index), stats_path(copy))
    return copy


def test_the_loader_reads_sites_of_different_widths_together(stored):
    index, arrays = stored
    keys = (Z, MLP_OUT, "blocks.1.hook_resid_post")  # the last is key 1
    loader = TokenLoader(LoaderConfig(index=index, layers=keys, batch_tokens=16, buffer_tokens=48, seed=2))
    assert loader.stored.width == {Z: 12, MLP_OUT: 8, 1: 8}
    order = []
    for batch in loader:
        assert list(batch.activations) == [Z, MLP_OUT, 1]
        for row, (s, p) in enumerate(zip(batch.sample_ids.tolist(), batch.positions.tolist())):
            for key, values in batch.activations.items():
                assert values.shape == (len(batch), WIDTHS[key])
                assert np.array_equal(values[row], arrays[(s, key)][p])
            order.append((s, p))
    assert sorted(order) == sorted((s, p) for (s, k), a in arrays.items() if k == 1 for p in range(len(a)))
    first = next(loader.arrays(layer="blocks.1.hook_resid_post", epochs=1))
    assert np.array_equal(first, next(iter(loader)).activations[1])
    with pytest.raises(UserError, match=r"blocks.3.attn.hook_z is not among the loaded keys \(blocks.1.attn"):
        next(loader.arrays(layer="blocks.3.attn.hook_z"))


def test_an_arrays_index_without_a_site_column_holds_block_outputs(stored, tmp_path):
    index, arrays = stored
    old = copied_index(index, tmp_path, lambda t: t.filter(np.array(t["site"].to_pylist()) == "hook_resid_post")
                       .drop_columns(["site"]))
    batch = next(iter(TokenLoader(LoaderConfig(index=old, layers=(1,), batch_tokens=1000, seed=None))))
    assert np.array_equal(batch.activations[1], np.concatenate([arrays[(s, 1)] for s in storage_order(index)]))
    with pytest.raises(UserError, match=r"blocks.1.hook_mlp_out not stored under this index \(it has layer 1\)"):
        TokenLoader(LoaderConfig(index=old, layers=(MLP_OUT,)))


def recomputed(arrays, key) -> Moments:
    tokens = np.concatenate([a for (_, k), a in arrays.items() if k == key]).astype(np.float64)
    return Moments(len(tokens), tokens.mean(0), tokens.var(0) * len(tokens), np.linalg.norm(tokens, axis=1).mean())


@pytest.mark.parametrize("how", ["mean_norm", "standardize"])
def test_normalized_batches_follow_the_stored_statistics(stored, how):
    index, arrays = stored
    keys = (Z, MLP_OUT, 1)
    ours = table_moments(read_parquet(stats_path(index)))
    for key in keys:
        assert_statistics_close(ours[key], recomputed(arrays, key))
    config = LoaderConfig(index=index, layers=keys, batch_tokens=1000, seed=None)
    raw = next(iter(TokenLoader(config))).activations
    scaled = next(iter(TokenLoader(LoaderConfig(**{**config.__dict__, "normalize": how})))).activations
    for key in keys:
        m = recomputed(arrays, key)
        width = raw[key].shape[1]
        formula = (raw[key] * np.sqrt(width) / m.mean_norm if how == "mean_norm" else
                   (raw[key] - m.mean) / np.sqrt(m.variance))
        assert scaled[key].dtype == np.float32
        np.testing.assert_allclose(scaled[key], formula, rtol=1e-5, atol=1e-5)


def test_normalizing_without_statistics_is_a_one_line_error(stored, tmp_path):
    index, _ = stored
    bare = copied_index(index, tmp_path, stats=False)
    with pytest.raises(UserError, match="no statistics at .*: merge the index again with pipeline.index"):
        TokenLoader(LoaderConfig(index=bare, layers=(1,), normalize="mean_norm"))


@pytest.mark.parametrize("key", [Z, MLP_OUT])
def test_activations_store_reads_a_site_export_as_stored(stored, tmp_path, key):
    index, arrays = stored
    site = key.split(".", 2)[2]
    ds = export(index, tmp_path / "out", "--sites", site, "--layers", "1", "--seed", "none", "--context_size", "8")
    from datasets import Array2D
    assert ds.column_names == [key, "token_ids"]
    assert ds.features[key] == Array2D(shape=(8, WIDTHS[key]), dtype="float32")
    got, ids = one_epoch(activations_store(str(tmp_path / "out"), key, d_in=WIDTHS[key], context=8,
                                           train_batch_size_tokens=8))
    expected = in_export_order(index, arrays, key)
    assert len(got) == len(expected) // 8 * 8 and np.array_equal(got, expected[:len(got)])
    flat_ids = [t for s in export_order(index) for t in stream_token_ids(os.path.dirname(index))[s]]
    assert ids.tolist() == flat_ids[:len(got)]
    info = json.loads((tmp_path / "out" / "activation_export.json").read_text())
    from model.sites import SITES
    assert info["layers"] == [{"layer": 1, "site": site, "hook_name": key, "transformer_lens": key,
                               "width": WIDTHS[key], "meaning": SITES[site].meaning}]
    assert f"{site} of block 1 -> column {key} (TransformerLens {key}, width {WIDTHS[key]}" in ds.info.description


def test_the_paired_export_holds_both_sites_of_the_same_tokens_in_each_row(stored, tmp_path):
    index, arrays = stored
    ds = export(index, tmp_path / "out", "--sites", "hook_mlp_out,ln2.hook_normalized", "--layers", "1",
                "--seed", "3", "--context_size", "8")
    assert ds.column_names == [LN2, MLP_OUT, "token_ids"]
    inputs, outputs = (column(ds, name).reshape(-1, 8) for name in (LN2, MLP_OUT))
    token_ids = column(ds, "token_ids").reshape(-1)
    where = {a[p].tobytes(): (s, p) for (s, k), a in arrays.items() if k == LN2 for p in range(len(a))}
    found = [where[row.tobytes()] for row in inputs]  # a KeyError: an input that was never stored
    assert len(set(found)) == len(found) == len(where) // 8 * 8
    ids = stream_token_ids(os.path.dirname(index))
    for row, (s, p) in enumerate(found):
        assert np.array_equal(outputs[row], arrays[(s, MLP_OUT)][p]) and token_ids[row] == ids[s][p]
    from activations.saelens_export import column_names
    with pytest.raises(UserError, match=r"names blocks.1.ln2.hook_normalized and blocks.1.hook_mlp_out alike"):
        column_names([LN2, MLP_OUT], "blocks.{layer}.x")


def test_train_sae_trains_a_transcoder_on_the_paired_export(stored, tmp_path):
    from sae_lens import SAE, Transcoder
    index, _ = stored
    export(index, tmp_path / "pair", "--sites", "ln2.hook_normalized,hook_mlp_out", "--layers", "1",
           "--context_size", "8")
    result = run_in_process("runners.train_sae", "--export_dir", str(tmp_path / "pair"), "--target_hook_name",
                            MLP_OUT, "--steps", "80", "--batch_tokens", "32", "--log_every", "20",
                            "--dead_window", "20", "--lr", "1e-2", "--l1_coefficient", "1e-3",
                            "--output_dir", str(tmp_path / "transcoder"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    curve = [float(re.search(r"loss +([\d.]+)", line).group(1)) for line in lines if line.startswith("step")]
    assert len(curve) == 4 and curve[-1] < 0.2 * curve[0], curve
    assert lines[-1].startswith("runners.train_sae: 80 steps of 32 tokens, transcoder, 32 latents:"), lines[-1]
    loaded = SAE.load_from_disk(str(tmp_path / "transcoder"))
    assert isinstance(loaded, Transcoder) and (loaded.cfg.d_in, loaded.cfg.d_out) == (8, 8)
    assert (loaded.cfg.metadata.hook_name, loaded.cfg.metadata.hook_name_out) == (LN2, MLP_OUT)
