"""Decoding on the device: stopping at a stop token, batches equal single prompts, sampled draws
that depend on the seed and the sample alone (tests/test_families.py compares greedy tokens with
transformers' generate(do_sample=False) for every family)."""

import jax
import jax.numpy as jnp
import pytest

from fixtures.hf_reference import random_sequences
from fixtures.tiny_models import SMALL_VOCAB, write_checkpoint
from model.generate import LENGTH, STOP_TOKEN, Generator, Sampling
from model.loading import load_model

pytestmark = pytest.mark.slow
SAMPLED = Sampling(temperature=0.8, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # A sliding window of 16 shorter than the prompts: each row's window moves with its own position.
    return write_checkpoint(tmp_path_factory.mktemp("gen") / "m", family="mistral", seed=3, initializer_range=0.5)


def generator_on(path, **mesh):
    loaded = load_model(path, jnp.float32, with_head=True, **mesh)
    return Generator(loaded.config, loaded.params, jnp.float32, cache_length=96, mesh=loaded.mesh)


@pytest.fixture(scope="module")
def generator(checkpoint):
    return generator_on(checkpoint, devices=jax.devices()[:1])


def test_stops_at_a_stop_token(generator):
    prompt = random_sequences([7], seed=1, vocab=SMALL_VOCAB)[0]
    free = generator.generate(prompt, 10)
    stopped = generator.generate(prompt, 10, stop_ids=[free[3]])
    assert stopped == free[:free.index(free[3]) + 1]


def test_a_batch_of_8_continues_each_prompt_as_alone_and_stops_each_row_on_its_own(generator):
    prompts = random_sequences([7, 30, 1, 19, 40, 12, 25, 3], seed=4, vocab=SMALL_VOCAB)
    alone = [generator.continuations([p], 24)[0] for p in prompts]
    assert [c.finish for c in alone] == [LENGTH] * 8 and all(len(c.tokens) == 24 for c in alone)
    assert generator.continuations(prompts, 24) == alone
    stop = alone[1].tokens[5]  # row 1 stops at its 6th token (others where they write it, if they do)
    stopped = generator.continuations(prompts, 24, stop_ids=[stop])
    for free, cut in zip(alone, stopped):
        end = free.tokens.index(stop) + 1 if stop in free.tokens else 24
        assert cut.tokens == free.tokens[:end]
        assert cut.finish == (STOP_TOKEN if stop in free.tokens else LENGTH)
    assert stopped[1].finish == STOP_TOKEN and len(stopped[1].tokens) <= 6


def test_sampled_draws_depend_on_the_seed_and_the_sample_alone(generator):
    prompts = random_sequences([9, 21, 14, 5], seed=6, vocab=SMALL_VOCAB)
    ids = [11, 2**62 + 5, 3, 2**40]
    together = generator.continuations(prompts, 20, sampling=SAMPLED, sample_ids=ids)
    alone = [generator.continuations([p], 20, sampling=SAMPLED, sample_ids=[i])[0] for p, i in zip(prompts, ids)]
    assert together == alone  # batch composition changes nothing
    reordered = generator.continuations(prompts[::-1], 20, sampling=SAMPLED, sample_ids=ids[::-1])
    assert reordered == together[::-1]
    greedy = generator.continuations(prompts, 20)
    assert together != greedy  # it samples
    other_seed = generator.continuations(prompts, 20, sampling=Sampling(temperature=0.8, top_p=0.95, seed=8),
                                         sample_ids=ids)
    assert other_seed != together
    # Every bit of the seed counts (a key of 2**32 + 7 is not the key of 7).
    wide = generator.continuations(prompts, 20, sampling=Sampling(temperature=0.8, top_p=0.95, seed=2**32 + 7),
                                   sample_ids=ids)
    assert wide != together
    # The same prompt under two sample ids draws two continuations.
    twice = generator.continuations([prompts[0], prompts[0]], 20, sampling=SAMPLED, sample_ids=[1, 2])
    assert twice[0] != twice[1]


def test_top_k_1_is_greedy_and_the_settings_are_checked(generator):
    prompts = random_sequences([9, 21], seed=8, vocab=SMALL_VOCAB)
    assert generator.continuations(prompts, 12, sampling=Sampling(temperature=1.0, top_k=1)) == \
        generator.continuations(prompts, 12)
    assert Sampling(temperature=-1).problem() == "temperature must be >= 0 (0: greedy), got -1"
    assert Sampling(temperature=1, top_p=0).problem() == "top_p must be in (0, 1], got 0"
    assert "give a temperature above 0" in Sampling(top_p=0.9).problem()
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        generator.continuations(prompts, 4, sampling=Sampling(temperature=1, top_k=-2))
    with pytest.raises(ValueError, match="a prompt of 90 \\+ 10 new tokens exceeds the cache of 96"):
        generator.continuations([[1] * 90], 10)
    with pytest.raises(ValueError, match="an empty prompt"):
        generator.continuations([[1, 2], []], 10)
    assert generator.continuations([], 10) == []


@pytest.mark.parametrize("mesh", [dict(), dict(mesh_type="2d", model_axis_size=2)])
def test_rows_split_over_a_mesh_continue_as_on_one_device(checkpoint, generator, mesh):
    """8 devices: the batch's rows (5 prompts padded to 8) over the data axis, and on a 2d mesh
    the projections split over 2 model devices too."""
    split = generator_on(checkpoint, **mesh)
    assert split.mesh.shape["data"] == (8 if not mesh else 4) and split.batch_rows(5) == 8
    prompts = random_sequences([7, 30, 1, 19, 40], seed=9, vocab=SMALL_VOCAB)
    assert split.continuations(prompts, 16) == generator.continuations(prompts, 16)
    ids = [5, 6, 7, 8, 9]
    assert split.continuations(prompts, 16, sampling=SAMPLED, sample_ids=ids) == \
        generator.continuations(prompts, 16, sampling=SAMPLED, sample_ids=ids)


def test_the_cache_is_sized_before_compiling_and_a_batch_that_cannot_fit_is_halved(generator):
    from common.cli import UserError
    c = generator.config  # keys and values of every block, [rows, 96 positions, kv heads, head_dim] in float32
    assert generator.cache_bytes(4) == 2 * c.num_hidden_layers * 4 * 96 * c.num_key_value_heads * c.head_dim * 4
    one = generator.cache_bytes(1)
    assert generator.rows_that_fit(8, 16 * one) == 8  # a cache may take half of what is free
    assert generator.rows_that_fit(8, 15 * one) == 4
    assert generator.rows_that_fit(8, 2 * one) == 1
    with pytest.raises(UserError, match="the key/value cache of one sequence of 96 positions takes 0.00 GB, "
                                        "more than 50% of the 0.00 GB a device has free"):
        generator.rows_that_fit(8, 2 * one - 1)
