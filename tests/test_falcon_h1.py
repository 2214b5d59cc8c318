"""Falcon-H1 (attention and a Mamba-2 mixer side by side in every block, Falcon's μP multipliers)
through the one decoder: every block of a padded batch, with the Mamba-2 gated norm on and off,
and the mixers' sites through the runner on a 2d mesh against transformers' float64 forward,
greedy generation carrying both caches, and what the reader refuses. (Every site at two blocks:
tests/test_inside_sites.py; the recurrence: tests/test_mamba2.py.)"""

import jax
import numpy as np
import pytest

from common.cli import UserError
from fixtures.hf_reference import assert_blocks_equal_transformers, random_sequences
from model.families import config_from_dict, load_config
from model.sites import (ATTN_OUT, RESID_MID, RESID_POST, RESID_PRE, SSM_MODULE_OUT, SSM_OUT, array_key,
                         missing_reason)
from tests.conftest import run_in_process
from tests.test_family_runs import assert_equals_transformers, runner, write_stream
from tests.test_multihost import stored

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
LENGTHS = [100, 37, 70]  # one bucket of 128: several Mamba-2 chunks of 16, padding in every row


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """3 blocks, every multiplier away from 1, the gated norm normalising before the gate
    (``fixtures.tiny_models``)."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("falcon_h1"), "falcon_h1", seed=4, bfloat16_exact=True)


@pytest.mark.parametrize("overrides", [{}, {"mamba_rms_norm": False}, {"mamba_norm_before_gate": False}],
                         ids=["norm before gate", "no norm", "norm after gate"])
def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoint, tmp_path, overrides):
    from fixtures.tiny_models import write_checkpoint
    model_dir = write_checkpoint(tmp_path / "variant", "falcon_h1", seed=4, **overrides) if overrides else checkpoint
    config = load_config(model_dir)
    assert config.mamba.parallel and config.attention_layers == (0, 1, 2) and not config.is_recurrent(1)
    assert config.mamba.gated_norm == overrides.get("mamba_rms_norm", True)
    assert_blocks_equal_transformers(model_dir, random_sequences(LENGTHS, seed=3, vocab=config.vocab_size))


def test_the_mixers_additions_through_the_runner_on_a_2d_mesh(checkpoint, tmp_path):
    """What attention and the Mamba-2 mixer each add (with their multipliers), the Mamba-2 mixer's
    output and the streams around them, at blocks 0 and 2, on a 2d mesh."""
    layers, sites = [0, 2], [RESID_PRE, ATTN_OUT, SSM_MODULE_OUT, SSM_OUT, RESID_MID, RESID_POST]
    records = write_stream(tmp_path / "stream.jsonl", checkpoint, count=4)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", checkpoint,
                                                        "--sites", ",".join(sites), "--layers_to_extract", "0,2",
                                                        "--mesh_type", "2d"))
    assert result.returncode == 0, result.stderr[-3000:]
    got = stored(tmp_path / "out" / "machine_000")
    assert_equals_transformers(checkpoint, records, got, sites, layers)
    for arrays in got.values():  # the block's two mixers add hook_attn_out + hook_ssm_out
        pre, attn, ssm, mid = (arrays[array_key(site, 2)] for site in (RESID_PRE, ATTN_OUT, SSM_OUT, RESID_MID))
        np.testing.assert_allclose(mid - pre, attn + ssm, atol=1e-5)


def test_greedy_generation_carries_attention_and_mamba_caches_as_transformers_does(tmp_path):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch: each block's keys and values
    beside its Mamba-2 states."""
    from fixtures.hf_reference import assert_greedy_equals_transformers
    from fixtures.tiny_models import write_checkpoint
    from model.generate import Generator
    from model.loading import load_model
    varied = write_checkpoint(tmp_path / "varied", "falcon_h1", seed=4, initializer_range=0.3)
    loaded = load_model(varied, "float32", with_head=True, devices=jax.devices()[:1])
    generator = Generator(loaded.config, loaded.params, "float32", cache_length=128)
    m = loaded.config.mamba
    # 1 row in float32, each of 3 blocks: keys and values [128, 1, 16], a Mamba-2 state [6, 16, 8] and the last
    # 2 convolution inputs of x | B | C (96 + 2 x 2 x 8)
    assert generator.cache_bytes(1) == 4 * 3 * (2 * 128 * 16 + 6 * 16 * 8 + 2 * m.conv_dim)
    prompts = random_sequences([40, 23, 9], seed=5, vocab=loaded.config.vocab_size)
    assert_greedy_equals_transformers(generator, varied, prompts)


def test_falcon_h1s_config_reads_as_transformers_and_what_it_lacks_is_refused(checkpoint):
    """Falcon-H1-0.5B's config.json keys that matter, cut to 2 blocks."""
    raw = {"architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "hidden_size": 1024,
           "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
           "head_dim": 64, "mamba_d_ssm": 1536, "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_n_groups": 1,
           "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_rms_norm": False, "mamba_norm_before_gate": False,
           "key_multiplier": 0.39, "attention_in_multiplier": 1.0, "attention_out_multiplier": 0.94,
           "ssm_in_multiplier": 1.25, "ssm_out_multiplier": 0.24, "mlp_multipliers": [0.88, 0.56],
           "ssm_multipliers": [0.35, 0.25, 0.51, 0.49, 0.38], "embedding_multiplier": 5.66,
           "lm_head_multiplier": 0.04, "rope_theta": 100000000000.0, "vocab_size": 32784,
           "max_position_embeddings": 16384, "tie_word_embeddings": False}
    config = config_from_dict(raw)
    assert config.mamba.inner == 1536 and config.mamba.layers == (0, 1) and not config.mamba.gated_norm
    assert config.multipliers.lm_head == 0.04 and config.mamba.projection_multipliers[2] == 0.51
    assert config.rope.theta == 1e11 and config.embedding_multiplier == 5.66
    assert config_from_dict({**raw, "mamba_d_ssm": None, "mamba_n_heads": 32}).mamba.inner == 2048  # 2 x hidden
    for change, message in [({"mamba_n_heads": 25}, "mamba_n_heads = 25 is not supported"),
                            ({"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers"),
                            ({"mlp_multipliers": 2.0}, "mlp_multipliers = 2.0 is not supported"),
                            ({"projectors_bias": True}, "projectors_bias = True is not supported"),
                            ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported")]:
        with pytest.raises(UserError, match=message) as caught:
            config_from_dict({**raw, **change})
        assert "\n" not in str(caught.value)
    granite = config_from_dict({"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
                                "num_local_experts": 0})
    assert "no Mamba-2 mixer beside attention" in missing_reason(SSM_OUT, granite, 0)
    assert missing_reason(SSM_OUT, load_config(checkpoint), 1) is None


def test_the_mean_pass_gives_every_block_its_heads_means(checkpoint):
    """Means for mean ablation: every block's heads (attention is in every block, beside its
    Mamba-2 mixer), and every block's attention output."""
    import jax.numpy as jnp
    from model.loading import load_model
    from model.scoring import InterventionModel
    loaded = load_model(checkpoint, jnp.float32, with_head=True, devices=jax.devices()[:1])
    model = InterventionModel(loaded, batch_size_per_device=2, max_seq_length=64)
    means = model.means(random_sequences([40, 23], seed=3, vocab=loaded.config.vocab_size))
    assert np.asarray(means.head).any(axis=(1, 2)).all()
    assert np.asarray(means.attn).any(axis=-1).all() and np.isfinite(np.asarray(means.attn)).all()
