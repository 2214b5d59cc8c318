"""The sites inside attention and the MLP (queries, keys, values, QK-norms, rotated queries and
keys, scores, patterns, the output gate, pre-activations, module outputs before a post-norm), at
two blocks of odd configs of nine families: what is stored equals transformers' float64 forward
(``model.params.hf_site``, ``fixtures.hf_reference``) and interp-engine's eager capture of the
same points (``fixtures.interp_engine_reference``) within 1e-5."""

import jax
import numpy as np
import pytest

from fixtures.hf_reference import load_reference, random_sequences, reference_sites, relative_error
from fixtures.interp_engine_reference import interp_engine_points
from fixtures.tiny_models import write_checkpoint
from model.extract import Extractor
from model.families import load_config
from model.sites import ATTN_SCORES, INTERP_ENGINE_POINTS, SITES, array_key, missing_reason

pytestmark = pytest.mark.slow
LENGTHS = (19, 40)  # the second past gpt-oss's sliding window (16)
QWEN3_5_BLOCKS = dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention",
                                   "linear_attention"])
CASES = [("qwen2", (0, 1), {}), ("llama", (0, 2), {}), ("gemma3", (0, 1), {}), ("gemma2", (0, 1), {}),
         ("qwen3", (1, 2), {}), ("olmo2", (0, 1), {}), ("gpt_oss", (0, 1), {}), ("qwen3_moe", (0, 2), {}),
         ("qwen3_5", (1, 3), QWEN3_5_BLOCKS), ("qwen3_5", (0, 2), QWEN3_5_BLOCKS)]  # attention, DeltaNet blocks


def close(ours: np.ndarray, ref: np.ndarray) -> float:
    """The relative error over the finite entries; a masked score (-inf ours; -inf or the dtype's
    minimum theirs) must be masked in both."""
    masked = ~np.isfinite(ours)
    assert np.array_equal(masked, ref < -1e30)
    return relative_error(ours[~masked], ref[~masked])


@pytest.mark.parametrize("family, layers, overrides", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_every_site_equals_transformers_and_interp_engine(tmp_path, family, layers, overrides):
    model_dir = write_checkpoint(tmp_path / family, family, seed=5, **overrides)
    config = load_config(model_dir)
    sites = [site for site in SITES if all(missing_reason(site, config, layer) is None for layer in (None, *layers))]
    sequences = random_sequences(list(LENGTHS), seed=2, vocab=config.vocab_size)
    extractor = Extractor.load(model_dir, layers=layers, dtype="float32", max_seq_length=64, min_bucket=64,
                               batch_size_per_device=2, devices=jax.devices()[:1], sites=sites)
    ours = dict(extractor.extract(enumerate(sequences)))
    places = [(site, layer) for layer in layers for site in sites]
    theirs = reference_sites(load_reference(model_dir, "float64"), sequences, places)
    # interp-engine's q_norm_in and k_norm_in exist only where there is a QK-norm; our q and k everywhere.
    points = {name: site for name, site in INTERP_ENGINE_POINTS.items()
              if site in sites and (config.qk_norm or name not in ("q_norm_in", "k_norm_in"))}
    engine = interp_engine_points(model_dir, sequences, [(name, layer) for layer in layers for name in points])
    for i in range(len(sequences)):
        for site, layer in places:
            stored = ours[i][array_key(site, layer)]
            assert stored.shape == theirs[i][site, layer].shape, (site, layer)
            assert close(stored, theirs[i][site, layer]) <= 1e-5, (site, layer)
        for name, site in points.items():
            for layer in layers:
                assert close(ours[i][array_key(site, layer)], engine[i][name, layer]) <= 1e-5, (name, layer)
    if ATTN_SCORES in sites:  # the sliding window and the sinks as the model applies them
        assert np.isinf(ours[1][array_key(ATTN_SCORES, layers[0])]).any()
