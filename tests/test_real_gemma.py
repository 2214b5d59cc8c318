"""The real Gemma 3 270M (``fixtures.real_models``): its conversion's checks (a corrupt chunk, a
missing package), and this project's forward against transformers on it (``tests/real_models.py``)."""

import dataclasses
import shutil

import pytest

from common.cli import UserError
from fixtures.real_models import REAL_MODELS, Chunk, chunk_paths
from tests import real_models as checks
from tests.conftest import run_in_process

pytestmark = pytest.mark.slow
REAL_MODEL = "gemma-3-270m"  # the real_* fixtures of tests/conftest.py build and read this model
MIDDLE = 9
SITE_LAYERS = (1, MIDDLE)  # every activation site is checked at these blocks (model.sites)


@pytest.fixture(scope="module")
def real_float32(real_model_dir):
    """The model in float32 with its head, loaded once: the float32 forwards and the generation read it."""
    return checks.loaded_float32(real_model_dir)


def test_float32_matches_transformers_float64_at_every_layer_with_the_real_signature(
        real_float32, real_prompts, real_exact):
    errors, ours = checks.float32_errors(real_float32, real_prompts, real_exact)
    assert len(errors) == 18 and max(errors.values()) <= 1e-5, errors
    # Gemma 3's first token stands out less than Qwen's (about 15x in the middle blocks): a random
    # model's is about 1 (tests/test_verify_model.py).
    ratio = checks.signature(ours, MIDDLE)
    print(f"first-token norm / median token norm at layer {MIDDLE}: {ratio:.1f}")
    assert ratio >= 10


def test_every_site_matches_transformers_float64_and_adds_up(real_float32, real_prompts, real_reference):
    errors = checks.site_errors(real_float32, real_prompts, real_reference, SITE_LAYERS)
    assert max(errors.values()) <= 1e-5, errors


def test_bfloat16_with_a_float32_stream_is_more_accurate_than_transformers_bfloat16(
        real_model_dir, real_prompts, real_exact):
    ratios = checks.bfloat16_ratios(real_model_dir, real_prompts, real_exact)
    # Block 0's error is mostly the rounding of matmul operands, which both forwards share.
    assert ratios["frobenius"][0] <= 0.75 and max(r for layer, r in ratios["frobenius"].items() if layer) <= 0.5


def test_greedy_generation_equals_transformers(real_float32, real_model_dir, real_prompts):
    # The three ARC prompts of different lengths continued in one batch, 32 decoding steps each on real weights.
    results = checks.greedy_agreement(real_float32, real_model_dir, real_prompts)
    assert len(results) == 3 and len({len(p) for p in real_prompts}) == 3
    assert all(equal == compared for compared, equal in results) and results[0][0] == checks.NEW_TOKENS
    assert sum(compared for compared, _ in results) >= 2 * checks.NEW_TOKENS, results


def test_a_corrupt_chunk_is_named_in_one_line_and_nothing_is_written(tmp_path, monkeypatch):
    """A copy of the second chunk's package with one byte changed, ahead of the installed one."""
    model = REAL_MODELS[REAL_MODEL]
    chunk = model.chunks[1]
    package = chunk_paths(model)[1].parents[1]
    site = tmp_path / "site"
    shutil.copytree(package, site / package.name)
    corrupt = site / package.name / chunk.file
    with open(corrupt, "r+b") as f:
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 1]))
    monkeypatch.syspath_prepend(str(site))
    output = tmp_path / "out"
    result = run_in_process("fixtures.real_models", "--model", REAL_MODEL, "--output_dir", str(output))
    assert result.returncode == 2, result.stderr
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and str(corrupt) in error[0] and f"is not the pinned {chunk.sha256}" in error[0]
    assert not output.exists() and list(tmp_path.iterdir()) == [site]


def test_a_missing_chunk_package_is_named():
    model = REAL_MODELS[REAL_MODEL]
    absent = dataclasses.replace(model, chunks=(*model.chunks[:1], Chunk("gemma3-absent-part9", "gemma3_absent_part9",
                                                                         "data/x", "0" * 64)))
    with pytest.raises(UserError, match=r"gemma-3-270m: package gemma3-absent-part9==1.0.0 is not installed "
                                        r"\(pip install 'activation-extraction\[real-models\]'\)"):
        chunk_paths(absent)


def test_its_stream_overflows_float16_and_the_extractor_refuses_to_store_that(real_float32, real_prompts):
    # The first token's values pass float16's range from block 7 on, whatever follows it: 32 tokens
    # of a prompt up to the middle block show it as well as the whole prompt at every block.
    with pytest.raises(UserError, match=f"--activation_dtype float16: layer {MIDDLE} holds values past float16's"):
        checks.our_activations(real_float32, [real_prompts[0][:32]], length=32, layers=[MIDDLE],
                               activation_dtype="float16")


def test_the_real_gemma3_vocabulary_splits_a_conversation_into_roles(real_model_dir):
    """The real Gemma 3 tokenizer (its SentencePiece vocabulary, ``<start_of_turn>`` and
    ``<end_of_turn>`` among its special tokens) under Gemma 3's instruction template, copied from
    its tokenizer config (fixtures/chat_templates; the base checkpoint ships none)."""
    from fixtures.family_tokenizers import CHAT_TEMPLATES
    from tests.test_roles import CONVERSATION, role_view
    from transformers import AutoTokenizer
    from transforms.samples import Sample
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)  # its own: load_tokenizer's is shared
    tokenizer.chat_template = (CHAT_TEMPLATES / "gemma3.jinja").read_text()
    assert role_view(tokenizer, Sample(1, "c", messages=CONVERSATION, generation_prompt=False)) == [
        ("_*", "<bos>"), ("_*", "<start_of_turn>"), ("_", "user\n"), ("S", "You are terse."), ("_", "\n\n"),
        ("U", "Hi there!"), ("_*", "<end_of_turn>"), ("_", "\n"), ("_*", "<start_of_turn>"), ("_", "model\n"),
        ("A", "Hello."), ("_*", "<end_of_turn>"), ("_", "\n"), ("_*", "<start_of_turn>"), ("_", "user\n"),
        ("U", "Again?"), ("_*", "<end_of_turn>"), ("_", "\n")]
