"""Llama 4 through the one decoder: chunked local attention with interleaved RoPE and the weightless
QK-norm on the rotating blocks, NoPE blocks with the query temperature, input-scaled sigmoid experts
with a shared expert beside dense blocks. Every block and site against transformers' float64
forward (chunks of 16 and the temperature from position 8 act on samples of 37 to 100 tokens),
greedy generation, the multimodal wrapper's text model, and what the reader refuses. (The sites
inside attention and the MLP: tests/test_inside_sites.py; the chunked kernels:
tests/test_attention.py.)"""

import json
import pathlib

import jax
import pytest

from common.cli import UserError
from fixtures.hf_reference import assert_blocks_equal_transformers, block_sites, random_sequences
from model.config import CHUNKED, FULL, Chunked, QueryTemperature
from model.families import config_from_dict, load_config
from tests.conftest import run_in_process
from tests.test_family_runs import assert_equals_transformers, runner, write_stream
from tests.test_multihost import stored

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
LENGTHS = [100, 37, 70]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """RoPE and chunks on blocks 0, 1, 3; NoPE on 2, 4; experts on 0, 2, 3 (``fixtures.tiny_models``)."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("llama4"), "llama4", seed=4)


def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoint):
    config = load_config(checkpoint)
    assert config.nope_layers == (2, 4) and config.sparse_layers == (0, 2, 3)
    assert [config.window(i) for i in range(5)] == [Chunked(16), Chunked(16), None, Chunked(16), None]
    assert config.query_temperature == QueryTemperature(0.1, 8, offset=1, nope_only=True)
    assert_blocks_equal_transformers(checkpoint, random_sequences(LENGTHS, seed=3, vocab=config.vocab_size))


@pytest.mark.parametrize("flags", [["--layers_to_extract", "0,2,3", "--moe_dispatch", "dense"],
                                   ["--layers_to_extract", "1,4", "--mesh_type", "2d", "--attention", "fused"]])
def test_every_site_through_the_runner_equals_transformers(checkpoint, tmp_path, flags):
    """Every site the blocks asked for have: the expert blocks' routing (choices, sigmoid weights)
    and shared expert through the dense dispatch (the forward elsewhere: the grouped one); the
    dense blocks on a 2d mesh with the fused kernel (each chunk a sequence of its own)."""
    config = load_config(checkpoint)
    layers = [int(n) for n in flags[1].split(",")]
    sites = block_sites(config, layers)
    records = write_stream(tmp_path / "stream.jsonl", checkpoint, count=4)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", checkpoint,
                                                        "--sites", ",".join(sites), *flags))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_equals_transformers(checkpoint, records, stored(tmp_path / "out" / "machine_000"), sites, layers)


def test_greedy_generation_equals_transformers(tmp_path):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch: each step's query in its
    chunk (past the prompt, new chunks start), the NoPE blocks' temperature at its position."""
    from fixtures.hf_reference import assert_greedy_equals_transformers
    from fixtures.tiny_models import write_checkpoint
    from model.generate import Generator
    from model.loading import load_model
    varied = write_checkpoint(tmp_path / "varied", "llama4", seed=4, initializer_range=0.5)
    loaded = load_model(varied, "float32", with_head=True, devices=jax.devices()[:1])
    generator = Generator(loaded.config, loaded.params, "float32", cache_length=128)
    prompts = random_sequences([40, 23, 9], seed=5, vocab=loaded.config.vocab_size)
    assert_greedy_equals_transformers(generator, varied, prompts)


def test_the_multimodal_checkpoints_text_config_reads_as_the_text_model(checkpoint):
    text = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())
    wrapper = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
               "tie_word_embeddings": False, "text_config": text}
    assert config_from_dict(wrapper) == load_config(checkpoint)


def test_scouts_shape_reads_as_transformers_defaults():
    """Llama-4-Scout's text config (16 experts, k 1, every block sparse; chunks of 8192 on three
    blocks of four; NoPE and the temperature on every fourth)."""
    config = config_from_dict({"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
                               "num_hidden_layers": 8})
    assert config.layer_types == (CHUNKED, CHUNKED, CHUNKED, FULL) * 2 and config.window(0) == Chunked(8192)
    assert config.nope_layers == (3, 7) and config.qk_l2_norm and config.rope_interleaved
    assert config.moe.num_experts == 16 and config.moe.top_k == 1 and config.moe.dense_layers == ()
    assert (config.intermediate_size, config.moe.expert_size, config.moe.shared_expert_size) == (16384, 8192, 8192)
    assert config_from_dict({"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
                             "num_hidden_layers": 8, "num_key_value_heads": None}).num_key_value_heads == 40
    maverick = config_from_dict({"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
                                 "num_hidden_layers": 4, "interleave_moe_layer_step": 2, "num_local_experts": 128})
    assert maverick.sparse_layers == (1, 3)


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=["sliding_attention"] * 4), "layer_types"),
    (dict(no_rope_layers=[1, 2, 1, 0]), "no_rope_layers"),
    (dict(num_experts_per_tok=17), "num_experts_per_tok = 17 is not supported"),
    (dict(moe_layers=[5]), "moe_layers"),
    (dict(no_rope_layer_interval=0), "no_rope_layer_interval = 0 is not supported"),
    (dict(layer_types="chunked_attention"), "layer_types = 'chunked_attention' is not supported"),
])
def test_a_config_the_reader_does_not_handle_is_one_line_naming_the_field(change, message):
    raw = {"model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"], "num_hidden_layers": 4, **change}
    with pytest.raises(UserError, match=message) as caught:
        config_from_dict(raw)
    assert "\n" not in str(caught.value)
