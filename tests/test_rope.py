"""RoPE frequencies against transformers' own (``modeling_rope_utils.ROPE_INIT_FUNCTIONS``), and a
model whose RoPE is YaRN against transformers' forward past its original context."""

import jax
import numpy as np
import pytest

from fixtures.hf_reference import load_reference, random_sequences, reference_activations, relative_error
from model.families import config_from_dict, load_config
from model.rope import inverse_frequencies

YARN = dict(rope_type="yarn", rope_theta=50_000.0, factor=4.0, original_max_position_embeddings=64)


@pytest.mark.parametrize("params", [
    YARN,
    dict(YARN, truncate=False, beta_fast=16.0, beta_slow=2.0),     # gpt-oss's untruncated ramp
    dict(YARN, mscale=0.707, mscale_all_dim=0.707),                # DeepSeek's: the factors cancel
    dict(YARN, mscale=1.0, mscale_all_dim=0.5),
    dict(YARN, attention_factor=1.25),
])
def test_yarn_frequencies_and_attention_factor_equal_transformers(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=256, rope_parameters=dict(params))
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = config_from_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    np.testing.assert_allclose(np.asarray(inverse_frequencies(ours.rope_dim, ours.rope)), theirs.numpy(),
                               rtol=2e-7)
    assert ours.rope.attention_factor == pytest.approx(factor, rel=1e-12)
    assert ours.rope_dim == len(theirs) * 2


def test_a_yarn_model_equals_transformers_past_its_original_context(tmp_path):
    """A tiny Llama whose RoPE is YaRN (x4 over 64 positions; cos and sin x 1.139): every block on
    prompts of 150 and 90 tokens padded in one batch, float32 against transformers' float64."""
    from fixtures.tiny_models import write_checkpoint
    from model.extract import Extractor
    checkpoint = write_checkpoint(tmp_path / "llama_yarn", "llama", seed=3, rope_parameters=dict(YARN))
    assert load_config(checkpoint).rope.kind == "yarn"
    sequences = random_sequences([150, 90], seed=2, vocab=load_config(checkpoint).vocab_size)
    reference = reference_activations(load_reference(checkpoint, "float64"), sequences)
    extractor = Extractor.load(checkpoint, dtype="float32", max_seq_length=160, min_bucket=160,
                               batch_size_per_device=2, devices=jax.devices()[:1])
    out = dict(extractor.extract(enumerate(sequences)))
    for i, expected in enumerate(reference):
        for layer in expected:
            assert relative_error(out[i][layer], expected[layer]) <= 1e-5, (i, layer)
