"""Kimi Linear (Kimi Delta Attention blocks beside latent attention without rotation, DeepSeek-V3's
experts) through the one decoder: every block of a padded batch, and every site and the routing
through the runner on a 2d mesh, against transformers' float64 forward; greedy generation carrying
the delta rule's state; the hub's config.json and tensor names; what the reader or a block refuses.
(The sites inside the mixers at two blocks of each kind: tests/test_inside_sites.py; the chunked
rule with a decay per key channel: tests/test_deltanet.py.)"""

import pytest

from common.cli import UserError
from fixtures.hf_reference import (assert_blocks_equal_transformers, assert_family_greedy_equals_transformers,
                                   block_sites, random_sequences)
from model.families import config_from_dict, load_config
from model.sites import EXPERT_INDICES, ROUTING_WEIGHTS
from tests.conftest import run_in_process
from tests.test_family_runs import (assert_equals_transformers, assert_runs_or_refused,
                                    assert_tensors_load_as_the_checkpoint, runner, write_stream)
from tests.test_granite4 import assert_routing_equals_transformers
from tests.test_multihost import stored

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
LENGTHS = [100, 37, 70]  # one bucket of 128: two chunks of 64 for the longest, padding in every row


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Kimi Delta Attention on blocks 0, 2, 3; latent attention on 1, 4; dense MLPs on 0, 2
    (``fixtures.tiny_models``), saved as transformers' save_pretrained writes it (the hub's names)."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("kimi_linear"), "kimi_linear", seed=4, bfloat16_exact=True)


def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoint):
    config = load_config(checkpoint)
    assert config.deltanet.layers == (0, 2, 3) and config.attention_layers == (1, 4)
    assert config.deltanet.channel_decay and config.moe.dense_layers == (0, 2) and config.mla.q_lora_rank is None
    assert all(config.rope_of(i) is None for i in range(5))
    assert_blocks_equal_transformers(checkpoint, random_sequences(LENGTHS, seed=3, vocab=config.vocab_size))


def test_every_site_and_the_routing_through_the_runner_on_a_2d_mesh(checkpoint, tmp_path):
    """Every site the experts' blocks have (latent attention on 1 and 4, Kimi Delta Attention on 3),
    on a 2d mesh (the experts over its model axis); the chosen experts
    in expert order (transformers' top-k leaves its order open)."""
    config = load_config(checkpoint)
    layers = list(config.sparse_layers)
    assert layers == [1, 3, 4]
    routing = (EXPERT_INDICES, ROUTING_WEIGHTS)
    sites = [site for site in block_sites(config, layers) if site not in routing]
    records = write_stream(tmp_path / "stream.jsonl", checkpoint, count=4)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", checkpoint,
                                                        "--sites", ",".join([*sites, EXPERT_INDICES, ROUTING_WEIGHTS]),
                                                        "--layers_to_extract", "1,3,4", "--mesh_type", "2d"))
    assert result.returncode == 0, result.stderr[-3000:]
    got = stored(tmp_path / "out" / "machine_000")
    plain = {i: {k: v for k, v in arrays.items() if not str(k).endswith(routing)} for i, arrays in got.items()}
    assert_equals_transformers(checkpoint, records, plain, sites, layers)
    assert_routing_equals_transformers(checkpoint, records, got, layers)


def test_greedy_generation_carries_the_delta_state_as_transformers_does(tmp_path):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch (wide weights: peaked logits),
    each equal to transformers' generate of its prompt alone."""
    assert_family_greedy_equals_transformers(tmp_path / "varied", "kimi_linear", initializer_range=0.5)


@pytest.mark.parametrize("flags, message", [
    (["--sites", "attn.hook_delta_out", "--layers_to_extract", "1"],
     "block 1 mixes with attention: the Kimi Delta Attention blocks are 0, 2, 3"),
    (["--sites", "attn.hook_q", "--layers_to_extract", "4"], "its queries, keys, values and patterns are not sites"),
])
def test_what_a_block_lacks_is_refused_before_the_model_loads(checkpoint, tmp_path, flags, message):
    assert_runs_or_refused(checkpoint, tmp_path, flags, message)


# Kimi-Linear-48B-A3B-Instruct's config.json keys that matter, its blocks cut to 6 (1-based lists), the
# numbers moved off transformers' defaults so that a key read under another name cannot pass unnoticed.
HUB_CONFIG = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
              "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 6,
              "num_attention_heads": 32, "num_key_value_heads": 32, "kv_lora_rank": 512, "q_lora_rank": None,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
              "num_experts": 64, "num_experts_per_token": 4, "num_shared_experts": 2, "moe_renormalize": False,
              "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446, "first_k_dense_replace": 2,
              "moe_layer_freq": 1, "use_grouped_topk": True, "num_expert_group": 4, "topk_group": 2,
              "linear_attn_config": {"full_attn_layers": [4, 6], "kda_layers": [1, 2, 3, 5], "num_heads": 16,
                                     "head_dim": 64, "short_conv_kernel_size": 3},
              "linear_num_heads": 8,  # the nested number wins, in transformers too
              "rms_norm_eps": 1e-5, "model_max_length": 4096, "tie_word_embeddings": False,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0,  # read by no block
                              "original_max_position_embeddings": 1024}}


def test_the_hubs_config_reads_as_transformers_reads_it():
    """The hub's names (``num_experts``, ``linear_attn_config``' 1-based blocks and shapes, ...) read
    as transformers' KimiLinearConfig reads them; a YaRN ``rope_scaling`` changes nothing (no block
    rotates, and transformers scales scores by the head size alone)."""
    from transformers import KimiLinearConfig
    config = config_from_dict(HUB_CONFIG)
    theirs = KimiLinearConfig(**{k: v for k, v in HUB_CONFIG.items() if k != "model_type"})
    kinds = ["linear_attention" if i in config.deltanet.layers else "full_attention" for i in range(6)]
    assert kinds == theirs.layer_types and config.attention_layers == (3, 5)
    dense = ["dense" if i in config.moe.dense_layers else "sparse" for i in range(6)]
    assert dense == theirs.mlp_layer_types
    m, d = config.moe, config.deltanet
    assert (m.num_experts, m.top_k, m.shared_expert_size, m.normalize_top_k, m.groups, m.top_groups) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, theirs.n_shared_experts * 1024, theirs.norm_topk_prob,
        theirs.n_group, theirs.topk_group)
    assert (d.num_value_heads, d.key_head_dim, d.conv_kernel, d.gate_rank) == (
        theirs.linear_num_heads, theirs.linear_head_dim, theirs.linear_conv_kernel_dim, theirs.linear_head_dim)
    assert config.max_position_embeddings == theirs.max_position_embeddings == 4096
    assert config.query_pre_attn_scalar is None and config.mla.qk_head_dim == 192
    assert config_from_dict(theirs.to_dict()) == config  # as transformers writes it back


@pytest.mark.parametrize("change, message", [
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func = 'softmax' is not supported"),
    ({"moe_layer_freq": 2}, "moe_layer_freq = 2 is not supported"),
    ({"mla_use_nope": False}, "mla_use_nope = False is not supported"),
    ({"mla_use_output_gate": True}, "mla_use_output_gate = True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
    ({"linear_attn_config": {"full_attn_layers": [7], "kda_layers": [1, 2, 3, 4, 5, 6]}},
     "linear_attn_config.full_attn_layers = \\[7\\] is not supported"),
    ({"linear_attn_config": {"full_attn_layers": [], "kda_layers": [1, 2, 3, 4, 5, 6]}}, "layer_types"),
    ({"linear_attn_config": {**HUB_CONFIG["linear_attn_config"], "gate_lower_bound": -5.0}},
     "linear_attn_config.gate_lower_bound = -5.0 is not supported"),
    ({"linear_attn_config": {**HUB_CONFIG["linear_attn_config"], "use_full_rank_gate": True}},
     "linear_attn_config.use_full_rank_gate = True is not supported"),
])
def test_a_config_the_reader_does_not_handle_is_one_line_naming_the_field(change, message):
    with pytest.raises(UserError, match=message) as caught:
        config_from_dict({**HUB_CONFIG, **change})
    assert "\n" not in str(caught.value)


def test_the_hubs_tensor_names_load_as_save_pretrained_ones(checkpoint, tmp_path):
    """The hub's checkpoint holds a dense block's MLP under ``mlp`` (transformers' save_pretrained
    writes it under ``block_sparse_moe``, as the experts are); an A_log saved as one axis of heads
    (Gated DeltaNet's shape) loads as its [1, 1, H, 1] does."""
    from safetensors.numpy import load_file
    tensors = load_file(f"{checkpoint}/model.safetensors")
    for layer in (0, 2):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            block = f"model.layers.{layer}"
            tensors[f"{block}.mlp.{proj}.weight"] = tensors.pop(f"{block}.block_sparse_moe.{proj}.weight")
        tensors[f"model.layers.{layer}.self_attn.A_log"] = tensors[f"model.layers.{layer}.self_attn.A_log"].reshape(-1)
    assert_tensors_load_as_the_checkpoint(checkpoint, tensors, tmp_path / "hub")
