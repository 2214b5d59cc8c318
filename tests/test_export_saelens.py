"""``python -m pipeline.export --format saelens`` over stored shards, read back with ``datasets``."""

import json
import os

import numpy as np
import pytest

from activations.index import arrays_path
from fixtures.stored_activations import StoredSpec, stored_tokens, stream_token_ids, write_stored
from pipeline.export import main as export_main
from tests.conftest import run_cli

SPEC = StoredSpec(num_machines=2, samples_per_machine=9, lengths=(5, 50), hidden_size=12, layers=(0, 2),
                  dtype="float16", shard_size_bytes=6_000, vocab_size=200)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    index = write_stored(str(tmp_path_factory.mktemp("stored")), SPEC)
    return index, stored_tokens(index, SPEC.layers)


def export(index, out, *flags):
    try:
        export_main(["--format", "saelens", "--index", index, "--output_dir", str(out), "--no_progress", *flags])
    except SystemExit as e:  # main returns; only argparse's --help exits
        raise AssertionError(e)
    import datasets
    return datasets.load_from_disk(str(out))


def column(ds, name):
    return ds.with_format("numpy")[:][name]


def in_stored_order(arrays, layer):
    """[tokens, hidden] float32: every stored token in sample-id order, then position."""
    return np.concatenate([arrays[(s, l)] for s, l in sorted(arrays) if l == layer]).astype(np.float32)


def test_unshuffled_rows_are_the_stored_tokens_in_order(stored, tmp_path):
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
        assert np.array_equal(exported, in_stored_order(arrays, layer)[:len(ds) * 16])  # float16 -> 32 is exact
    ids = stream_token_ids(os.path.dirname(index))
    flat_ids = [t for s in sorted(ids) for t in ids[s]]
    assert column(ds, "token_ids").reshape(-1).tolist() == flat_ids[:len(ds) * 16]
    info = json.loads((tmp_path / "out" / "activation_export.json").read_text())
    assert info["rows"] == len(ds) and info["dropped_tokens"]["last_partial_row"] == total % 16
    assert info["layers"][0] == {"layer": 0, "hook_name": "blocks.0.hook_resid_post",
                                 "transformer_lens": "blocks.0.hook_resid_post", "hf_hidden_states_index": 1,
                                 "meaning": "output of decoder block 0 (0-based), before the final norm"}
    assert info["layers"][1]["hf_hidden_states_index"] is None  # layer 2 is the last block here
    description = ds.info.description
    for words in ("random", "float16", "blocks.2.hook_resid_post", index, "hidden_states[1]", "stored order"):
        assert words in description


def test_shuffled_rows_hold_each_token_once(stored, tmp_path):
    index, arrays = stored
    ds = export(index, tmp_path / "out", "--layers", "2", "--seed", "5", "--context_size", "8",
                "--exclude_first_positions", "1", "--hook_name", "resid_{layer}")
    rows = column(ds, "resid_2").reshape(-1, 12)
    stored_rows = {a[p].astype(np.float32).tobytes() for (s, l), a in arrays.items() if l == 2
                   for p in range(1, len(a))}
    exported = [r.tobytes() for r in rows]
    assert len(set(exported)) == len(exported) and set(exported) <= stored_rows
    assert len(exported) == len(stored_rows) // 8 * 8
    unshuffled = in_stored_order(arrays, 2)
    assert not np.array_equal(rows, unshuffled[:len(rows)])


def test_max_tokens_and_several_arrow_files(stored, tmp_path):
    index, _ = stored
    ds = export(index, tmp_path / "out", "--layers", "0", "--context_size", "4", "--max_tokens", "203",
                "--max_file_gb", "0.000001")
    assert len(ds) == 50
    files = sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".arrow"))
    assert len(files) > 1 and files[0] == f"data-00000-of-{len(files):05d}.arrow"


def test_cli_errors_are_one_line_and_write_nothing(stored, tmp_path):
    index, _ = stored
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    cases = [
        (["--layers", "0", "--output_dir", str(out)], "exists and is not empty"),
        (["--layers", "0,2", "--hook_name", "acts", "--output_dir", str(tmp_path / "a")], "put {layer} in it"),
        (["--layers", "7", "--output_dir", str(tmp_path / "b")], r"layer\(s\) \[7\] not stored"),
        (["--layers", "0", "--seed", "x", "--output_dir", str(tmp_path / "c")], "--seed takes an integer or none"),
        (["--layers", "0", "--context_size", "100000", "--output_dir", str(tmp_path / "d")],
         "fewer than one row of --context_size 100000"),
    ]
    for flags, message in cases:
        result = run_cli("pipeline.export", "--format", "saelens", "--index", index, *flags)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith("pipeline.export: error:") and "Traceback" not in result.stderr
        import re
        assert re.search(message, lines[-1]), lines[-1]
    assert os.listdir(out) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no partial directory left behind


def test_a_corrupt_shard_stops_the_export_and_leaves_nothing(tmp_path):
    index = write_stored(str(tmp_path / "stored"), SPEC)
    import pyarrow.parquet as pq
    row = [r for r in pq.read_table(arrays_path(index)).to_pylist() if r["layer"] == 0][3]
    with open(row["shard_path"], "r+b") as f:
        f.seek(row["byte_offset"] + row["byte_length"] // 2)
        f.write(b"\xff\xff\xff\xff")
    result = run_cli("pipeline.export", "--format", "saelens", "--index", index, "--layers", "0",
                     "--output_dir", str(tmp_path / "out"), "--seed", "none")
    assert result.returncode == 2 and "corrupt gzip member in" in result.stderr.splitlines()[-1]
    assert sorted(os.listdir(tmp_path)) == ["stored"]
