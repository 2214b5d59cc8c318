"""``features.encoders``: SAELens SAEs (ReLU, JumpReLU, TopK with and without decoder-norm
rescaling) and transcoders loaded from what SAELens' ``save_model`` writes, encoding as SAELens'
own ``encode`` does; a directions file's directions and raw neurons as features; refusals in one line."""

import numpy as np
import pytest

from activations.directions import write_directions
from common.cli import UserError
from features.encoders import direction_features, load_features, neuron_features, parse_neurons, sae_features

D_IN, D_SAE = 12, 40


def saved_sae(tmp_path, architecture: str, **extra):
    """A SAELens SAE of ``architecture`` with random weights (biases and thresholds too), saved."""
    import sae_lens
    import torch
    from sae_lens.saes.sae import SAEMetadata
    classes = {"standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
               "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig),
               "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
               "transcoder": (sae_lens.Transcoder, sae_lens.TranscoderConfig)}
    cls, cfg_cls = classes[architecture]
    cfg = cfg_cls(d_in=D_IN, d_sae=D_SAE, metadata=SAEMetadata(hook_name="blocks.3.hook_resid_post"), **extra)
    sae = cls(cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in sae.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    path = tmp_path / architecture
    sae.save_model(str(path))
    return sae, str(path)


@pytest.mark.parametrize("architecture, extra", [("standard", {}), ("jumprelu", {}), ("topk", {"k": 5}),
                                                 ("topk", {"k": 5, "rescale_acts_by_decoder_norm": True}),
                                                 ("transcoder", {"d_out": 7, "apply_b_dec_to_input": False})])
def test_saelens_saes_encode_as_saelens_does(tmp_path, architecture, extra):
    import torch
    sae, path = saved_sae(tmp_path, architecture, **extra)
    features = load_features(path)
    assert features.key == 3 and features.size == D_SAE
    assert features.decoder.shape == (D_SAE, extra.get("d_out", D_IN))
    rows = np.random.default_rng(1).standard_normal((33, D_IN)).astype(np.float32)
    ours = np.asarray(features.encode(rows))
    with torch.no_grad():
        theirs = sae.encode(torch.from_numpy(rows)).numpy()
    assert ((ours > 0) == (theirs > 0)).all()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    if architecture == "topk":
        assert ((ours > 0).sum(1) <= 5).all() and (ours > 0).sum() > 0


def test_an_sae_without_a_hook_reads_the_key_given_and_refusals_are_one_line(tmp_path):
    import json
    _, path = saved_sae(tmp_path, "standard")
    assert sae_features(path, "blocks.3.hook_resid_post").key == 3
    with pytest.raises(UserError, match="reads blocks.3.hook_resid_post, not 5"):
        sae_features(path, 5)
    cfg_path = tmp_path / "standard" / "cfg.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "metadata": {}}))
    with pytest.raises(UserError, match="names no hook"):
        sae_features(path)
    assert sae_features(path, 7).key == 7
    cfg_path.write_text(json.dumps({**cfg, "normalize_activations": "layer_norm"}))
    with pytest.raises(UserError, match="normalizes its input"):
        sae_features(path)
    cfg_path.write_text(json.dumps({**cfg, "architecture": "gated"}))
    with pytest.raises(UserError, match="a 'gated' SAE"):
        sae_features(path)
    with pytest.raises(UserError, match="not a SAELens SAE directory"):
        sae_features(str(tmp_path))
    with pytest.raises(UserError, match="not a SAELens SAE directory, a directions file"):
        load_features(str(tmp_path / "nothing"))


def test_directions_and_neurons_are_projections_and_dimensions(tmp_path):
    rng = np.random.default_rng(2)
    vectors = {("diff_in_means", 3): rng.standard_normal(D_IN), ("probe", 3): rng.standard_normal(D_IN),
               ("probe", "blocks.3.hook_mlp_out"): rng.standard_normal(D_IN)}
    path = str(tmp_path / "directions.npz")
    write_directions(path, vectors, {"model": "random"})
    rows = rng.standard_normal((9, D_IN)).astype(np.float32)
    features = direction_features(path, 3)
    assert features.key == 3 and features.size == 2
    expected = rows @ np.stack([vectors["diff_in_means", 3], vectors["probe", 3]]).astype(np.float32).T
    np.testing.assert_allclose(np.asarray(features.encode(rows)), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(UserError, match="holds directions at"):
        direction_features(path)
    assert direction_features(path, "blocks.3.hook_mlp_out").size == 1
    assert parse_neurons("neurons:hook_mlp_out:3:0-2,5") == ("blocks.3.hook_mlp_out", [0, 1, 2, 5])
    neurons = load_features("neurons:hook_mlp_out:3:0-2,5", width=D_IN)
    np.testing.assert_array_equal(np.asarray(neurons.encode(rows)), rows[:, [0, 1, 2, 5]])
    np.testing.assert_array_equal(neurons.decoder, np.eye(D_IN, dtype=np.float32)[[0, 1, 2, 5]])
    assert neuron_features("neurons:hook_resid_post:3", D_IN).size == D_IN
    for bad, message in (("neurons:hook_mlp_out:3:40", "past the site's width"),
                         ("neurons:hook_mlp_out:x", "LAYER is a number"), ("neurons:hook_mlp_out", "are named")):
        with pytest.raises(UserError, match=message):
            neuron_features(bad, D_IN)


def plain_top(acts: np.ndarray, sample_ids: np.ndarray, positions: np.ndarray, k: int) -> list[list[tuple]]:
    """Per feature, its k highest (value, sample id, position), ranked by value, then sample id, then position."""
    return [sorted(zip((-acts[:, f]).tolist(), sample_ids.tolist(), positions.tolist()))[:k]
            for f in range(acts.shape[1])]


def test_top_activations_merge_to_the_plain_ranking_however_the_tokens_are_split():
    from features.top_activations import TopActivations, block_top, merged
    rng = np.random.default_rng(3)
    n, features, k = 90, 7, 6
    acts = np.round(rng.standard_normal((n, features)), 1).astype(np.float32)  # many ties
    acts[:, 0] = 0.5  # a feature equal on every token: ranked by (sample id, position) alone
    sample_ids = rng.integers(0, 12, n)
    positions = rng.permutation(n)  # unique (sample, position) pairs
    whole = block_top(acts, sample_ids, positions, k)
    parts = np.array_split(rng.permutation(n), 3)
    blocks = [block_top(acts[p], sample_ids[p], positions[p], k) for p in parts]
    for summary in (whole, merged(merged(blocks[0], blocks[1]), blocks[2]),
                    merged(blocks[2], merged(blocks[1], blocks[0])),
                    merged(TopActivations.empty(features, k), whole)):
        expected = plain_top(acts, sample_ids, positions, k)
        got = [list(zip((-summary.values[f]).tolist(), summary.sample_ids[f].tolist(), summary.positions[f].tolist()))
               for f in range(features)]
        assert got == expected
        assert summary.tokens == n
        np.testing.assert_array_equal(summary.positive, (acts > 0).sum(0))
        np.testing.assert_array_equal(summary.maximum, acts.max(0))
    few = block_top(acts[:4], sample_ids[:4], positions[:4], k)  # fewer tokens than k: the rest unfilled
    assert (few.sample_ids[:, 4:] == -1).all() and np.isinf(few.values[:, 4:]).all()
    rest = block_top(acts[4:], sample_ids[4:], positions[4:], k)
    together = merged(few, rest)
    for name in ("values", "sample_ids", "positions", "positive", "maximum"):
        np.testing.assert_array_equal(getattr(together, name), getattr(whole, name))


def test_a_neuronpedia_batch_is_laid_out_as_saedashboard_writes_it():
    import json
    from features.neuronpedia import (ActivationExample, DashboardFeature, batch_json, batch_sizes, interval_bounds,
                                      top_group_bounds)
    top = ActivationExample(*top_group_bounds(2.34567), ["a", "\u2014b"], [0.12345, 2.34567], 1)
    interval = ActivationExample(*interval_bounds(0.0, 0.46913, 0.8385416), ["c"], [0.0], -1)
    feature = DashboardFeature(feature_index=7, neg_str=["x"], neg_values=[-1.23456], pos_str=["y"], pos_values=[2.5],
                               density=0.1614583, histogram_values=[1.0004], histogram_heights=[3],
                               logits_histogram_heights=[1], logits_histogram_values=[0.5], activations=[top, interval])
    text = batch_json("qwen", 12, "demo", [feature])
    assert not text.endswith("\n") and "\\u2014b" in text  # json.dumps' defaults: ASCII, no indent
    batch = json.loads(text)
    assert list(batch) == ["model_id", "layer", "sae_set", "sae_id_suffix", "features"]
    written = batch["features"][0]
    assert list(written) == [
        "feature_index", "neuron_alignment_indices", "neuron_alignment_values", "neuron_alignment_l1",
        "correlated_neurons_indices", "correlated_neurons_l1", "correlated_neurons_pearson",
        "correlated_features_indices", "correlated_features_l1", "correlated_features_pearson", "neg_str",
        "neg_values", "pos_str", "pos_values", "frac_nonzero", "freq_hist_data_bar_values",
        "freq_hist_data_bar_heights", "logits_hist_data_bar_heights", "logits_hist_data_bar_values",
        "n_prompts_total", "n_tokens_in_prompt", "dataset", "decoder_weights_dist", "activations", "vector"]
    assert written["frac_nonzero"] == 0.16146000000000002 and written["neg_values"] == [-1.235]
    assert written["activations"][0] == {
        "bin_min": -1, "bin_max": 2.346, "bin_contains": -1, "tokens": ["a", "\u2014b"], "values": [0.123, 2.346],
        "qualifying_token_index": 1, "dfa_values": [], "dfa_maxValue": 0, "dfa_targetIndex": -1}
    assert written["activations"][1]["bin_max"] == 0.469 and written["activations"][1]["bin_contains"] == 0.83854
    dead = DashboardFeature(0, [], [], [], [], 0.0, [], [], [], [], [])
    assert json.loads(batch_json("m", 0, "s", [dead]))["features"][0]["frac_nonzero"] == 0
    assert batch_sizes(10, 4) == [4, 3, 3] and batch_sizes(8, 4) == [4, 4]
