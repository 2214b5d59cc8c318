"""Per-sample statistics measured inside the extraction step (``model.statistics``) against float64
ones recomputed from the very arrays the step returns (what the shards store): a dense and a
mixture-of-experts family, float32 and bfloat16 compute, every token and a selection, every row
and each role's rows; counts and expert loads exact. The runner-level checks (merged statistics,
two machines against one, kill -9) are in test_host, test_conversations and test_moe.

And what a store whose machines kept statistics and ran with ``--statistics off`` gives its
readers: a 2-machine store written without a model (``fixtures.stored_activations``), merged by
``pipeline.index``; nothing normalizes by the statistics of part of it."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from activations.directions import read_directions
from activations.index import merge_stats_files, merged_metadata_path, read_parquet, stats_path, write_index
from activations.site_stats import GroupKey, Moments, sample_moments
from activations.token_loader import LoaderConfig, TokenLoader
from common.cli import UserError
from common.roles import ROLES
from fixtures.stored_activations import StoredSpec, stored_tokens, write_stored
from model.extract import Extractor
from model.sites import EXPERT_INDICES, MLP_OUT, RESID_MID, RESID_POST, key_parts
from model.statistics import StatisticsSpec
from tests.conftest import assert_statistics_close, run_in_process
from tests.test_host_errors import one_line_error

LENGTHS = (29, 64, 7, 50)  # padded rows and padded tokens in one batch of 4


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> str:
    from fixtures.tiny_models import SMALL_VOCAB, write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("moe") / "qwen2_moe", "qwen2_moe", seed=3, vocab_size=SMALL_VOCAB)


def float64_moments(rows: np.ndarray, experts: int = 0) -> Moments:
    """The reference: moments of ``rows`` [n, width] in float64 (expert ids counted per expert)."""
    x = rows.astype(np.float64)
    counts = np.bincount(rows.reshape(-1), minlength=experts).astype(np.int64) if experts else None
    if not len(x):
        return Moments(0, np.zeros(x.shape[1]), np.zeros(x.shape[1]), 0.0, counts)
    return Moments(len(x), x.mean(0), ((x - x.mean(0)) ** 2).sum(0), float(np.linalg.norm(x, axis=1).mean()), counts)


@pytest.mark.slow  # a model's whole extraction step, compiled
@pytest.mark.parametrize("family,dtype", [("dense", "float32"), ("dense", "bfloat16"), ("moe", "float32"),
                                          ("moe", "bfloat16")])
def test_measured_statistics_equal_float64_ones_of_the_stored_arrays(family, dtype, tiny_checkpoints,
                                                                    moe_checkpoint):
    checkpoint = tiny_checkpoints["gqa_tied"] if family == "dense" else moe_checkpoint
    sites = [RESID_MID, MLP_OUT, RESID_POST] + ([EXPERT_INDICES] if family == "moe" else [])
    extractor = Extractor.load(checkpoint, layers=[0, 2], dtype=dtype, batch_size_per_device=4, max_seq_length=64,
                               min_bucket=64, devices=jax.devices()[:1], activation_dtype=dtype, sites=sites,
                               statistics=StatisticsSpec(by_role=True))
    experts = extractor.config.num_experts
    assert extractor.statistics.experts == experts and (experts > 0) == (family == "moe")
    rng = np.random.default_rng(7)
    every, selection = [], []  # a batch either selects or keeps every token
    for i, n in enumerate(LENGTHS):
        ids = rng.integers(1, extractor.config.vocab_size, n).tolist()
        roles = rng.integers(0, len(ROLES) - 2, n).astype(np.int32)  # several roles a sample, some absent
        selected = np.sort(rng.choice(n, size=max(1, n // 3), replace=False)).astype(np.int32)
        every.append((i, ids, None, None, roles))
        selection.append((i, ids, selected, None, roles))
    checked = 0
    for items in (every, selection):
        for i, arrays, measured, _ in extractor.extract_measured(items):
            _, _, positions, _, roles = items[i]
            check_sample(arrays, measured, roles if positions is None else roles[positions], experts, dtype)
            checked += len(arrays)
    assert checked == 2 * len(LENGTHS) * len(sites) * 2


def check_sample(arrays: dict, measured: dict, row_roles: np.ndarray, experts: int, dtype: str) -> None:
    """One sample's measured statistics, overall and per role of its rows, against float64 ones of
    its arrays."""
    for key, array in arrays.items():
        integer = key_parts(key)[0] == EXPERT_INDICES
        assert array.dtype == (np.int32 if integer else np.dtype(dtype))
        expected = {key: float64_moments(array, experts if integer else 0)}
        expected.update({GroupKey(key, "role", ROLES[code]): float64_moments(array[row_roles == code],
                                                                          experts if integer else 0)
                         for code in np.unique(row_roles).tolist()})
        ours = sample_moments(measured[key], key)
        assert ours.keys() == expected.keys()
        for group, moments in expected.items():
            assert_statistics_close(ours[group], moments)
            assert (ours[group].expert_counts is None) == (not integer)


@pytest.mark.slow  # a model's whole extraction step, compiled
def test_pooled_rows_are_measured_as_stored(tiny_checkpoints):
    """A mean selection stores one row a sample: its statistics are that row's (one count; a
    sample that selects nothing has none)."""
    extractor = Extractor.load(tiny_checkpoints["gqa_tied"], layers=[1], dtype="float32", max_seq_length=32,
                               min_bucket=32, devices=jax.devices()[:1], pool="mean", statistics=StatisticsSpec())
    items = [(0, list(range(1, 20)), np.array([3, 4, 9], np.int32)), (1, list(range(5, 30)), np.zeros(0, np.int32))]
    for key, arrays, measured, _ in extractor.extract_measured(items):
        row = arrays[1]
        got = sample_moments(measured[1], 1)[1]
        assert got.count == len(row) == (1 if key == 0 else 0)
        if len(row):
            assert_statistics_close(got, float64_moments(row))
        else:
            assert not got.mean.any() and not got.m2.any() and got.mean_norm == 0


def test_a_resume_keeps_the_statistics_setting_and_older_output_had_them():
    from model.run_settings import changed_settings
    assert changed_settings({"layers_to_extract": [0]}, {"statistics": "device"}) == []  # from before the flag
    assert changed_settings({"statistics": "off"}, {"statistics": "device"}) == ["--statistics 'off' -> 'device'"]


STORE = StoredSpec(num_machines=2, samples_per_machine=6, lengths=(2, 10), hidden_size=8, layers=(0,),
                   planted=4.0, shard_size_bytes=1_500)  # a label kept (statistics by it); 2+ shards a machine
PARTIAL = ("the statistics are of part of the store (machine 0: --statistics device; machine 1: --statistics off), "
           "so nothing normalizes by them: rerun machine 1 with --statistics device (replacing its output) and "
           "merge again with pipeline.index")
NONE = ("the store has no statistics (stored with --statistics off, or before statistics existed): rerun with "
        "--statistics device to get them")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A 2-machine store, every shard with its statistics, merged: its root."""
    root = tmp_path_factory.mktemp("store")
    write_stored(str(root), STORE)
    return str(root)


def without_statistics(root: str, folder, machines: list[int], names: tuple[str, ...] = ()) -> tuple[str, str]:
    """A copy of the store's machines, ``machines`` as a run with ``--statistics off`` leaves them (no
    statistics files, ``metadata.json`` saying off), merged by ``pipeline.index`` into the index
    path it returns (with the merge's log), where a merge of the whole store wrote its statistics before.
    ``names``: the machines' folders renamed so (as runs given their own --gcs_prefix name them)."""
    activations = str(shutil.copytree(os.path.join(root, "activations"), folder / "activations"))
    index = str(folder / "index.parquet")
    assert run_in_process("pipeline.index", "--activations_dir", activations, "--output", index).returncode == 0
    assert os.path.exists(stats_path(index))
    for machine in range(STORE.num_machines):
        machine_dir = os.path.join(activations, f"machine_{machine:03d}")
        with open(os.path.join(machine_dir, "metadata.json")) as f:
            metadata = json.load(f)
        metadata["statistics"] = "off" if machine in machines else "device"
        with open(os.path.join(machine_dir, "metadata.json"), "w") as f:
            json.dump(metadata, f)
        if machine in machines:
            for name in os.listdir(os.path.join(machine_dir, "index")):
                if name.endswith("_stats.parquet"):
                    os.remove(os.path.join(machine_dir, "index", name))
    for machine, name in enumerate(names):
        os.rename(os.path.join(activations, f"machine_{machine:03d}"), os.path.join(activations, name))
    merged = run_in_process("pipeline.index", "--activations_dir", activations, "--output", index)
    assert merged.returncode == 0, merged.stderr
    return index, merged.stderr


def test_a_whole_store_normalizes_by_the_mean_norm_of_every_stored_token(store):
    index = os.path.join(store, "index.parquet")
    with open(merged_metadata_path(index)) as f:
        assert json.load(f)["statistics"] == {"machines": [0, 1], "without": [], "mismatch": None}
    rows = np.concatenate(list(stored_tokens(index, [0]).values())).astype(np.float64)  # [tokens, 8]
    factor = np.sqrt(STORE.hidden_size) / np.linalg.norm(rows, axis=1).mean()
    loader = TokenLoader(LoaderConfig(index=index, layers=(0,), batch_tokens=len(rows), normalize="mean_norm"))
    batch = next(iter(loader))
    expected = {(s, p): rows_of[p] * factor for (s, _), rows_of in stored_tokens(index, [0]).items()
                for p in range(len(rows_of))}
    for row, (s, p) in enumerate(zip(batch.sample_ids.tolist(), batch.positions.tolist())):
        np.testing.assert_allclose(batch.activations[0][row], expected[s, p], rtol=1e-5)


def test_statistics_of_one_machine_of_two_are_written_for_no_reader(store, tmp_path):
    index, merge_log = without_statistics(store, tmp_path, [1])
    assert [line.split(" ", 2)[2] for line in merge_log.splitlines()] == [  # the time stamp cut
        f"WARNING activations.index: no {stats_path(index)}: {PARTIAL}"]
    assert not os.path.exists(stats_path(index))  # the earlier merge's, of every shard: gone
    with pytest.raises(UserError) as refused:
        TokenLoader(LoaderConfig(index=index, layers=(0,), normalize="mean_norm"))
    assert str(refused.value) == f"{index!r}: {PARTIAL}"
    exported = run_in_process("pipeline.export", "--format", "flat", "--index", index, "--layers", "0",
                              "--normalize", "standardize", "--output_dir", str(tmp_path / "export"))
    one_line_error(exported, f"{index!r}: {PARTIAL}", "pipeline.export")
    probed = run_in_process("runners.probe", "--index", index, "--label", "label", "--layers", "0", "--no_chart",
                            "--output_dir", str(tmp_path / "probe"))
    assert probed.returncode == 0, probed.stderr
    assert f"no diff-in-means baseline: {index!r}: {PARTIAL}" in probed.stderr
    arrays, _ = read_directions(str(tmp_path / "probe" / "directions.npz"))
    assert sorted(arrays) == ["probe/blocks.0.hook_resid_post"]  # no diff-in-means of machine 0's tokens alone


def test_machines_are_named_by_their_rows_whatever_their_folders(store, tmp_path):
    index, merge_log = without_statistics(store, tmp_path, [1], names=("run-a", "run-b"))
    assert [line.split(" ", 2)[2] for line in merge_log.splitlines()] == [
        f"WARNING activations.index: no {stats_path(index)}: {PARTIAL}"]
    with open(merged_metadata_path(index)) as f:
        assert json.load(f)["statistics"] == {"machines": [0], "without": [1], "mismatch": None}


def test_a_store_without_statistics_says_how_to_get_them(store, tmp_path):
    index, _ = without_statistics(store, tmp_path, [0, 1])
    assert not os.path.exists(stats_path(index))
    with pytest.raises(UserError) as refused:
        TokenLoader(LoaderConfig(index=index, layers=(0,), normalize="standardize"))
    assert str(refused.value) == f"{index!r}: {NONE}"


def test_an_index_merged_before_the_coverage_was_recorded_is_checked_by_its_counts(store, tmp_path):
    """As an earlier merge left a partial store: the statistics of machine 0's shards alone and no
    coverage record. Their counts against the stored rows refuse them; a whole store's pass."""
    index, _ = without_statistics(store, tmp_path, [1])
    machine_0 = tmp_path / "activations" / "machine_000" / "index"
    write_index(merge_stats_files([str(p) for p in machine_0.glob("*_stats.parquet")]), stats_path(index))
    with open(merged_metadata_path(index)) as f:
        metadata = json.load(f)
    del metadata["statistics"]
    with open(merged_metadata_path(index), "w") as f:
        json.dump(metadata, f)
    machines = read_parquet(index, columns=["sample_id", "machine_id"]).to_pandas().set_index("sample_id").machine_id
    tokens = {s: len(rows) for (s, _), rows in stored_tokens(index, [0]).items()}
    on_0 = sum(n for s, n in tokens.items() if machines[s] == 0)
    with pytest.raises(UserError) as refused:
        TokenLoader(LoaderConfig(index=index, layers=(0,), normalize="mean_norm"))
    assert str(refused.value).startswith(f"{index!r}: the statistics count other rows than the store holds (layer 0: "
                                         f"statistics of {on_0} rows, {sum(tokens.values())} stored)")
    whole = str(tmp_path / "whole")
    shutil.copytree(store, whole)
    with open(merged_metadata_path(os.path.join(whole, "index.parquet"))) as f:
        metadata = json.load(f)
    del metadata["statistics"]
    with open(merged_metadata_path(os.path.join(whole, "index.parquet")), "w") as f:
        json.dump(metadata, f)
    TokenLoader(LoaderConfig(index=os.path.join(whole, "index.parquet"), layers=(0,), normalize="mean_norm"))
