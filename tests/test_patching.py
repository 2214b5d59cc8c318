"""Activation patching (``ablation.patching``): every grid equals TransformerLens's own ``patching``
functions on the same tiny model loaded into both (a GPT-2 and a Llama-style Qwen2); patching every
position of a block's input recovers the clean run, patching nothing gives the corrupted one."""

import numpy as np
import pytest

from ablation.patching import Pair, baselines, clean_values, patching_grid
from model.sites import ATTN_OUT, ATTN_Z, MLP_OUT, RESID_MID, RESID_PRE


@pytest.fixture(scope="module", params=["gpt2", "qwen2"])
def models(request, tmp_path_factory):
    """(ours, TransformerLens's) of one tiny random checkpoint."""
    import jax.numpy as jnp
    from fixtures.tiny_models import write_checkpoint
    from fixtures.transformer_lens_reference import hooked_transformer
    from model.loading import load_model
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, norm_std=0.2)
    return load_model(path, jnp.float32, with_head=True), hooked_transformer(path)


def a_pair(vocab: int) -> Pair:
    rng = np.random.default_rng(0)
    clean = rng.integers(0, vocab, 6)
    corrupted = clean.copy()
    corrupted[[1, 3]] = rng.integers(0, vocab, 2)  # two tokens swapped, as an IOI pair swaps names
    answer, wrong = rng.choice(vocab, 2, replace=False)
    return Pair(tuple(clean.tolist()), tuple(corrupted.tolist()), int(answer), int(wrong))


def test_every_grid_equals_transformer_lens_patching(models):
    import torch
    from transformer_lens import patching
    ours, theirs = models
    pair = a_pair(ours.config.vocab_size)
    clean, corrupted = torch.tensor([pair.clean]), torch.tensor([pair.corrupted])
    _, cache = theirs.run_with_cache(clean)

    def metric(logits):
        return logits[0, -1, pair.answer] - logits[0, -1, pair.wrong]

    for site, function in ((RESID_PRE, patching.get_act_patch_resid_pre), (ATTN_OUT, patching.get_act_patch_attn_out),
                           (MLP_OUT, patching.get_act_patch_mlp_out), (RESID_MID, patching.get_act_patch_resid_mid),
                           (ATTN_Z, patching.get_act_patch_attn_head_out_by_pos)):
        expected = function(theirs, corrupted, cache, metric).double().numpy()
        got = patching_grid(ours, pair, site)
        assert got.shape == expected.shape, site
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(), err_msg=site)


def test_patching_every_position_recovers_the_clean_run_and_nothing_the_corrupted(models):
    import jax.numpy as jnp
    from ablation.patching import _forward, logit_diff
    from model.interventions import add_patch, kept_arrays
    ours, _ = models
    pair = a_pair(ours.config.vocab_size)
    clean_run, corrupted_run = baselines(ours, pair)
    grid = patching_grid(ours, pair, RESID_PRE, normalized=True)
    np.testing.assert_allclose(grid[0, [0, 2, 4, 5]], 0, atol=1e-5)  # tokens the pair shares: nothing changes
    # One program for all three: row 0 patched nowhere, row 1 at every position of block 1's input.
    forward, layers, length = _forward(ours.config, True), ours.config.num_hidden_layers, len(pair.clean)
    arrays = kept_arrays(ours.config, layers)
    values = clean_values(ours, pair.clean, RESID_PRE)  # [L, S, H]
    add_patch(arrays, RESID_PRE, 1, np.stack([values[1], values[1]]), np.array([[False] * length, [True] * length]))
    corrupted, recovered = logit_diff(forward(ours.params, jnp.asarray([pair.corrupted] * 2), arrays)[0], pair)
    clean = logit_diff(forward(ours.params, jnp.asarray([pair.clean] * 2), arrays | {
        k: np.zeros_like(v) for k, v in arrays.items() if k.startswith("patch_tokens")})[0], pair)[0]
    assert abs((recovered - corrupted) / (clean - corrupted) - 1) < 1e-6
    assert abs(corrupted - corrupted_run) < 1e-5 * abs(corrupted_run) and abs(clean - clean_run) < 1e-5 * abs(clean_run)
