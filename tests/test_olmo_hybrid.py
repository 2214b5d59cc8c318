"""OLMo hybrid (Gated DeltaNet blocks with pre-norms, beta up to 2, beside OLMo 2's post-norm
attention blocks) through the one decoder: every block of a padded batch and every site through
the runner against transformers' float64 forward, greedy generation carrying the DeltaNet state,
the checkpoint's own tensor names, and what the reader or a block refuses. (The sites inside
attention and the MLP: tests/test_inside_sites.py; the chunked rule with beta up to 2:
tests/test_deltanet.py.)"""

import numpy as np
import pytest
from safetensors.numpy import load_file

from common.cli import UserError
from fixtures.hf_reference import (assert_blocks_equal_transformers, assert_family_greedy_equals_transformers,
                                   block_sites, random_sequences)
from model.families import config_from_dict, load_config
from tests.conftest import run_in_process
from tests.test_family_runs import (assert_equals_transformers, assert_runs_or_refused,
                                    assert_tensors_load_as_the_checkpoint, runner, write_stream)
from tests.test_multihost import stored

pytestmark = pytest.mark.slow
LENGTHS = [100, 37, 70]  # one bucket of 128: two chunks of 64 for the longest, padding in every row


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """DeltaNet on blocks 0, 2, 3; attention on 1 and 4 (``fixtures.tiny_models``)."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("olmo_hybrid"), "olmo_hybrid", seed=4, bfloat16_exact=True)


def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoint):
    config = load_config(checkpoint)
    assert config.deltanet.layers == (0, 2, 3) and config.attention_layers == (1, 4)
    assert config.deltanet.beta_scale == 2.0 and config.layer_config(0).pre_norms and not config.pre_norms
    assert_blocks_equal_transformers(checkpoint, random_sequences(LENGTHS, seed=3, vocab=config.vocab_size))


def test_a_null_rope_theta_rotates_no_block_as_transformers_does(tmp_path):
    """Olmo-Hybrid-7B's config.json: ``rope_parameters.rope_theta`` null, so transformers builds
    no rotary embedding."""
    from fixtures.tiny_models import write_checkpoint
    nope = write_checkpoint(tmp_path / "nope", "olmo_hybrid", seed=4, num_hidden_layers=3,
                            layer_types=["linear_attention", "full_attention", "full_attention"],
                            rope_parameters={"rope_type": "default", "rope_theta": None})
    config = load_config(nope)
    assert config.nope_layers == (0, 1, 2) and all(config.rope_of(i) is None for i in range(3))
    assert_blocks_equal_transformers(nope, random_sequences([40, 23], seed=3, vocab=config.vocab_size))


def test_every_site_through_the_runner_equals_transformers(checkpoint, tmp_path):
    """Every site every block has (its norms' sites differ by block: below)."""
    config = load_config(checkpoint)
    sites = block_sites(config, range(config.num_hidden_layers))
    records = write_stream(tmp_path / "stream.jsonl", checkpoint, count=4)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", checkpoint,
                                                        "--sites", ",".join(sites)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_equals_transformers(checkpoint, records, stored(tmp_path / "out" / "machine_000"), sites)


@pytest.mark.parametrize("flags, message", [
    (["--sites", "ln1.hook_normalized", "--layers_to_extract", "0,1"],
     "--sites ln1.hook_normalized: block 1's attention reads the stream without a norm before it"),
    (["--sites", "ln2.hook_normalized", "--layers_to_extract", "2,3"], None),  # DeltaNet blocks: pre-norms
    (["--sites", "attn.hook_z", "--layers_to_extract", "3"], "block 3 mixes with Gated DeltaNet"),
])
def test_what_a_block_lacks_is_refused_before_the_model_loads(checkpoint, tmp_path, flags, message):
    assert_runs_or_refused(checkpoint, tmp_path, flags, message)


def test_greedy_generation_carries_the_deltanet_state_as_transformers_does(tmp_path):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch (wide weights: peaked logits),
    each equal to transformers' generate of its prompt alone."""
    assert_family_greedy_equals_transformers(tmp_path / "varied", "olmo_hybrid", initializer_range=0.5)


@pytest.mark.parametrize("names", ["transformers", "olmo-core"])
def test_either_naming_of_the_tensors_loads_the_same_parameters(checkpoint, tmp_path, names):
    """transformers' own names (one ``conv1d`` over q | k | v, ``input_layernorm`` and
    ``post_attention_layernorm``), or OLMo-core's export as transformers' conversion reads it
    (q's, k's and v's convolutions apart at their own widths; the DeltaNet blocks' norms named
    ``attention_layer_norm`` / ``feedforward_layer_norm``), load what the written checkpoint does
    (transformers' save_pretrained cuts the fused convolution in three equal parts)."""
    d = load_config(checkpoint).deltanet
    tensors = load_file(f"{checkpoint}/model.safetensors")
    for layer in d.layers:
        mixer = f"model.layers.{layer}.linear_attn"
        fused = np.concatenate([tensors.pop(f"{mixer}.{x}_conv1d.weight") for x in "qkv"])  # [2 Dk + Dv, 1, K]
        assert fused.shape[0] == 2 * d.key_dim + d.value_dim
        if names == "transformers":
            tensors[f"{mixer}.conv1d.weight"] = fused
            block = f"model.layers.{layer}"
            for saved, theirs in (("attention_layer_norm", "input_layernorm"),
                                  ("feedforward_layer_norm", "post_attention_layernorm")):
                tensors[f"{block}.{theirs}.weight"] = tensors.pop(f"{block}.{saved}.weight")
        else:
            widths = np.cumsum([d.key_dim, d.key_dim])
            for x, part in zip("qkv", np.split(fused, widths)):
                tensors[f"{mixer}.{x}_conv1d.weight"] = part
    assert_tensors_load_as_the_checkpoint(checkpoint, tensors, tmp_path / names)


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=["linear_attention"] * 3), "layer_types"),
    (dict(hidden_act="gelu"), "hidden_act = 'gelu' is not supported"),
    (dict(linear_num_key_heads=2, linear_num_value_heads=3), "linear_num_value_heads = 3 is not supported"),
])
def test_a_config_the_reader_does_not_handle_is_one_line_naming_the_field(change, message):
    raw = {"model_type": "olmo_hybrid", "architectures": ["OlmoHybridForCausalLM"], "num_hidden_layers": 3, **change}
    with pytest.raises(UserError, match=message) as caught:
        config_from_dict(raw)
    assert "\n" not in str(caught.value)
