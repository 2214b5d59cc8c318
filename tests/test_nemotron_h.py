"""Nemotron-H (blocks of one sublayer each: Mamba-2, attention without positions, plain experts
beside a shared MLP, plain squared-ReLU MLPs) through the one decoder: every block of a padded
batch and the routing through the runner on a 2d mesh against transformers' float64 forward,
greedy generation carrying the Mamba-2 states, both tensor layouts, and what a block of one
sublayer refuses. (Every site at two blocks of each kind: tests/test_inside_sites.py; the
recurrence: tests/test_mamba2.py.)"""

import jax
import numpy as np
import pytest

from common.cli import UserError
from fixtures.hf_reference import assert_blocks_equal_transformers, random_sequences
from model.config import MIXER_ONLY, MLP_ONLY
from model.families import config_from_dict, load_config
from model.sites import EXPERT_INDICES, ROUTING_WEIGHTS
from tests.conftest import run_in_process
from tests.test_family_runs import (assert_equals_transformers, assert_runs_or_refused,
                                    assert_tensors_load_as_the_checkpoint, runner, write_stream)
from tests.test_granite4 import assert_mamba_generation_equals_transformers, assert_routing_equals_transformers
from tests.test_multihost import stored

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
LENGTHS = [100, 37, 70]  # one bucket of 128: several Mamba-2 chunks of 16, padding in every row


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Mamba-2 on blocks 0, 4, 7; attention on 1, 5; experts on 2, 6; plain MLPs on 3, 8
    (``fixtures.tiny_models``), saved as the hub has it (``backbone.``, one tensor an expert)."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("nemotron_h"), "nemotron_h", seed=4, bfloat16_exact=True)


def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoint):
    config = load_config(checkpoint)
    assert config.mamba.layers == (0, 4, 7) and config.attention_layers == (1, 5)
    assert config.sparse_layers == (2, 6) and config.moe.dense_layers == (3, 8)
    assert [config.has_mlp(i) for i in range(9)] == [False, False, True, True, False, False, True, False, True]
    assert config.mamba.time_step_limit[0] == 0.01 and config.rope_of(1) is None
    assert_blocks_equal_transformers(checkpoint, random_sequences(LENGTHS, seed=3, vocab=config.vocab_size))


def test_the_residual_stream_and_routing_through_the_runner_on_a_2d_mesh(checkpoint, tmp_path):
    """The experts' blocks on a 2d mesh (6 experts over its model axis): the stream around them and
    the chosen experts in expert order (transformers' top-k leaves its order open), with their weights."""
    layers, sites = [2, 6], ["hook_resid_pre", "mlp.hook_out", "hook_resid_post", EXPERT_INDICES, ROUTING_WEIGHTS]
    records = write_stream(tmp_path / "stream.jsonl", checkpoint, count=4)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", checkpoint,
                                                        "--sites", ",".join(sites), "--layers_to_extract", "2,6",
                                                        "--mesh_type", "2d"))
    assert result.returncode == 0, result.stderr[-3000:]
    got = stored(tmp_path / "out" / "machine_000")
    routing = (EXPERT_INDICES, ROUTING_WEIGHTS)
    plain = {i: {k: v for k, v in arrays.items() if not str(k).endswith(routing)} for i, arrays in got.items()}
    assert_equals_transformers(checkpoint, records, plain, sites[:3], layers)
    assert_routing_equals_transformers(checkpoint, records, got, layers)


def test_greedy_generation_carries_the_mamba_state_as_transformers_does(tmp_path):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch; the 4 MLP-only blocks hold no
    cache. Large dt projections: decoding steps whose dt falls under time_step_min (unclamped there,
    as transformers' are)."""
    assert_mamba_generation_equals_transformers(tmp_path, "nemotron_h", initializer_range=0.3)


@pytest.mark.parametrize("flags, message", [
    (["--sites", "hook_resid_mid", "--layers_to_extract", "1"], "one sublayer each (a mixer or an MLP)"),
    (["--sites", "mlp.hook_out", "--layers_to_extract", "0,2"], "block 0 of nemotron_h is a mixer alone"),
    (["--sites", "attn.hook_out", "--layers_to_extract", "3"], "block 3 of nemotron_h is an MLP alone"),
    (["--ablate", "mlp:1"], "block 1 is a mixer alone: it has no MLP (attn:1 removes its mixer)"),
    (["--ablate", "head:3.0"], "block 3 is an MLP alone: it has no mixer"),
])
def test_what_a_block_of_one_sublayer_lacks_is_refused_before_the_model_loads(checkpoint, tmp_path, flags, message):
    assert_runs_or_refused(checkpoint, tmp_path, flags, message)


def test_the_hubs_config_reads_as_transformers_and_what_it_lacks_is_refused():
    """NVIDIA-Nemotron-3-Nano-30B-A3B's config.json keys that matter, its pattern cut to 6 blocks."""
    raw = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 2688,
           "hybrid_override_pattern": "MEM*E-", "num_hidden_layers": 6, "num_attention_heads": 32,
           "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 1856, "mamba_num_heads": 64,
           "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "n_routed_experts": 128,
           "num_experts_per_tok": 6, "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
           "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "mlp_hidden_act": "relu2",
           "layer_norm_epsilon": 1e-5, "vocab_size": 131072, "max_position_embeddings": 262144}
    config = config_from_dict(raw)
    assert config.sublayers == (MIXER_ONLY, MLP_ONLY, MIXER_ONLY, MIXER_ONLY, MLP_ONLY, MLP_ONLY)
    assert config.mamba.layers == (0, 2) and config.attention_layers == (3,) and config.sparse_layers == (1, 4)
    assert config.mamba.inner == 4096 and config.moe.shared_expert_size == 3712 and not config.gated_mlp
    listed = ["linear_attention", "moe", "linear_attention", "full_attention", "moe", "mlp"]
    assert config_from_dict({**raw, "layers_block_type": listed}) == config
    assert config_from_dict({**raw, "mamba_n_groups": 8, "n_groups": 4}) == config  # the older name wins
    legacy = ["mamba", "moe", "mamba", "attention", "moe", "mlp"]  # the kinds' older names
    assert config_from_dict({**raw, "layers_block_type": legacy}) == config
    assert config_from_dict({**raw, "moe_latent_size": 1024}).moe.latent_size == 1024  # Nemotron 3 Super's
    for change, message in [({"moe_latent_size": 0}, "moe_latent_size = 0 is not supported"),
                            ({"hybrid_override_pattern": "MEX"}, "hybrid_override_pattern = 'MEX'"),
                            ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act = 'gelu' is not supported"),
                            ({"n_groups": 7}, "n_groups = 7 is not supported"),
                            ({"mlp_hidden_act": "tanh"}, "mlp_hidden_act = 'tanh' is not supported")]:
        with pytest.raises(UserError, match=message) as caught:
            config_from_dict({**raw, **change})
        assert "\n" not in str(caught.value)


def test_latent_experts_equal_transformers(tmp_path):
    """Nemotron 3 Super's experts in a latent of ``moe_latent_size`` (20, of a hidden 48): x
    projected down before them (``fc1_latent_proj``), their weighted sum up after; the router and
    the shared MLP read x. Weights of std 0.1: the routed experts' output is 13% of what the
    experts' block adds (at transformers' 0.02, through four small matmuls, 0.1%: a 1e-5 check
    of the block would barely see them)."""
    from fixtures.tiny_models import write_checkpoint
    latent = write_checkpoint(tmp_path / "latent", "nemotron_h", seed=4, bfloat16_exact=True, moe_latent_size=20,
                              initializer_range=0.1)
    config = load_config(latent)
    assert config.moe.latent_size == 20
    assert_blocks_equal_transformers(latent, random_sequences([40, 23], seed=3, vocab=config.vocab_size))


def test_transformers_names_for_the_experts_load_as_the_hubs_do(checkpoint, tmp_path):
    """The tensors as transformers holds them (``model.``, each block's experts stacked [E, out, in]:
    a checkpoint saved without the original format) load the parameters the hub's give."""
    from safetensors.numpy import load_file
    tensors = {name.replace("backbone.", "model.", 1): t for name, t in
               load_file(f"{checkpoint}/model.safetensors").items()}
    for layer in (2, 6):
        for proj in ("up_proj", "down_proj"):
            names = [f"model.layers.{layer}.mixer.experts.{e}.{proj}.weight" for e in range(6)]
            tensors[f"model.layers.{layer}.mixer.experts.{proj}"] = np.stack([tensors.pop(n) for n in names])
    assert_tensors_load_as_the_checkpoint(checkpoint, tensors, tmp_path / "stacked")


def test_the_mean_pass_gives_each_block_the_means_of_the_sublayer_it_has(checkpoint):
    """Means for mean ablation: heads at the attention blocks only, attention outputs at the mixer
    blocks, MLP outputs at the MLP blocks, zero where a block lacks the sublayer."""
    import jax.numpy as jnp
    from model.loading import load_model
    from model.scoring import InterventionModel
    loaded = load_model(checkpoint, jnp.float32, with_head=True, devices=jax.devices()[:1])
    model = InterventionModel(loaded, batch_size_per_device=2, max_seq_length=64)
    means = model.means(random_sequences([40, 23], seed=3, vocab=loaded.config.vocab_size))
    heads, attn, mlp = (np.asarray(x) for x in (means.head, means.attn, means.mlp))
    assert np.flatnonzero(heads.any(axis=(1, 2))).tolist() == [1, 5]
    assert np.flatnonzero(attn.any(axis=-1)).tolist() == [0, 1, 4, 5, 7]
    assert np.flatnonzero(mlp.any(axis=-1)).tolist() == [2, 3, 6, 8]


def test_attribution_patching_reaches_a_sublayer_site_of_the_blocks_that_have_it(checkpoint):
    """A patch at ``hook_mlp_out`` of an experts' block and at ``hook_attn_out`` of an attention
    block, exactly and by attribution: the other blocks, without the site, add nothing to the
    gradient (before, the attribution pass read the site at every block and failed)."""
    import jax.numpy as jnp
    from ablation.patching import Pair, Patch, attribution_metrics, exact_metrics
    from model.loading import load_model
    loaded = load_model(checkpoint, jnp.float32, with_head=True, devices=jax.devices()[:1])
    clean, corrupted = random_sequences([8, 8], seed=0, vocab=loaded.config.vocab_size)
    pair = Pair(tuple(clean), tuple(corrupted), 3, 5, "p")
    places = [("hook_mlp_out", 2), ("hook_attn_out", 1)]
    cells = [(Patch(site, layer, None, (7,), (7,)),) for site, layer in places]  # one compile each for both
    values = {place: np.zeros((8, loaded.config.hidden_size), np.float32) for place in places}
    exact = exact_metrics(loaded, pair, cells, values)
    estimate, _ = attribution_metrics(loaded, pair, cells, values)
    assert np.isfinite(estimate).all() and (np.sign(estimate) == np.sign(exact)).all(), (exact, estimate)


def test_a_grid_over_blocks_spans_the_blocks_that_have_its_target(checkpoint):
    """``mlp:*``, ``attn:0-4``, ``head:*.0`` and ``expert:*.1`` leave out the blocks without an MLP,
    a mixer, heads or experts; a range none of whose blocks has one is refused in one line."""
    from interventions.resolve import check_blocks, parse_for
    config = load_config(checkpoint)
    for spec, expected in [("mlp:*", ["mlp:2", "mlp:3", "mlp:6", "mlp:8"]),
                           ("attn:0-4", ["attn:0", "attn:1", "attn:4"]), ("head:*.0", ["head:1.0", "head:5.0"]),
                           ("expert:*.1", ["expert:2.1", "expert:6.1"])]:
        grid = parse_for([spec], config)
        assert [iv.name.split(":mode")[0] for iv in grid] == expected, spec
        check_blocks(grid, config)
    with pytest.raises(UserError, match="no block it spans has what it acts on") as caught:
        parse_for(["attn:2-3"], config)
    assert "\n" not in str(caught.value)
