"""Per-sample statistics measured inside the extraction step (``model.statistics``) against float64
ones recomputed from the very arrays the step returns (what the shards store): a dense and a
mixture-of-experts family, float32 and bfloat16 compute, every token and a selection, every row
and each role's rows; counts and expert loads exact. The runner-level checks (merged statistics,
two machines against one, kill -9) are in test_host, test_conversations and test_moe."""

import jax
import numpy as np
import pytest

from activations.site_stats import GroupKey, Moments, sample_moments
from common.roles import ROLES
from model.extract import Extractor
from model.sites import EXPERT_INDICES, MLP_OUT, RESID_MID, RESID_POST, key_parts
from model.statistics import StatisticsSpec
from tests.conftest import assert_statistics_close

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
