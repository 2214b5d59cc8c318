"""Qwen3.5 (Gated DeltaNet blocks beside gated full attention) through the one decoder: every
block and site against transformers' float64 forward, prompts of different lengths padded in one
batch, bfloat16, a 2d mesh; what is not implemented yet refused in one line."""

import jax
import numpy as np
import pytest

from fixtures.hf_reference import (load_reference, max_relative_error, random_sequences, reference_activations,
                                   relative_error)
from model.config import load_config
from model.extract import Extractor
from model.sites import ATTN_Z, SITES, missing_reason
from tests.conftest import run_in_process
from tests.test_family_runs import assert_equals_transformers, runner, write_stream
from tests.test_host_errors import one_line_error
from tests.test_multihost import stored

pytestmark = pytest.mark.slow
LENGTHS = [100, 37, 70]  # one bucket of 128: two chunks of 64 for the longest, padding in every row


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5", seed=4, bfloat16_exact=True)


@pytest.fixture(scope="module")
def sequences(checkpoint):
    return random_sequences(LENGTHS, seed=3, vocab=load_config(checkpoint).vocab_size)


def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoint, sequences):
    config = load_config(checkpoint)
    assert config.deltanet.layers == (0, 1, 3, 4) and config.attention_layers == (2,)
    reference = reference_activations(load_reference(checkpoint, "float64"), sequences)  # each alone
    extractor = Extractor.load(checkpoint, dtype="float32", max_seq_length=128, min_bucket=128,
                               batch_size_per_device=3, devices=jax.devices()[:1])
    out = dict(extractor.extract(enumerate(sequences)))
    for i, expected in enumerate(reference):
        for layer in expected:
            assert relative_error(out[i][layer], expected[layer]) <= 1e-5, (LENGTHS[i], layer)


def test_bfloat16_with_a_float32_stream_is_closer_than_transformers_bfloat16(checkpoint, sequences):
    exact = reference_activations(load_reference(checkpoint, "float64"), sequences)
    theirs = reference_activations(load_reference(checkpoint, "bfloat16"), sequences)
    extractor = Extractor.load(checkpoint, dtype="bfloat16", residual_dtype="float32", activation_dtype="float32",
                               max_seq_length=128, min_bucket=128, batch_size_per_device=3,
                               devices=jax.devices()[:1])
    mine = dict(extractor.extract(enumerate(sequences)))
    for layer in exact[0]:
        ours = max(max_relative_error(mine[i][layer], e[layer]) for i, e in enumerate(exact))
        hf = max(max_relative_error(t[layer], e[layer]) for t, e in zip(theirs, exact))
        print(f"qwen3_5 block {layer}: bfloat16 error {ours:.3g} vs transformers' {hf:.3g} ({ours / hf:.2f})")
        assert ours <= 0.85 * hf, (layer, ours, hf)


@pytest.mark.parametrize("flags", [[], ["--mesh_type", "2d"]])
def test_every_site_through_the_runner_equals_transformers(checkpoint, tmp_path, flags):
    """Every site but the heads (attn.hook_z, which the DeltaNet blocks lack: refused below) at
    every block; hook_attn_out of a DeltaNet block is what its mixer adds."""
    config = load_config(checkpoint)
    sites = [site for site in SITES if site != ATTN_Z and missing_reason(site, config) is None]
    records = write_stream(tmp_path / "stream.jsonl", checkpoint)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", checkpoint,
                                                        "--sites", ",".join(sites), *flags))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_equals_transformers(checkpoint, records, stored(tmp_path / "out" / "machine_000"), sites)


@pytest.mark.parametrize("flags, message", [
    (["--sites", "attn.hook_z"], "--sites attn.hook_z: block 0 mixes with Gated DeltaNet: no attention heads"),
    (["--sites", "attn.hook_z", "--layers_to_extract", "2"], None),  # the attention block has heads
    (["--ablate", "head:1.0"], "block 1 mixes with Gated DeltaNet: it has no attention heads (attn:1 removes"),
    (["--generate", "4"], "generation through qwen3_5's Gated DeltaNet blocks is not implemented yet"),
])
def test_what_a_deltanet_block_lacks_is_refused_before_the_model_loads(checkpoint, tmp_path, flags, message):
    write_stream(tmp_path / "stream.jsonl", checkpoint, count=2)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", checkpoint,
                                                        *flags))
    if message is None:
        assert result.returncode == 0, result.stderr[-3000:]
        return
    one_line_error(result, message)
    assert not (tmp_path / "out").exists()


def test_verify_model_refuses_it_before_it_loads(checkpoint, tmp_path):
    result = run_in_process("runners.verify_model", "--model_path", checkpoint, "--output", str(tmp_path / "r.txt"))
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "generation through qwen3_5's Gated DeltaNet blocks is not implemented yet" in errors[0]
    assert not (tmp_path / "r.txt").exists()


def test_the_multimodal_checkpoints_text_config_reads_as_the_text_model(checkpoint):
    import json
    import pathlib
    from model.config import config_from_dict
    text = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())
    wrapper = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "tie_word_embeddings": False, "text_config": {**text, "model_type": "qwen3_5_text"}}
    assert config_from_dict(wrapper) == load_config(checkpoint)
    assert np.isclose(load_config(checkpoint).rotary_dim / load_config(checkpoint).head_dim, 0.25)
