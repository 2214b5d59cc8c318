"""Greedy generation: stopping at a stop token (tests/test_families.py compares the tokens with
transformers' generate(do_sample=False) for every family)."""

import jax.numpy as jnp
import pytest

from fixtures.hf_reference import random_sequences
from fixtures.tiny_models import SMALL_VOCAB, write_checkpoint
from model.generate import Generator
from model.loading import load_model

pytestmark = pytest.mark.slow


def test_stops_at_a_stop_token(tmp_path):
    path = write_checkpoint(tmp_path / "m", seed=3, initializer_range=0.5, vocab_size=SMALL_VOCAB)
    loaded = load_model(path, jnp.float32, with_head=True)
    generator = Generator(loaded.config, loaded.params, jnp.float32, cache_length=64)
    prompt = random_sequences([7], seed=1, vocab=SMALL_VOCAB)[0]
    free = generator.generate(prompt, 10)
    stopped = generator.generate(prompt, 10, stop_ids=[free[3]])
    assert stopped == free[:free.index(free[3]) + 1]
