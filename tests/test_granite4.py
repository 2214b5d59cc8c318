"""Granite 4 (Mamba-2 blocks beside attention blocks, experts with a shared MLP, Granite's
multipliers) through the one decoder: every block of a padded batch and every site through the
runner against transformers' float64 forward, greedy generation carrying the Mamba-2 states, and
what the reader or a block refuses. (The sites inside attention and the MLP:
tests/test_inside_sites.py; the recurrence: tests/test_mamba2.py.)"""

import jax
import numpy as np
import pytest

from common.cli import UserError
from fixtures.hf_reference import (assert_blocks_equal_transformers, block_sites, load_reference, random_sequences,
                                   reference_sites, relative_error)
from model.families import config_from_dict, load_config
from model.sites import EXPERT_INDICES, ROUTING_WEIGHTS, array_key, key_parts
from tests.conftest import run_in_process
from tests.test_family_runs import (assert_equals_transformers, assert_runs_or_refused,
                                    assert_tensors_load_as_the_checkpoint, runner, write_stream)
from tests.test_multihost import stored

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
LENGTHS = [100, 37, 70]  # one bucket of 128: two chunks of 64 for the longest, padding in every row


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Mamba-2 on blocks 0, 2, 3; attention on 1 and 4 (``fixtures.tiny_models``)."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("granite4"), "granitemoehybrid", seed=4, bfloat16_exact=True)


def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoint):
    config = load_config(checkpoint)
    assert config.mamba.layers == (0, 2, 3) and config.attention_layers == (1, 4)
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (2.0, 0.5, 3.0)
    assert_blocks_equal_transformers(checkpoint, random_sequences(LENGTHS, seed=3, vocab=config.vocab_size))


def test_every_site_through_the_runner_equals_transformers(checkpoint, tmp_path):
    """Every site a Mamba-2 block and an attention block have, on a 2d mesh (the experts over its
    model axis); the chosen experts in expert order (transformers' top-k leaves its order open)."""
    config = load_config(checkpoint)
    layers = [0, 1]
    sites = block_sites(config, layers)
    records = write_stream(tmp_path / "stream.jsonl", checkpoint, count=4)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", checkpoint,
                                                        "--sites", ",".join(sites), "--layers_to_extract", "0,1",
                                                        "--mesh_type", "2d"))
    assert result.returncode == 0, result.stderr[-3000:]
    got = stored(tmp_path / "out" / "machine_000")
    plain = [site for site in sites if site not in (EXPERT_INDICES, ROUTING_WEIGHTS)]
    assert_equals_transformers(checkpoint, records, {i: {k: v for k, v in arrays.items() if key_parts(k)[0] in plain}
                                                     for i, arrays in got.items()}, plain, layers)
    assert_routing_equals_transformers(checkpoint, records, got, layers)


def assert_routing_equals_transformers(checkpoint: str, records: list[dict], got: dict, layers: list[int]) -> None:
    """The chosen experts stored for ``records`` at ``layers`` equal transformers' float64 choice in
    expert order (its top-k leaves the order open), and their weights within 1e-5."""
    routing = (EXPERT_INDICES, ROUTING_WEIGHTS)
    references = reference_sites(load_reference(checkpoint, "float64"), [r["input_ids"] for r in records],
                                 [(site, layer) for layer in layers for site in routing])
    for record, reference in zip(records, references):
        for layer in layers:
            ours = [got[record["sample_id"]][array_key(site, layer)] for site in routing]
            theirs = [reference[site, layer] for site in routing]
            order, their_order = np.argsort(ours[0], axis=-1), np.argsort(theirs[0], axis=-1)  # expert order
            take = lambda x, o: np.take_along_axis(x, o, axis=-1)
            np.testing.assert_array_equal(take(ours[0], order), take(theirs[0], their_order))
            assert relative_error(take(ours[1], order), take(theirs[1], their_order)) <= 1e-5


def test_greedy_generation_carries_the_mamba_state_as_transformers_does(tmp_path):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch: each row's convolution inputs
    and states taken at its own length by the prefill, then advanced a step at a time."""
    assert_mamba_generation_equals_transformers(tmp_path, "granitemoehybrid", initializer_range=0.5)


def assert_mamba_generation_equals_transformers(tmp_path, family: str, **overrides) -> None:
    """Greedy continuations of a tiny ``family`` checkpoint with 2 attention and 3 Mamba-2 blocks
    (and no other cache) equal transformers' ``generate``."""
    from fixtures.hf_reference import assert_greedy_equals_transformers
    from fixtures.tiny_models import write_checkpoint
    from model.generate import Generator
    from model.loading import load_model
    varied = write_checkpoint(tmp_path / "varied", family, seed=4, **overrides)
    loaded = load_model(varied, "float32", with_head=True, devices=jax.devices()[:1])
    generator = Generator(loaded.config, loaded.params, "float32", cache_length=128)
    m = loaded.config.mamba
    # 1 row in float32: 2 attention blocks' keys and values [128, 1, 16]; 3 Mamba-2 blocks' states [6, 16, 8]
    # and last 2 convolution inputs of x | B | C (96 + 2 x 2 x 8)
    assert generator.cache_bytes(1) == 4 * (2 * 2 * 128 * 16 + 3 * (6 * 16 * 8 + 2 * m.conv_dim))
    prompts = random_sequences([40, 23, 9], seed=5, vocab=loaded.config.vocab_size)
    assert_greedy_equals_transformers(generator, varied, prompts)


@pytest.mark.parametrize("flags, message", [
    (["--sites", "attn.hook_z", "--layers_to_extract", "0"], "--sites attn.hook_z: block 0 mixes with Mamba-2"),
    (["--ablate", "head:2.0"], "block 2 mixes with Mamba-2: it has no attention heads (attn:2 removes"),
    (["--sites", "attn.hook_delta_out", "--layers_to_extract", "0"], "has no Gated DeltaNet blocks"),
])
def test_what_a_mamba_block_lacks_is_refused_before_the_model_loads(checkpoint, tmp_path, flags, message):
    assert_runs_or_refused(checkpoint, tmp_path, flags, message)


def test_granite_4s_shape_reads_as_transformers_defaults_and_refuses_what_it_lacks():
    """granite-4.0-h-tiny's config.json keys that matter (its 40 blocks: attention on 4 of them)."""
    raw = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "hidden_size": 1536,
           "num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 4, "mamba_n_heads": 48,
           "mamba_d_head": 64, "mamba_d_state": 128, "layer_types": ["linear_attention", "full_attention",
                                                                     "linear_attention", "linear_attention"],
           "num_local_experts": 64, "num_experts_per_tok": 6, "intermediate_size": 512,
           "shared_intermediate_size": 1024, "position_embedding_type": "nope", "tie_word_embeddings": True}
    config = config_from_dict(raw)
    assert config.nope_layers == (0, 1, 2, 3) and config.mamba.inner == 3072 and config.mamba.head_dim == 64
    assert config.moe.top_k_before_softmax and config.moe.shared_expert_size == 1024
    assert config_from_dict({**raw, "num_local_experts": 0}).moe is None
    released = config_from_dict({**raw, "layer_types": ["mamba", "attention", "mamba", "mamba"]})  # the hub's names
    assert released == config
    for change, message in [({"mamba_n_heads": 47}, "mamba_n_heads = 47 is not supported"),
                            ({"layer_types": ["ssm"] * 4}, "layer_types"),
                            ({"attention_multiplier": 0}, "attention_multiplier = 0.0 is not supported"),
                            ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported")]:
        with pytest.raises(UserError, match=message) as caught:
            config_from_dict({**raw, **change})
        assert "\n" not in str(caught.value)


def test_the_mean_pass_skips_the_heads_a_mamba_block_lacks(checkpoint):
    """Means for mean ablation: the attention blocks' heads as stored, the Mamba-2 blocks' zero (they
    have none); every block's attention, MLP and contribution means."""
    import jax.numpy as jnp
    from model.loading import load_model
    from model.scoring import InterventionModel
    loaded = load_model(checkpoint, jnp.float32, with_head=True, devices=jax.devices()[:1])
    model = InterventionModel(loaded, batch_size_per_device=2, max_seq_length=64)
    means = model.means(random_sequences([40, 23], seed=3, vocab=loaded.config.vocab_size))
    heads = np.asarray(means.head)  # [L, N, D]
    assert not heads[[0, 2, 3]].any() and heads[[1, 4]].any()
    assert np.isfinite(np.asarray(means.attn)).all() and np.asarray(means.attn).any(axis=-1).all()


def test_transformers_names_for_the_experts_load_as_the_hubs_do(checkpoint, tmp_path):
    """The experts and router under transformers' names (``experts.gate_up_proj``, ``router.weight``:
    a checkpoint saved without the original format) load the parameters the hub's names give."""
    from safetensors.numpy import load_file
    tensors = load_file(f"{checkpoint}/model.safetensors")
    for ours, theirs in (("router.layer.weight", "router.weight"), ("input_linear.weight", "experts.gate_up_proj"),
                         ("output_linear.weight", "experts.down_proj")):
        for name in [n for n in tensors if n.endswith(f"block_sparse_moe.{ours}")]:
            tensors[name.replace(ours, theirs)] = tensors.pop(name)
    assert_tensors_load_as_the_checkpoint(checkpoint, tensors, tmp_path / "renamed")
