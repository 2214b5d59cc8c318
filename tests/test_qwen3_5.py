"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet blocks beside gated full attention) through
the one decoder: every block and site against transformers' float64 forward, prompts of different
lengths padded in one batch, bfloat16, a 2d mesh, greedy generation carrying the DeltaNet state;
what a DeltaNet block lacks refused in one line."""

import jax
import numpy as np
import pytest

from fixtures.hf_reference import block_sites
from fixtures.hf_reference import (bfloat16_error_ratios, assert_blocks_equal_transformers, load_reference,
                                   max_relative_error, random_sequences, reference_activations, relative_error)
from model.families import load_config
from model.extract import Extractor
from model.sites import ATTN_Z
from tests.conftest import run_in_process
from tests.test_family_runs import assert_equals_transformers, assert_runs_or_refused, runner, write_stream
from tests.test_multihost import stored

pytestmark = pytest.mark.slow
LENGTHS = [100, 37, 70]  # one bucket of 128: two chunks of 64 for the longest, padding in every row


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def checkpoint(request, tmp_path_factory):
    """Qwen3.5 (DeltaNet on blocks 0, 1, 3, 4), Qwen3.5-MoE (on 0, 1, 3; experts in every block)
    and Qwen3-Next (its DeltaNet projections fused otherwise; block 3's MLP dense)."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=4, bfloat16_exact=True)


@pytest.fixture(scope="module")
def sequences(checkpoint):
    return random_sequences(LENGTHS, seed=3, vocab=load_config(checkpoint).vocab_size)


def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoint, sequences):
    config = load_config(checkpoint)
    assert config.deltanet.layers[:3] == (0, 1, 3) and config.attention_layers == (2,)
    assert_blocks_equal_transformers(checkpoint, sequences)


def test_bfloat16_with_a_float32_stream_is_closer_than_transformers_bfloat16(checkpoint, sequences):
    extractor = Extractor.load(checkpoint, dtype="bfloat16", residual_dtype="float32", activation_dtype="float32",
                               max_seq_length=128, min_bucket=128, batch_size_per_device=3,
                               devices=jax.devices()[:1])
    mine = dict(extractor.extract(enumerate(sequences)))
    # A mixture of experts sends a few near-tie tokens to other experts in any bfloat16 forward:
    # over all tokens (as tests/test_families.py compares MoE families), not the worst one.
    error = relative_error if load_config(checkpoint).moe is not None else max_relative_error
    for layer, ratio in bfloat16_error_ratios(checkpoint, sequences, mine, error=error).items():
        assert ratio <= 0.85, (layer, ratio)


def test_every_site_through_the_runner_equals_transformers(checkpoint, tmp_path):
    """Every site but the heads (attn.hook_z, which the DeltaNet blocks lack: refused below) at
    every block; hook_attn_out of a DeltaNet block is what its mixer adds. The dense Qwen3.5 on 8
    devices of data, the mixtures on a 2d mesh (DeltaNet heads and experts over its model axis)."""
    config = load_config(checkpoint)
    flags = ["--mesh_type", "2d"] if config.moe else []
    # every site every block has (Qwen3-Next's block 3: no routing; the inside sites: tests/test_inside_sites.py)
    sites = [site for site in block_sites(config, range(config.num_hidden_layers)) if site != ATTN_Z]
    records = write_stream(tmp_path / "stream.jsonl", checkpoint)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", checkpoint,
                                                        "--sites", ",".join(sites), *flags))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_equals_transformers(checkpoint, records, stored(tmp_path / "out" / "machine_000"), sites)


def test_a_2d_mesh_splits_the_deltanet_weights_by_heads(checkpoint):
    """Over a model axis dividing the key heads: q, k and their convolutions by key head, v, z,
    the gates' projections, the decay parameters and out_proj by value head, the norm replicated."""
    from jax.sharding import PartitionSpec as P
    from model.loading import load_model
    config = load_config(checkpoint)
    loaded = load_model(checkpoint, "float32", mesh_type="2d", model_axis_size=2, num_layers=1)
    mixer = loaded.params["layers_0"]["linear_attn"]
    specs = {name: (value["kernel"] if isinstance(value, dict) else value).sharding.spec
             for name, value in mixer.items()}
    assert specs["in_proj_q"] == specs["in_proj_v"] == specs["in_proj_b"] == P(None, "model")
    assert specs["out_proj"] == P("model", None) and specs["conv_k"] == specs["conv_v"] == P("model", None, None)
    assert specs["A_log"] == P("model") and specs["norm"] == P()
    shard = mixer["in_proj_k"]["kernel"].addressable_shards[0].data
    assert shard.shape == (config.hidden_size, config.deltanet.key_dim // 2)  # one of the 2 key heads


@pytest.mark.parametrize("flags, message", [
    (["--sites", "attn.hook_z"], "--sites attn.hook_z: block 0 mixes with Gated DeltaNet: no attention heads"),
    (["--sites", "attn.hook_z", "--layers_to_extract", "2"], None),  # the attention block has heads
    (["--ablate", "head:1.0"], "block 1 mixes with Gated DeltaNet: it has no attention heads (attn:1 removes"),
])
def test_what_a_deltanet_block_lacks_is_refused_before_the_model_loads(checkpoint, tmp_path, flags, message):
    assert_runs_or_refused(checkpoint, tmp_path, flags, message)


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """Wide weights: peaked, varied logits, so that greedy continuations rarely meet a near tie."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_5_varied"), "qwen3_5", seed=4, initializer_range=0.5)


def test_greedy_generation_carries_the_deltanet_state_as_transformers_does(varied):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch: each row's convolution
    inputs and recurrent state taken at its own length by the prefill, then advanced a step at
    a time; each continuation equals transformers' generate of its prompt alone."""
    from fixtures.hf_reference import assert_greedy_equals_transformers
    from model.generate import Generator
    from model.loading import load_model
    loaded = load_model(varied, "float32", with_head=True, devices=jax.devices()[:1])
    generator = Generator(loaded.config, loaded.params, "float32", cache_length=128)
    # 4 rows in float32: 1 attention block's keys and values [128, 2, 16]; 4 DeltaNet blocks' states
    # [4, 8, 12] and last 3 convolution inputs of q | k | v (16 + 16 + 48)
    assert generator.cache_bytes(4) == 4 * 4 * (2 * 128 * 2 * 16 + 4 * (4 * 8 * 12 + 3 * (16 + 16 + 48)))
    prompts = random_sequences([40, 23, 9], seed=5, vocab=loaded.config.vocab_size)
    assert_greedy_equals_transformers(generator, varied, prompts)


def test_the_runner_stores_what_the_model_wrote_as_transformers_computes_it(checkpoint, tmp_path):
    """(The narrow weights: the wide ones' values reach ~200, and transformers' DeltaNet computes
    in float32 even in a float64 model, so its own error there is ~1e-5.)"""
    from tests.test_generate_runner import stored as stored_entries
    records = {r["sample_id"]: r for r in write_stream(tmp_path / "stream.jsonl", checkpoint, count=3)}
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", checkpoint,
                                                        "--generate", "8", "--layers_to_extract", "1,2"))
    assert result.returncode == 0, result.stderr[-3000:]
    reference = load_reference(checkpoint, "float64")
    entries = stored_entries(tmp_path / "out" / "machine_000")
    assert sorted(entries) == sorted(records)
    for sample_id, layers in entries.items():
        generation = layers[1]["generation"]
        assert generation["num_tokens"] == 8 and generation["finish"] == "length"
        prompt = records[sample_id]["input_ids"][:generation["prompt_tokens"]]  # cut to leave room for 8
        expected = reference_activations(reference, [prompt + generation["token_ids"]])[0]
        for layer in (1, 2):
            assert relative_error(layers[layer]["activation"], expected[layer]) <= 1e-5, (sample_id, layer)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])  # Qwen3-Next ships as a causal LM only
def test_the_multimodal_checkpoints_text_config_reads_as_the_text_model(family, tmp_path):
    import json
    import pathlib
    from fixtures.tiny_models import write_checkpoint
    from model.families import config_from_dict
    checkpoint = write_checkpoint(tmp_path / family, family, seed=4)
    text = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())
    moe = text["model_type"] == "qwen3_5_moe_text"
    wrapper = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
               "model_type": "qwen3_5_moe" if moe else "qwen3_5", "tie_word_embeddings": False, "text_config": text}
    assert config_from_dict(wrapper) == load_config(checkpoint)
    assert np.isclose(load_config(checkpoint).rotary_dim / load_config(checkpoint).head_dim, 0.25)
