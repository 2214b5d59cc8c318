"""What reads a store holding attention patterns and scores (``model.sites.PATTERNS``: a row per
token over the sample's keys, as wide as the sample's heads x tokens) beside fixed-width sites:
the merge keeps the statistics of the fixed-width ones, the readers return the patterns as
stored, and what reads rows of one width (the token loader, the exports, probes, dashboards)
refuses them in one line while reading every fixed-width site. Stored without a model."""

import json
import os

import numpy as np
import pytest

from activations.index import arrays_path, merged_metadata_path, read_parquet, stats_path, store_moments
from activations.reader import iter_activations, read_activation, read_activations
from activations.token_loader import LoaderConfig, TokenLoader
from common.cli import UserError
from features.encoders import parse_neurons
from fixtures.stored_activations import StoredSpec, write_stored

HEADS = 2
SPEC = StoredSpec(num_machines=2, samples_per_machine=4, lengths=(3, 6), hidden_size=8, layers=(0,),
                  sites=("attn.hook_k", "attn.hook_attn_scores", "attn.hook_pattern", "mlp.hook_pre",
                         "hook_resid_post"),
                  kv_heads_width=4, intermediate_size=12, num_heads=HEADS, planted=4.0, shard_size_bytes=1500)
K, SCORES, PATTERN, PRE = ("blocks.0.attn.hook_k", "blocks.0.attn.hook_attn_scores", "blocks.0.attn.hook_pattern",
                           "blocks.0.mlp.hook_pre")
FIXED = {K: 4, PRE: 12, 0: 8}
WHY = r"its rows are each token's \[heads, keys\] flattened, n_heads x the sample's tokens wide"


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return write_stored(str(tmp_path_factory.mktemp("patterns")), SPEC)


def test_the_merge_keeps_the_statistics_of_the_fixed_width_sites(index):
    coverage = json.loads(open(merged_metadata_path(index)).read())["statistics"]
    assert coverage == {"machines": [0, 1], "without": [], "mismatch": None}
    assert os.path.exists(stats_path(index))
    moments = store_moments(index, list(FIXED))
    counts = read_parquet(index, columns=["num_tokens"])["num_tokens"].to_pylist()
    assert {key: m.count for key, m in moments.items()} == dict.fromkeys(FIXED, sum(counts))
    with pytest.raises(UserError, match=r"^blocks.0.attn.hook_pattern: no statistics are measured of "
                                        r"attn.hook_pattern"):
        store_moments(index, [0, PATTERN])


def test_the_readers_return_patterns_as_stored(index):
    ids = read_parquet(index, columns=["sample_id"])["sample_id"].to_pylist()
    arrays = read_activations(arrays_path(index), ids, [SCORES, PATTERN, 0])
    for sample_id in ids:
        n = len(arrays[sample_id, 0])
        scores, pattern = (arrays[sample_id, key].reshape(n, HEADS, n) for key in (SCORES, PATTERN))
        future = np.triu(np.ones((n, n), bool), 1)[:, None, :]
        assert np.isneginf(scores[np.broadcast_to(future, scores.shape)]).all() and np.isfinite(scores[:, :, 0]).all()
        np.testing.assert_allclose(pattern.sum(-1), 1, rtol=1e-5)
    row = read_parquet(arrays_path(index)).to_pandas().query("site == 'attn.hook_pattern'").iloc[0].to_dict()
    assert np.array_equal(read_activation(row), arrays[row["sample_id"], PATTERN])
    (sample_id, whole), = iter_activations(index, [ids[-1]], PATTERN)
    assert np.array_equal(whole, arrays[sample_id, PATTERN])


def test_the_token_loader_reads_every_fixed_width_site_and_refuses_a_pattern(index):
    batch = next(iter(TokenLoader(LoaderConfig(index=index, layers=tuple(FIXED), seed=None, batch_tokens=1000,
                                               normalize="standardize"))))
    assert {key: values.shape[1] for key, values in batch.activations.items()} == FIXED
    for key in (PATTERN, SCORES):
        with pytest.raises(UserError, match=rf"^{key}: {WHY} \(a width per sample\), not the one width"):
            TokenLoader(LoaderConfig(index=index, layers=(PRE, key)))


def test_exports_probes_and_dashboards_refuse_a_pattern_in_one_line(index, tmp_path):
    from pipeline.export import ExportConfig
    from probing.run import ProbeConfig
    for form in ("flat", "saelens"):
        with pytest.raises(UserError, match=rf"^--sites attn.hook_pattern: {WHY}"):
            ExportConfig(format=form, index=index, layers=(0,), sites=("mlp.hook_pre", "attn.hook_pattern"),
                         output_dir=str(tmp_path / form)).validate()
    with pytest.raises(UserError, match=rf"^--sites attn.hook_attn_scores: {WHY}"):
        ProbeConfig(index=index, label="label", layers=(0,), sites=("attn.hook_attn_scores",),
                    output_dir=str(tmp_path / "probe"), chart=False).validate()
    with pytest.raises(UserError, match=rf"^neurons:attn.hook_pattern:0:0-3: {WHY}"):
        parse_neurons("neurons:attn.hook_pattern:0:0-3")


def test_probes_and_neuron_dashboards_read_any_fixed_width_site(index, tmp_path):
    from pipeline.dashboard import DashboardConfig, feature_logits, plan
    from probing.rows import read_rows
    rows = read_rows(index, [K, PRE], "label", "sample_id", None, None, 0)
    assert {key: values.shape[1] for key, values in rows.features.items()} == {K: 4, PRE: 12}
    for site, width in (("mlp.hook_pre", 12), ("attn.hook_k", 4)):
        spec = f"neurons:{site}:0:1-2"
        features, summarized, job, loader = plan(DashboardConfig(index=index, features=spec,
                                                                 output_dir=str(tmp_path / site)))
        assert (job.key, job.numbers, loader.stored.width[job.key]) == (f"blocks.0.{site}", (1, 2), width)
        assert feature_logits(summarized, summarized.decoder, job.key, None) == (None, None)  # not the stream's space
