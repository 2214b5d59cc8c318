"""``python -m pipeline.export --format saelens`` over stored shards, read back with ``datasets``."""

import json
import os
import pathlib
import shutil

import numpy as np
import pytest

from activations.index import arrays_path
from fixtures.stored_activations import StoredSpec, export_order, stored_tokens, stream_token_ids, write_stored
from pipeline.export import main as export_main
from tests.conftest import run_in_process
from tests.test_stream_reader import split_stream

SPEC = StoredSpec(num_machines=2, samples_per_machine=9, lengths=(5, 50), hidden_size=12, layers=(0, 2),
                  dtype="float16", shard_size_bytes=6_000, vocab_size=200)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    index = write_stored(str(tmp_path_factory.mktemp("stored")), SPEC)
    return index, stored_tokens(index, SPEC.layers)


def export(index, out, *flags):
    try:
        export_main(["--format", "saelens", "--index", index, "--output_dir", str(out), *flags])
    except SystemExit as e:  # main returns; only argparse's --help exits
        raise AssertionError(e) from None
    import datasets
    return datasets.load_from_disk(str(out))


def column(ds, name):
    return ds.with_format("numpy")[:][name]


def in_export_order(index, arrays, layer):
    """[tokens, hidden] float32: every stored token, by sample id, position by position."""
    return np.concatenate([arrays[(s, layer)] for s in export_order(index)]).astype(np.float32)


def test_unshuffled_rows_are_the_stored_tokens_by_sample_id(stored, tmp_path):
    index, arrays = stored
    ds = export(index, tmp_path / "out", "--layers", "0,2", "--seed", "none", "--context_size", "16")
    from datasets import Array2D, Sequence, Value
    assert ds.features["blocks.0.hook_resid_post"] == Array2D(shape=(16, 12), dtype="float32")
    assert ds.features["blocks.2.hook_resid_post"] == Array2D(shape=(16, 12), dtype="float32")
    assert ds.features["token_ids"] == Sequence(Value("int32"), length=16)
    total = sum(len(a) for (s, l), a in arrays.items() if l == 0)
    assert len(ds) == total // 16
    for layer in SPEC.layers:
        exported = column(ds, f"blocks.{layer}.hook_resid_post").reshape(-1, 12)
        assert exported.dtype == np.float32
        assert np.array_equal(exported, in_export_order(index, arrays, layer)[:len(ds) * 16])  # f16 -> f32: exact
    ids = stream_token_ids(os.path.dirname(index))
    flat_ids = [t for s in export_order(index) for t in ids[s]]
    assert column(ds, "token_ids").reshape(-1).tolist() == flat_ids[:len(ds) * 16]
    info = json.loads((tmp_path / "out" / "activation_export.json").read_text())
    assert info["rows"] == len(ds) and info["dropped_tokens"]["last_partial_row"] == total % 16
    assert info["layers"][0] == {"layer": 0, "site": "hook_resid_post", "hook_name": "blocks.0.hook_resid_post",
                                 "transformer_lens": "blocks.0.hook_resid_post", "width": 12,
                                 "hf_hidden_states_index": 1,
                                 "meaning": "output of decoder block 0 (0-based), before the final norm"}
    assert info["layers"][1]["hf_hidden_states_index"] is None  # layer 2 is the last block here
    description = ds.info.description
    for words in ("random", "float16", "blocks.2.hook_resid_post", index, "hidden_states[1]", "sample-id order"):
        assert words in description


def test_shuffled_rows_hold_each_token_once_the_same_token_in_every_column(stored, tmp_path):
    index, arrays = stored
    ds = export(index, tmp_path / "out", "--layers", "0,2", "--seed", "5", "--context_size", "8",
                "--exclude_first_positions", "1", "--hook_name", "resid_{layer:02d}")
    rows = {layer: column(ds, f"resid_{layer:02d}").reshape(-1, 12) for layer in (0, 2)}
    token_ids = column(ds, "token_ids").reshape(-1)
    # Each stored token (after the first position) by its layer-0 bytes.
    where = {a[p].astype(np.float32).tobytes(): (s, p) for (s, l), a in arrays.items() if l == 0
             for p in range(1, len(a))}
    found = [where[r.tobytes()] for r in rows[0]]  # a KeyError: a token that was never stored
    assert len(set(found)) == len(found) == len(where) // 8 * 8
    ids = stream_token_ids(os.path.dirname(index))
    for row, (s, p) in enumerate(found):
        assert np.array_equal(rows[2][row], arrays[(s, 2)][p].astype(np.float32))
        assert token_ids[row] == ids[s][p]
    assert found != sorted(found)


def test_standardized_columns_and_the_statistics_beside_them(stored, tmp_path):
    index, arrays = stored
    ds = export(index, tmp_path / "out", "--layers", "2", "--seed", "none", "--context_size", "8",
                "--normalize", "standardize", "--hook_name", "resid")
    statistics = json.loads((tmp_path / "out" / "statistics.json").read_text())["resid"]
    assert statistics["applied"] == "standardize"
    mean, std = np.array(statistics["mean"], np.float32), np.sqrt(np.array(statistics["variance"])).astype(np.float32)
    exported = column(ds, "resid").reshape(-1, 12)
    truth = in_export_order(index, arrays, 2)[:len(exported)]
    np.testing.assert_allclose(exported, (truth - mean) / std, rtol=1e-5, atol=1e-5)
    assert "after standardize by the store's statistics" in ds.info.description


def test_token_ids_from_streams_in_parts(stored, tmp_path):
    index, _ = stored
    parted = shutil.copytree(os.path.join(os.path.dirname(index), "streams"), tmp_path / "streams")
    for machine in range(SPEC.num_machines):
        split_stream(pathlib.Path(parted), machine, [2, 5])  # no manifest: the parts are listed
    flags = ("--layers", "0", "--seed", "none", "--context_size", "8")
    ds = export(index, tmp_path / "out", *flags, "--streams_dir", str(parted))
    ids = stream_token_ids(os.path.dirname(index))  # from the single files
    flat_ids = [t for s in export_order(index) for t in ids[s]]
    assert column(ds, "token_ids").reshape(-1).tolist() == flat_ids[:len(ds) * 8]


def test_max_tokens_draws_whole_rows_into_arrow_files_each_from_the_whole_store(stored, tmp_path):
    index, arrays = stored
    ds = export(index, tmp_path / "out", "--layers", "0", "--context_size", "4", "--max_tokens", "203",
                "--shard_mb", "0.00075")  # 4 rows of 4 tokens (12 float32 each) a file
    assert len(ds) == 50
    files = sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".arrow"))
    assert len(files) == 13 and files[0] == "data-00000-of-00013.arrow"
    info = json.loads((tmp_path / "out" / "activation_export.json").read_text())
    total = sum(len(a) for (s, l), a in arrays.items() if l == 0)
    assert info["dropped_tokens"] == {"last_partial_row": 3, "max_tokens": total - 203, "selection": 0,
                                      "first_positions": 0, "token_ids": 0}
    where = {a[p].astype(np.float32).tobytes(): s for (s, l), a in arrays.items() if l == 0 for p in range(len(a))}
    samples = [where[r.tobytes()] for r in column(ds, "blocks.0.hook_resid_post").reshape(-1, 12)]
    assert len(set(samples)) > len(arrays) // 4  # a draw from across the store, not its first samples


def test_cli_errors_are_one_line_and_write_nothing(stored, tmp_path):
    index, _ = stored
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    cases = [
        (["--layers", "0", "--output_dir", str(out)], "exists and is not empty"),
        (["--layers", "0", "--output_dir", str(out), "--overwrite"], "holds 'keep.txt', which no saelens export"),
        (["--layers", "0,2", "--hook_name", "acts", "--output_dir", str(tmp_path / "a")], "put {layer} in it"),
        (["--layers", "7", "--output_dir", str(tmp_path / "b")],
         r"layer 7 not stored under this index \(it has layer 0, layer 2\)"),
        (["--layers", "0", "--seed", "x", "--output_dir", str(tmp_path / "c")], "--seed takes an integer >= 0 or none"),
        (["--layers", "0", "--context_size", "100000", "--output_dir", str(tmp_path / "d")],
         "fewer than one row of --context_size 100000"),
        (["--layers", "0", "--seed", "-1", "--output_dir", str(tmp_path / "e")], "--seed takes an integer >= 0"),
        (["--layers", ",", "--output_dir", str(tmp_path / "f")], "--layers must name distinct layers"),
        (["--layers", "0", "--output_dir", "gs://acts"], "give a folder in the bucket, not its root"),
        (["--layers", "0", "--max_tokens", "0", "--output_dir", str(tmp_path / "g")],
         "--max_tokens must be at least 1"),
        (["--layers", "0", "--sites", "mlp.hook_expert_indices", "--output_dir", str(tmp_path / "h")],
         r"--sites mlp.hook_expert_indices: it holds expert ids \(int32\)"),
        (["--layers", "0", "--buffer_gb", "1", "--output_dir", str(tmp_path / "i")],
         "unrecognized arguments: --buffer_gb"),
    ]
    for flags, message in cases:
        result = run_in_process("pipeline.export", "--format", "saelens", "--index", index, *flags)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith("pipeline.export: error:") and "Traceback" not in result.stderr
        import re
        assert re.search(message, lines[-1]), lines[-1]
    assert os.listdir(out) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_corrupt_shard_stops_the_export_unfinished(tmp_path):
    index = write_stored(str(tmp_path / "stored"), SPEC)
    import pyarrow.parquet as pq
    row = [r for r in pq.read_table(arrays_path(index)).to_pylist() if r["layer"] == 0][3]
    with open(row["shard_path"], "r+b") as f:
        f.seek(row["byte_offset"] + row["byte_length"] // 2)
        f.write(b"\xff\xff\xff\xff")
    result = run_in_process("pipeline.export", "--format", "saelens", "--index", index, "--layers", "0",
                            "--output_dir", str(tmp_path / "out"), "--seed", "none")
    last = result.stderr.splitlines()[-1]
    assert result.returncode == 2 and "corrupt gzip member in" in last and "(in the export job;" in last
    assert "Traceback" not in result.stderr and "[while running" not in last
    left = os.listdir(tmp_path / "out") if (tmp_path / "out").exists() else []
    assert "state.json" not in left and "_spill" not in left  # not marked complete; the spill deleted


def test_overwrite_replaces_an_earlier_export_and_nothing_else(stored, tmp_path):
    index, _ = stored
    out = tmp_path / "out"
    out.write_text("a file where the export goes")
    result = run_in_process("pipeline.export", "--format", "saelens", "--index", index, "--layers", "0",
                            "--output_dir", str(out), "--overwrite")
    assert result.returncode == 2 and "is a file, not a directory: not replaced" in result.stderr, result.stderr
    out.unlink()
    export(index, out, "--layers", "0", "--context_size", "4", "--max_tokens", "203", "--shard_mb", "0.00075")
    assert (out / "data-00012-of-00013.arrow").exists()
    export(index, out, "--layers", "2", "--context_size", "8", "--overwrite")
    import datasets
    assert datasets.load_from_disk(str(out)).column_names == ["blocks.2.hook_resid_post", "token_ids"]
    assert not (out / "data-00012-of-00013.arrow").exists()  # none of the earlier files stays
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_an_index_on_gcs(gcs, tmp_path):
    from activations.index import merged_metadata_path
    from common.files import write_bytes
    index = write_stored(str(tmp_path / "stored"), SPEC, gcs_bucket="acts")
    for path in (index, arrays_path(index), merged_metadata_path(index)):
        write_bytes(f"gs://acts/run/{os.path.basename(path)}", open(path, "rb").read())
    ds = export("gs://acts/run/index.parquet", tmp_path / "out", "--layers", "2", "--seed", "none",
                "--context_size", "16")
    arrays = stored_tokens(index, (2,))
    exported = column(ds, "blocks.2.hook_resid_post").reshape(-1, 12)
    assert np.array_equal(exported, in_export_order(index, arrays, 2)[:len(exported)])
