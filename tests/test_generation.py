"""Greedy generation with the KV cache against transformers' generate(do_sample=False)."""

import jax.numpy as jnp
import pytest

from fixtures.tiny_models import write_checkpoint
from model.generate import Generator
from model.loading import load_model
from fixtures.hf_reference import load_reference, random_sequences

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tied", [True, False])
def test_greedy_tokens_match_transformers(tmp_path, tied):
    import torch
    # A wide initialisation makes the random model's logits peaked, so argmax is well defined.
    path = write_checkpoint(tmp_path / "m", seed=3, initializer_range=0.5, tie_word_embeddings=tied)
    loaded = load_model(path, jnp.float32, with_head=True)
    prompt = random_sequences([19], seed=5)[0]
    ours = Generator(loaded.config, loaded.params, jnp.float32, cache_length=64).generate(prompt, 24)
    reference = load_reference(path).generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert len(ours) == 24
    assert ours == reference[0, len(prompt):].tolist()


def test_stops_at_a_stop_token(tmp_path):
    path = write_checkpoint(tmp_path / "m", seed=3, initializer_range=0.5)
    loaded = load_model(path, jnp.float32, with_head=True)
    generator = Generator(loaded.config, loaded.params, jnp.float32, cache_length=64)
    prompt = random_sequences([7], seed=1)[0]
    free = generator.generate(prompt, 10)
    stopped = generator.generate(prompt, 10, stop_ids=[free[3]])
    assert stopped == free[:free.index(free[3]) + 1]
