"""``runners.probe`` on stores with a planted direction (``fixtures.stored_activations``: a binary
label per sample, every token moved along a fixed unit vector by it): the probe and the
diff-in-means find it, the statistics' means are the arrays', the split keeps each group on one
side, a fleet's store probes as one machine's, and bad input is one line."""

import os
import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from activations.index import arrays_path, merged_metadata_path, stats_path, tokens_path
from fixtures.stored_activations import StoredSpec, planted_direction, stored_tokens, write_stored
from activations.directions import read_directions
from probing.directions import label_means
from probing.fit import held_out
from probing.rows import read_rows
from tests.conftest import run_in_process
from tests.test_host_errors import one_line_error

SPEC = StoredSpec(num_machines=2, samples_per_machine=40, lengths=(4, 12), hidden_size=16, layers=(0, 1),
                  planted=4.0, shard_size_bytes=6_000)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A 2-machine planted store, and the same samples stored by one machine."""
    root = tmp_path_factory.mktemp("planted")
    return write_stored(str(root / "fleet"), SPEC), write_stored(str(root / "one"), SPEC, one_machine=True)


def probe(index, out, *flags):
    result = run_in_process("runners.probe", "--index", index, "--label", "label", "--layers", "0,1",
                            "--output_dir", str(out), *flags)
    assert result.returncode == 0, result.stderr
    return pd.read_csv(out / "results.csv"), read_directions(str(out / "directions.npz"))


def cosine(a, b):
    return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))


def test_the_probe_and_the_diff_in_means_find_the_planted_direction(stores, tmp_path):
    index = stores[0]
    table, (arrays, metadata) = probe(index, tmp_path / "out")
    # Two labels 4 apart along one direction in unit noise: the best possible accuracy is Phi(2) = 0.977.
    assert list(table["layer"]) == [0, 1] and (table["metric"] == "accuracy").all()
    assert (table["held_out"] >= 0.93).all() and (table[["baseline", "baseline_rows"]] >= 0.93).all().all(), table
    labels = pd.read_parquet(tmp_path / "out" / "split.parquet").merge(pd.read_parquet(index), on="sample_id")
    held = labels.groupby("sample_id").first()  # every stored token is a row: weigh each sample by its tokens
    rows = labels.set_index("sample_id")["num_tokens"]
    train = held[~held.held_out]
    commonest = (train.label.map(int) * rows[train.index]).sum() * 2 > rows[train.index].sum()
    test = held[held.held_out]
    expected = (rows[test.index] * (test.label == commonest)).sum() / rows[test.index].sum()
    assert table["majority"].eq(table["majority"].iloc[0]).all()
    assert table["majority"].iloc[0] == pytest.approx(expected, abs=1e-6) and 0.3 < expected < 0.7
    assert (table["held_out_rows"] > 0).all() and (table["train_rows"] > 3 * table["held_out_rows"]).all()
    truth = planted_direction(SPEC)
    for layer in (0, 1):
        assert cosine(arrays[f"probe/blocks.{layer}.hook_resid_post"], truth) >= 0.9
        diff = arrays[f"diff_in_means/blocks.{layer}.hook_resid_post"]
        assert cosine(diff, truth) >= 0.9 and 3 <= np.linalg.norm(diff) <= 5  # the planted 4, give or take noise
    described = (metadata["label"], metadata["negative"], metadata["positive"], metadata["model"])
    assert described == ("label", 0, 1, "random")
    assert (metadata["hidden_size"], metadata["num_hidden_layers"]) == (SPEC.hidden_size, 2)
    assert (tmp_path / "out" / "by_layer.png").stat().st_size > 0
    regression, _ = probe(index, tmp_path / "ridge", "--task", "regression")
    assert (regression["metric"] == "r2").all() and (regression["held_out"] >= 0.5).all()


def test_the_statistics_means_are_the_arrays_means(stores):
    index = stores[0]
    labels = dict(zip(*pq.read_table(index, columns=["sample_id", "label"]).to_pydict().values()))
    means = label_means(index, [0, 1], "label", [0, 1])
    stored = stored_tokens(index, [0, 1])
    for layer in (0, 1):
        for value in (0, 1):
            rows = np.concatenate([a for (s, key), a in stored.items() if key == layer and labels[s] == value])
            expected = rows.astype(np.float64).mean(0)
            # Measured per sample in float32 on the device, merged in float64.
            assert np.linalg.norm(means[layer][value] - expected) <= 1e-5 * np.linalg.norm(expected)


def test_the_split_keeps_each_group_on_one_side(stores, tmp_path):
    rows = read_rows(stores[0], [0], "label", "sample_id", None, None, seed=3)
    test = held_out(rows.groups, 0.25, seed=3)
    assert not set(rows.sample_ids[test].tolist()) & set(rows.sample_ids[~test].tolist())
    assert abs(len(set(rows.sample_ids[test].tolist())) - 0.25 * 80) <= 1
    by_machine = read_rows(stores[0], [0], "label", "machine_id", None, None, seed=3)
    test = held_out(by_machine.groups, 0.25, seed=3)  # two groups: one held out, whole
    assert sorted({(g, t) for g, t in zip(by_machine.groups.tolist(), test.tolist())}) in (
        [(0, False), (1, True)], [(0, True), (1, False)])
    probe(stores[0], tmp_path / "out", "--group_column", "machine_id")
    split = pd.read_parquet(tmp_path / "out" / "split.parquet")
    assert split.groupby("group")["held_out"].nunique().eq(1).all() and split["held_out"].nunique() == 2


@pytest.mark.parametrize("flags", [[], ["--max_rows", "300"]])
def test_a_fleet_store_probes_as_one_machine_s(stores, tmp_path, flags):
    fleet, one = (probe(index, tmp_path / name, *flags) for index, name in zip(stores, ("fleet", "one")))
    pd.testing.assert_frame_equal(fleet[0], one[0], check_exact=False, rtol=1e-9)
    (fleet_arrays, _), (one_arrays, _) = fleet[1], one[1]
    assert fleet_arrays.keys() == one_arrays.keys()
    for name, values in fleet_arrays.items():  # the probes exactly; the means to float64 rounding (float32 kept)
        np.testing.assert_allclose(values, one_arrays[name], rtol=1e-6, atol=1e-7, err_msg=name)
    rows = fleet[0]["train_rows"] + fleet[0]["held_out_rows"]
    expected = 300 if flags else sum(len(a) for a in stored_tokens(stores[0], [0]).values())  # a draw, or all
    assert ((rows - expected).abs() <= (60 if flags else 0)).all(), (rows, expected)


def copy_store(index, folder, label_values, statistics=True):
    """The store's index files in ``folder``, its label column replaced by ``label_values``."""
    folder.mkdir()
    for path in (arrays_path(index), merged_metadata_path(index), tokens_path(index),
                 *([stats_path(index)] if statistics else [])):
        if os.path.exists(path):
            shutil.copy(path, folder / os.path.basename(path))
    table = pq.read_table(index)
    values = label_values(table["sample_id"].to_pylist(), table["label"].to_pylist())
    table = table.set_column(table.schema.get_field_index("label"), "label", pa.array(values))
    pq.write_table(table, folder / "index.parquet")
    return str(folder / "index.parquet")


def test_a_text_label_with_nulls_and_a_store_without_statistics(stores, tmp_path):
    index = copy_store(stores[0], tmp_path / "text", statistics=False, label_values=lambda ids, labels: [
        None if i % 10 == 3 else ("yes" if label else "no") for i, label in zip(ids, labels)])
    table, (arrays, metadata) = probe(index, tmp_path / "out")
    nulls = sum(len(a) for (s, _), a in stored_tokens(stores[0], [0]).items() if s % 10 == 3)
    assert (table["null_label_rows"] == nulls).all() and table["baseline"].isna().all()
    assert (table["held_out"] >= 0.9).all() and (table["baseline_rows"] >= 0.9).all()  # the rows' own means
    assert sorted(arrays) == ["probe/blocks.0.hook_resid_post", "probe/blocks.1.hook_resid_post"]  # no statistics
    assert (metadata["negative"], metadata["positive"]) == ("no", "yes")
    assert cosine(arrays["probe/blocks.0.hook_resid_post"], planted_direction(SPEC)) >= 0.9  # toward "yes"


def test_bad_input_is_one_line(stores, tmp_path):
    index = stores[0]
    flags = ["--index", index, "--layers", "0", "--output_dir", str(tmp_path / "x")]
    one_line_error(run_in_process("runners.probe", *flags, "--label", "topic"),
                   "--label topic: ", "runners.probe")
    one_line_error(run_in_process("runners.probe", *flags, "--label", "label", "--group_column", "chat"),
                   "--group_column chat: ", "runners.probe")
    one_line_error(run_in_process("runners.probe", *flags, "--label", "label", "--group_column", "truncated"),
                   "1 group(s) of rows: a held-out split needs at least 2", "runners.probe")
    one_line_error(run_in_process("runners.probe", *flags, "--label", "label", "--seed", "-1"),
                   "--seed must be >= 0", "runners.probe")
    one_line_error(run_in_process("runners.probe", *flags[2:], "--index", str(tmp_path / "none.parquet"),
                                  "--label", "label"), "no index at", "runners.probe")
    constant = copy_store(index, tmp_path / "constant", lambda ids, labels: [1] * len(ids))
    one_line_error(run_in_process("runners.probe", "--index", constant, "--layers", "0", "--label", "label",
                                  "--output_dir", str(tmp_path / "y")), "every row read has the value 1",
                   "runners.probe")
    text = copy_store(index, tmp_path / "text", lambda ids, labels: [str(label) for label in labels])
    one_line_error(run_in_process("runners.probe", "--index", text, "--layers", "0", "--label", "label",
                                  "--task", "regression", "--output_dir", str(tmp_path / "z")),
                   "--task regression needs a numeric label", "runners.probe")
