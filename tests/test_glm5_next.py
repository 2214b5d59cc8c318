"""GLM-5-next (hyper-connections around Kimi Delta Attention and latent attention with a pooled
indexer, DeepSeek-V3's experts, clamped SwiGLUs) through the one decoder: every block of a padded
batch, and every site (the streams, their collapses, write weights and mixing matrices, the chosen
keys, the routing) through the runner on a 2d mesh, against transformers' float64 forward; greedy
generation; steering what a sublayer reads of the streams; the reader's refusals. (One
hyper-connection against transformers' module: tests/test_hyper.py; the pooled indexer alone:
tests/test_indexer.py.)"""

import jax
import numpy as np
import pytest

from common.cli import UserError
from fixtures.hf_reference import (assert_blocks_equal_transformers, assert_family_greedy_equals_transformers,
                                   block_sites, random_sequences)
from model.families import config_from_dict, load_config
from model.sites import (EXPERT_INDICES, HYPER_SITES, INDEXED_KEYS, RESID_POST, ROUTING_WEIGHTS, array_key,
                         missing_reason)
from tests.conftest import run_in_process
from tests.test_family_runs import assert_equals_transformers, runner, write_stream
from tests.test_granite4 import assert_routing_equals_transformers
from tests.test_multihost import stored

LENGTHS = [100, 37, 70]  # one bucket of 128: two delta-rule chunks of 64 for the longest, padding in every row
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """3 streams; Kimi Delta Attention on 0, 3, 4, indexed latent attention on 1, 2 (reusing 1's
    keys), 5; dense MLPs on 0, 2, 5 (``fixtures.tiny_models``), as save_pretrained writes it (the
    hub's names: hc_attn_fn, the experts one by one, q's, k's and v's convolutions apart)."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("glm5_next"), "glm5_next", seed=4)


@slow
def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoint, one_torch_thread):
    config = load_config(checkpoint)
    assert config.hyper.streams == 3 and config.residual_width == 3 * config.hidden_size
    assert config.deltanet.layers == (0, 3, 4) and config.attention_layers == (1, 2, 5)
    assert config.deltanet.decay_lower_bound == -5.0 and config.mla.indexer.shared_layers == (2,)
    assert all(config.rope_of(i) is None for i in range(6))
    assert_blocks_equal_transformers(checkpoint, random_sequences(LENGTHS, seed=3, vocab=config.vocab_size))


@slow
def test_every_site_and_the_routing_through_the_runner_on_a_2d_mesh(checkpoint, tmp_path, one_torch_thread):
    """Every site of an indexed block and a Kimi Delta Attention block with experts (1, 3): the
    streams flattened [tokens, 3 x hidden], the collapses, write weights and mixing matrices; the
    experts in expert order (transformers' top-k leaves its order open)."""
    assert_every_stream_site_and_the_routing_equal_transformers(checkpoint, tmp_path, [1, 3])


def assert_every_stream_site_and_the_routing_equal_transformers(checkpoint: str, tmp_path, layers: list[int]) -> None:
    """Every site but the inside ones at ``layers`` of a model of 3 hyper-connection streams, through the
    runner on a 2d mesh, equal to transformers' float64 forward (the routing in expert order)."""
    config = load_config(checkpoint)
    routing = (EXPERT_INDICES, ROUTING_WEIGHTS)
    sites = [site for site in block_sites(config, layers) if site not in routing]
    assert {site for site in HYPER_SITES if missing_reason(site, config) is None} <= set(sites)
    records = write_stream(tmp_path / "stream.jsonl", checkpoint, count=4)
    result = run_in_process("runners.tpu_host", *runner(
        tmp_path / "stream.jsonl", tmp_path / "out", checkpoint, "--sites", ",".join([*sites, *routing]),
        "--layers_to_extract", ",".join(map(str, layers)), "--mesh_type", "2d"))
    assert result.returncode == 0, result.stderr[-3000:]
    got = stored(tmp_path / "out" / "machine_000")
    assert all(arrays[array_key(RESID_POST, layers[-1])].shape[1] == 3 * config.hidden_size
               for arrays in got.values())
    plain = {i: {k: v for k, v in arrays.items() if not str(k).endswith(routing)} for i, arrays in got.items()}
    assert_equals_transformers(checkpoint, records, plain, sites, layers)
    assert_routing_equals_transformers(checkpoint, records, got, layers)


@slow
def test_the_pooled_choice_of_keys_equals_transformers_and_a_shared_block_reuses_it(checkpoint, one_torch_thread):
    """The keys blocks 1 and 5 chose (their 2 best pools of 4, each pool's keys ascending, then the
    visible keys after the last complete pool) equal transformers' indexer's; block 2 attends to
    block 1's."""
    from fixtures.hf_reference import load_reference, reference_sites
    from model.extract import Extractor
    sequences = random_sequences(LENGTHS, seed=3, vocab=load_config(checkpoint).vocab_size)
    extractor = Extractor.load(checkpoint, layers=(1, 2, 5), dtype="float32", max_seq_length=128, min_bucket=128,
                               batch_size_per_device=3, devices=jax.devices()[:1], sites=[INDEXED_KEYS])
    ours = dict(extractor.extract(enumerate(sequences)))
    theirs = reference_sites(load_reference(checkpoint, "float64"), sequences, [(INDEXED_KEYS, 1), (INDEXED_KEYS, 5)])
    for i, sequence in enumerate(sequences):
        chosen = lambda layer, i=i: ours[i][array_key(INDEXED_KEYS, layer)]  # [S, 8 + 3]
        for layer in (1, 5):  # the pools in either order where their scores tie (relu's exact zeros)
            np.testing.assert_array_equal(pools_sorted(chosen(layer)), pools_sorted(theirs[i][INDEXED_KEYS, layer]))
        np.testing.assert_array_equal(chosen(2), chosen(1))
        seen = np.arange(8, len(sequence)) + 1  # the keys query q sees, from q = 8 on: two whole pools at least
        assert chosen(1).shape == (len(sequence), 11) and ((chosen(1) >= 0).sum(-1)[8:] == 8 + seen % 4).all()
        assert (chosen(1) != chosen(5)).any()


def pools_sorted(ids: np.ndarray, pool: int = 4, pools: int = 2) -> np.ndarray:
    """Chosen keys [S, pools * pool + tail] with each query's pools in ascending order, its tail as it is."""
    chosen = ids[:, :pool * pools].reshape(len(ids), pools, pool)
    order = np.argsort(np.where(chosen[:, :, 0] < 0, np.iinfo(np.int32).max, chosen[:, :, 0]), axis=1, kind="stable")
    ordered = np.take_along_axis(chosen, order[:, :, None], axis=1).reshape(len(ids), -1)
    return np.concatenate([ordered, ids[:, pool * pools:]], axis=1)


@slow
def test_transformers_tensor_names_load_as_the_hubs_and_bfloat16_keeps_what_transformers_keeps(checkpoint, tmp_path,
                                                                                              one_torch_thread):
    """The names transformers renames the hub's to (attn_hc.fn, forget_gate.*, one conv1d of q | k | v)
    load as the hub's; in bfloat16 the convolutions, A_log, dt_bias and the hyper-connections' biases
    and scales are held in float32 (transformers' _keep_in_fp32_modules_strict), fn and the rest not."""
    from safetensors.numpy import load_file
    from model.loading import load_model
    from tests.test_family_runs import assert_tensors_load_as_the_checkpoint
    tensors = load_file(f"{checkpoint}/model.safetensors")
    for layer in range(6):
        block = f"model.language_model.layers.{layer}"
        for ours, theirs in (("hc_attn_", "attn_hc."), ("hc_ffn_", "ffn_hc.")):
            for leaf in ("fn", "base", "scale"):
                tensors[f"{block}.{theirs}{leaf}"] = tensors.pop(f"{block}.{ours}{leaf}")
        if f"{block}.self_attn.A_log" in tensors:  # a Kimi Delta Attention block
            for name in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
                tensors[f"{block}.self_attn.forget_gate.{name}"] = tensors.pop(f"{block}.self_attn.{name}")
            tensors[f"{block}.self_attn.conv1d.weight"] = np.concatenate(
                [tensors.pop(f"{block}.self_attn.{part}_conv1d.weight") for part in "qkv"])
    assert_tensors_load_as_the_checkpoint(checkpoint, tensors, tmp_path / "renamed")
    params = load_model(checkpoint, "bfloat16", devices=jax.devices()[:1]).params
    mixer, hc = params["layers_0"]["linear_attn"], params["layers_1"]["attn_hc"]
    assert {name: str(mixer[name].dtype) for name in ("dt_bias", "A_log", "conv_q", "conv_v", "norm")} == {
        "dt_bias": "float32", "A_log": "float32", "conv_q": "float32", "conv_v": "float32", "norm": "bfloat16"}
    assert (hc["fn"].dtype, hc["base"].dtype, hc["scale"].dtype) == (jax.numpy.bfloat16, np.float32, np.float32)


@slow
def test_bfloat16_with_a_float32_stream_is_closer_than_transformers_bfloat16(checkpoint, one_torch_thread):
    from fixtures.hf_reference import bfloat16_error_ratios, relative_error
    from model.extract import Extractor
    sequences = random_sequences(LENGTHS, seed=3, vocab=load_config(checkpoint).vocab_size)
    extractor = Extractor.load(checkpoint, dtype="bfloat16", residual_dtype="float32", activation_dtype="float32",
                               max_seq_length=128, min_bucket=128, batch_size_per_device=3, devices=jax.devices()[:1])
    mine = dict(extractor.extract(enumerate(sequences)))
    # Over all tokens: in any bfloat16 forward near-tie tokens go to other experts and queries to other pools,
    # which at the first indexed block with experts (1) is most of either's error (measured 0.0146 vs 0.016),
    # so the bound is transformers' own error there; the stream in float32 keeps the later blocks at 0.7.
    ratios = bfloat16_error_ratios(checkpoint, sequences, mine, error=relative_error)
    assert all(ratio <= 1.0 for ratio in ratios.values()) and max(ratios[layer] for layer in (2, 3, 4, 5)) <= 0.85, \
        ratios


@slow
def test_greedy_generation_equals_transformers(tmp_path, one_torch_thread):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch (wide weights: peaked logits):
    the delta rule's state and the pooled index keys carried, each continuation equal to
    transformers' generate of its prompt alone."""
    assert_family_greedy_equals_transformers(tmp_path / "varied", "glm5_next", initializer_range=0.5)


@slow
def test_steering_what_attention_reads_equals_transformers_with_the_collapse_edited(checkpoint, tmp_path,
                                                                                     one_torch_thread):
    """A direction added to block 3's hc_attn.hook_collapse (what its mixer's norm reads) moves
    every later block as adding it to transformers' attn_hc collapse does."""
    import torch
    from fixtures.hf_reference import decoder_blocks, load_reference, reference_activations, relative_error
    from activations.directions import write_directions
    from interventions.resolve import ablation_source
    from model.extract import Extractor
    from model.sites import HC_ATTN_COLLAPSE
    config = load_config(checkpoint)
    direction = np.random.default_rng(0).normal(size=config.hidden_size).astype(np.float32)
    path = str(tmp_path / "directions.npz")
    write_directions(path, {("diff_in_means", array_key(HC_ATTN_COLLAPSE, 3)): direction}, {})
    sequences = random_sequences(LENGTHS[1:], seed=3, vocab=config.vocab_size)
    extractor = Extractor.load(checkpoint, dtype="float32", max_seq_length=128, min_bucket=128,
                               batch_size_per_device=2, devices=jax.devices()[:1],
                               ablation=ablation_source(f"steer:3:{path}:site={HC_ATTN_COLLAPSE}:alpha=2", None))
    ours = dict(extractor.extract(enumerate(sequences)))
    reference = load_reference(checkpoint, "float64")
    edit = lambda module, inputs, output: (*output[:2], output[2] + 2 * torch.tensor(direction, dtype=output[2].dtype))
    handle = decoder_blocks(reference)[3].attn_hc.register_forward_hook(edit)
    theirs = reference_activations(reference, sequences)
    handle.remove()
    for i in range(len(sequences)):
        for layer in (3, 5):
            assert relative_error(ours[i][layer], theirs[i][layer]) <= 1e-5


@slow
def test_ablations_act_on_every_stream_as_transformers_with_the_sublayer_zeroed(checkpoint, one_torch_thread):
    """Attention of block 1 removed (its output zero: the streams still mixed) equals transformers
    with that output zeroed; block 3 skipped passes its input streams on unchanged."""
    assert_attention_removed_and_block_skipped_equal_transformers(checkpoint, LENGTHS[1:])


def assert_attention_removed_and_block_skipped_equal_transformers(checkpoint: str, lengths: list[int],
                                                                  attention: int = 1, compared=(1, 5),
                                                                  skipped: int = 3) -> None:
    """Ours with block ``attention``'s attention removed equals transformers with its output zeroed
    (at blocks ``compared``); block ``skipped`` outputs the block before's streams (a model of
    hyper-connections)."""
    import torch
    from fixtures.hf_reference import decoder_blocks, load_reference, reference_activations, relative_error
    from interventions.resolve import ablation_source
    from model.extract import Extractor
    sequences = random_sequences(lengths, seed=3, vocab=load_config(checkpoint).vocab_size)
    run = lambda spec: dict(Extractor.load(checkpoint, dtype="float32", max_seq_length=128, min_bucket=128,
                                           batch_size_per_device=2, devices=jax.devices()[:1],
                                           ablation=ablation_source(spec, None)).extract(enumerate(sequences)))
    ours, passed = run(f"attn:{attention}"), run(f"layer:{skipped}")
    reference = load_reference(checkpoint, "float64")
    zero = lambda module, inputs, output: (torch.zeros_like(output[0]), *output[1:])
    handle = decoder_blocks(reference)[attention].self_attn.register_forward_hook(zero)
    theirs = reference_activations(reference, sequences)
    handle.remove()
    for i in range(len(sequences)):
        assert all(relative_error(ours[i][layer], theirs[i][layer]) <= 1e-5 for layer in compared)
        np.testing.assert_array_equal(passed[i][skipped], passed[i][skipped - 1])


# GLM-5.3-Flash's text_config keys that matter, cut to 8 blocks, moved off transformers' defaults where they
# can be, with the hub's linear_attn_config beside the top-level names (the nested ones win, as there).
HUB_CONFIG = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
              "tie_word_embeddings": False, "text_config": {
                  "model_type": "glm5_next_text", "vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 6144,
                  "moe_intermediate_size": 768, "num_hidden_layers": 8, "num_attention_heads": 32,
                  "num_key_value_heads": 32, "kv_lora_rank": 384, "q_lora_rank": 1024, "qk_nope_head_dim": 192,
                  "qk_rope_head_dim": 0, "v_head_dim": 192, "n_routed_experts": 96, "num_experts_per_tok": 6,
                  "n_shared_experts": 2, "routed_scaling_factor": 2.0, "norm_topk_prob": True, "index_topk": 1024,
                  "index_head_dim": 64, "index_n_heads": 16, "index_kpool": 8, "index_kpool_always_select_tail": False,
                  "index_topk_pattern": "FFFFFFSF", "swiglu_limit": 7.0, "hc_mult": 2, "hc_sinkhorn_iters": 10,
                  "hc_eps": 1e-5, "rms_norm_eps": 1e-6, "linear_num_heads": 48,
                  "linear_attn_config": {"num_heads": 24, "head_dim": 64, "short_conv_kernel_size": 3,
                                         "gate_lower_bound": -4.0},
                  "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention",
                                  "linear_attention", "full_attention", "full_attention", "linear_attention"],
                  "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse", "sparse", "sparse", "sparse"]}}


def test_the_hubs_config_reads_as_transformers_reads_it():
    """``full_attention`` is ``indexed_attention``, the nested linear_attn_config wins, the pattern
    gives the shared block, the wrapper decides the head's tying; written back by transformers, it
    reads the same."""
    from transformers import Glm5NextConfig
    config = config_from_dict(HUB_CONFIG)
    theirs = Glm5NextConfig(**{k: v for k, v in HUB_CONFIG.items() if k != "model_type"}).text_config
    assert [("linear_attention" if config.is_deltanet(i) else "indexed_attention") for i in range(8)] == \
        theirs.layer_types
    m, d, ix, hc = config.moe, config.deltanet, config.mla.indexer, config.hyper
    assert (m.num_experts, m.top_k, m.shared_expert_size, m.swiglu_limit, config.swiglu_limit) == (
        96, 6, 2 * 768, theirs.swiglu_limit, 7.0) and m.dense_layers == (0, 1)
    assert (d.num_value_heads, d.key_head_dim, d.conv_kernel, d.decay_lower_bound) == (
        theirs.linear_num_heads, theirs.linear_head_dim, theirs.linear_conv_kernel_dim, theirs.linear_lower_bound)
    assert (ix.topk, ix.pool, ix.pool_tail, ix.width, ix.shared_layers) == (1024, 8, False, 1024, (6,))
    assert ["shared" if i in ix.shared_layers else "full" for i in range(8)] == theirs.indexer_types
    assert (hc.streams, hc.sinkhorn_iters, hc.eps, hc.norm_eps) == (2, 10, 1e-5, 1e-6)
    assert config.mla.norm_eps == 1e-6 and config.query_pre_attn_scalar is None and not config.tie_word_embeddings
    assert config_from_dict(Glm5NextConfig(**{k: v for k, v in HUB_CONFIG.items() if k != "model_type"})
                            .to_dict()) == config  # as transformers writes it back


def _with(**text):
    return {**HUB_CONFIG, "text_config": {**HUB_CONFIG["text_config"], **text}}


@pytest.mark.parametrize("raw, message", [
    (_with(qk_rope_head_dim=64), "qk_rope_head_dim = 64 is not supported: GLM-5-next's latent attention does not "
                                 "rotate"),
    (_with(hidden_act="gelu"), "hidden_act = 'gelu' is not supported"),
    (_with(hc_mult=1), "hc_mult = 1 is not supported: hyper-connections have 2 or more streams"),
    (_with(index_topk_pattern="FFFSFFFF"), "indexer_types = .* block 3 reuses a choice of keys, but the block before "
                                           "it is no indexed attention block"),
    (_with(index_topk_pattern="FFFFFSSF", layer_types=["linear_attention"] * 3 + ["full_attention"] * 5),
     "block 6 reuses a choice of keys, but the block before it is no indexed attention block with an indexer"),
    (_with(q_lora_rank=None), "q_lora_rank = None is not supported: the indexer reads the low-rank query"),
    (_with(index_kpool=24), "index_kpool = 24 is not supported"),
    (_with(linear_attn_config={"gate_lower_bound": 1.0}), "linear_lower_bound = 1.0 is not supported"),
    (_with(layer_types=["linear_attention"] * 8), "layer_types"),
    ({**HUB_CONFIG["text_config"], "architectures": ["Glm5NextTextModel"]},
     "a GLM-5-next text model alone has no LM head in transformers"),
])
def test_a_config_the_reader_does_not_handle_is_one_line_naming_the_field(raw, message):
    with pytest.raises(UserError, match=message) as caught:
        config_from_dict(raw)
    assert "\n" not in str(caught.value)


def test_a_collapse_site_of_a_model_of_one_stream_is_refused_in_one_line():
    from model.sites import HC_MLP_MIX, check_sites
    with pytest.raises(UserError, match="hc_mlp.hook_mix: qwen3 has one residual stream") as caught:
        check_sites([HC_MLP_MIX], config_from_dict({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    assert "\n" not in str(caught.value)
