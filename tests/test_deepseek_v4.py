"""DeepSeek-V4 (one key/value head through a sliding window beside compressed entries of the past:
every closed one, or an indexer's choice; hyper-connections with a weighted final collapse; hash and
sqrt-softplus routed experts) through the one decoder: every block of a padded batch, and every site
(the streams, the chosen entries, the routing) through the runner on a 2d mesh, against transformers'
float64 forward; greedy generation with the compressors' projections carried; ablation; the reader's
refusals."""

import jax
import numpy as np
import pytest

from common.cli import UserError
from fixtures.hf_reference import (assert_blocks_equal_transformers, assert_family_greedy_equals_transformers,
                                   random_sequences)
from model.config import CSA, HCA, SLIDING_ONLY
from model.families import config_from_dict, load_config
from model.sites import EXPERT_INDICES, INDEXED_KEYS, RESID_POST, array_key
from tests.test_glm5_next import (assert_attention_removed_and_block_skipped_equal_transformers,
                                  assert_every_stream_site_and_the_routing_equal_transformers)

LENGTHS = [100, 37, 70]  # one bucket of 128: 12 heavily compressed entries (of 8) and 25 compressed sparse (of 4)
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """3 streams; heavily compressed attention on 0 and 4, compressed sparse on 1 and 3, the window
    alone on 2 and 5; hash-routed experts on 0 and 1 (``fixtures.tiny_models``), as save_pretrained
    writes it (the hub's names: attn.wq_a, hc_attn_fn, the experts one by one)."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("deepseek_v4"), "deepseek_v4", seed=4)


@slow
def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoint, one_torch_thread):
    config = load_config(checkpoint)
    assert config.compressed.kinds == (HCA, CSA, SLIDING_ONLY, CSA, HCA, SLIDING_ONLY)
    assert config.moe.hash_layers == (0, 1) and config.hyper.head == "weighted"
    assert config.rope_of(0).kind == "yarn" and config.rope_of(2).kind == "default"
    assert_blocks_equal_transformers(checkpoint, random_sequences(LENGTHS, seed=3, vocab=config.vocab_size))


@slow
def test_every_site_and_the_routing_through_the_runner_on_a_2d_mesh(checkpoint, tmp_path, one_torch_thread):
    """Every site of a compressed sparse block with hash-routed experts (1) and a heavily compressed
    one routed by scores (4): the streams, their collapses, write weights and mixing matrices, the
    routing (the experts in expert order: transformers' top-k leaves its order open)."""
    assert_every_stream_site_and_the_routing_equal_transformers(checkpoint, tmp_path, [1, 4])


@slow
def test_the_chosen_entries_equal_transformers_and_only_closed_windows_are_chosen(checkpoint, one_torch_thread):
    """Blocks 1 and 3 choose the indexer's 3 best closed entries, best first, as transformers'
    indexer does; a query at p has (p + 1) // 4 closed windows to choose from."""
    from fixtures.hf_reference import load_reference, reference_sites
    from model.extract import Extractor
    sequences = random_sequences(LENGTHS, seed=3, vocab=load_config(checkpoint).vocab_size)
    extractor = Extractor.load(checkpoint, layers=(1, 3), dtype="float32", max_seq_length=128, min_bucket=128,
                               batch_size_per_device=3, devices=jax.devices()[:1], sites=[INDEXED_KEYS])
    ours = dict(extractor.extract(enumerate(sequences)))
    theirs = reference_sites(load_reference(checkpoint, "float64"), sequences, [(INDEXED_KEYS, 1), (INDEXED_KEYS, 3)])
    for i, sequence in enumerate(sequences):
        for layer in (1, 3):
            chosen = ours[i][array_key(INDEXED_KEYS, layer)]                             # [S, 3]
            np.testing.assert_array_equal(chosen, theirs[i][INDEXED_KEYS, layer])
            closed = (np.arange(len(sequence)) + 1) // 4
            assert ((chosen >= 0).sum(-1) == np.minimum(closed, 3)).all() and (chosen < closed[:, None]).all()
        assert (ours[i][array_key(INDEXED_KEYS, 1)] != ours[i][array_key(INDEXED_KEYS, 3)]).any()


@slow
def test_greedy_generation_equals_transformers(tmp_path, one_torch_thread):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch (wide weights: peaked logits):
    the compressors' and the indexer's projections carried, windows closing while writing, each
    continuation equal to transformers' generate of its prompt alone."""
    assert_family_greedy_equals_transformers(tmp_path / "varied", "deepseek_v4", initializer_range=0.5)


@slow
def test_ablating_attention_and_skipping_a_block_equal_transformers(checkpoint, one_torch_thread):
    """Attention of block 1 removed (its output zero: the streams still mixed) equals transformers
    with that output zeroed; block 3 skipped passes its input streams on unchanged."""
    assert_attention_removed_and_block_skipped_equal_transformers(checkpoint, LENGTHS[1:])


# DeepSeek-V4-Flash's config.json keys that matter, cut to 6 blocks, as the hub writes them (compress_ratios per
# block, num_hash_layers, a flat YaRN rope_scaling for the compressed blocks; its FP8: tests/test_deepseek_v4_hub.py).
HUB_CONFIG = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
              "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 64,
              "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
              "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 256, "n_shared_experts": 1,
              "num_experts_per_tok": 6, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
              "norm_topk_prob": True, "num_hash_layers": 3, "compress_ratios": [0, 0, 4, 128, 4, 128],
              "compress_rope_theta": 160000, "rope_theta": 10000, "sliding_window": 128, "hc_mult": 4,
              "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
              "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576,
              "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                               "beta_fast": 32, "beta_slow": 1}}


def test_the_hubs_config_reads_as_transformers_reads_it():
    """compress_ratios give the blocks' kinds, num_hash_layers the hash-routed blocks, the flat YaRN
    parameters the compressed blocks' rotary only (cos and sin unscaled); written back by
    transformers, it reads the same."""
    from transformers import DeepseekV4Config
    config = config_from_dict(HUB_CONFIG)
    theirs = DeepseekV4Config(**{k: v for k, v in HUB_CONFIG.items() if k != "model_type"})
    ca, moe = config.compressed, config.moe
    assert list(ca.kinds) == theirs.layer_types and (ca.csa_rate, ca.hca_rate) == (4, 128)
    assert ["hash_moe" if i in moe.hash_layers else "moe" for i in range(6)] == theirs.mlp_layer_types
    assert (ca.rope_dim, config.rotary_dim, ca.output_groups, ca.output_rank) == (theirs.qk_rope_head_dim, 64, 8, 1024)
    assert (ca.rope.kind, ca.rope.theta, ca.rope.factor, ca.rope.attention_factor) == ("yarn", 160000.0, 16.0, 1.0)
    assert (config.rope.kind, config.rope.theta) == ("default", 10000.0)
    assert (moe.num_experts, moe.top_k, moe.shared_expert_size, moe.scoring) == (256, 6, 2048, "sqrtsoftplus")
    assert (config.hyper.streams, config.num_key_value_heads, config.sliding_window) == (4, 1, 128)
    assert config_from_dict(theirs.to_dict()) == config  # as transformers writes it back
    narrower = {**HUB_CONFIG, "qk_rope_head_dim": 32}  # the hub's rotated dims without a factor
    assert config_from_dict(narrower).compressed.rope_dim == DeepseekV4Config(
        **{k: v for k, v in narrower.items() if k != "model_type"}).qk_rope_head_dim == 32


@pytest.mark.parametrize("raw, message", [
    ({**HUB_CONFIG, "quantization_config": {"quant_method": "mxfp4"}}, "quantization_config .mxfp4. is not supported"),
    ({**HUB_CONFIG, "num_key_value_heads": 2}, "num_key_value_heads = 2 is not supported: one key/value head"),
    ({**HUB_CONFIG, "scoring_func": "softmax"}, "scoring_func = 'softmax' is not supported"),
    ({**HUB_CONFIG, "compress_ratios": [0, 0, 4, 64, 4, 128]}, "compress_ratios = .* is not supported"),
    ({**HUB_CONFIG, "o_groups": 7}, "o_groups = 7 is not supported: the heads' outputs"),
    ({**HUB_CONFIG, "n_shared_experts": 2}, "n_shared_experts = 2 is not supported"),
    ({**HUB_CONFIG, "hc_mult": 1}, "hc_mult = 1 is not supported: hyper-connections have 2 or more streams"),
    ({**HUB_CONFIG, "mlp_layer_types": ["moe"] * 5}, "mlp_layer_types = .* is not supported"),
    ({**HUB_CONFIG, "index_topk": 0}, "index_topk = 0 is not supported: a positive number"),
    ({**HUB_CONFIG, "rope_parameters": {"main": {"rope_type": "default", "partial_rotary_factor": 0.25},
                                        "compress": {"rope_type": "default"}}},
     "rope_parameters.main.partial_rotary_factor = 0.25 is not supported: both rotaries rotate the same 64"),
])
def test_a_config_the_reader_does_not_handle_is_one_line_naming_the_field(raw, message):
    with pytest.raises(UserError, match=message) as caught:
        config_from_dict(raw)
    assert "\n" not in str(caught.value)


def test_a_head_site_and_an_indexer_at_a_block_without_one_are_refused_in_one_line():
    from model.sites import ATTN_Q, check_sites
    config = config_from_dict(HUB_CONFIG)
    for site, layer, message in ((ATTN_Q, 2, "reads one key/value head beside compressed entries"),
                                 (INDEXED_KEYS, 3, "block 3's attention is heavily_compressed_attention: no indexer")):
        with pytest.raises(UserError, match=message) as caught:
            check_sites([site], config, [layer])
        assert "\n" not in str(caught.value)


@slow
def test_bfloat16_keeps_what_transformers_keeps_and_with_a_float32_stream_is_closer_than_transformers(
        checkpoint, one_torch_thread):
    """In bfloat16 the sinks, the compressors' position biases, the choice bias and the final collapse
    are held in float32 (transformers' _keep_in_fp32_modules_strict) and the hash table as integers;
    the forward with a float32 stream is no further from transformers' float64 than its bfloat16."""
    from safetensors.numpy import load_file
    from fixtures.hf_reference import bfloat16_error_ratios, tokens_routed_alike
    from model.extract import Extractor
    from model.loading import load_model
    params = load_model(checkpoint, "bfloat16", with_head=True, devices=jax.devices()[:1]).params
    attn, mlp = params["layers_1"]["self_attn"], params["layers_1"]["mlp"]
    assert {str(x.dtype) for x in (attn["sinks"], attn["compressor"]["position_bias"],
                                   attn["indexer"]["compressor"]["position_bias"], params["layers_3"]["mlp"][
                                       "selection_bias"], *params["hc_head"].values())} == {"float32"}
    assert attn["q_b_proj"]["kernel"].dtype == jax.numpy.bfloat16 and mlp["tid2eid"].dtype == np.int32
    table = load_file(f"{checkpoint}/model.safetensors")["model.layers.1.ffn.gate.tid2eid"]
    np.testing.assert_array_equal(np.asarray(mlp["tid2eid"]), table)
    sequences = random_sequences(LENGTHS, seed=3, vocab=load_config(checkpoint).vocab_size)
    run = lambda sites, layers=None: dict(Extractor.load(
        checkpoint, layers=layers, dtype="bfloat16", residual_dtype="float32", activation_dtype="float32",
        max_seq_length=128, min_bucket=128, batch_size_per_device=3, devices=jax.devices()[:1],
        sites=sites).extract(enumerate(sequences)))
    mine, entries = run((EXPERT_INDICES, RESID_POST)), run((INDEXED_KEYS,), (1, 3))
    # Over each sequence's tokens before the first that some forward sends to other experts or entries than
    # float64 does: a token near a tie goes either way in any bfloat16 forward (5 of 207 choose other entries at
    # block 3), and its error, which reaches the later tokens through attention (0.6 before it, 0.9 at block 5
    # over all tokens routed alike), would measure which way it fell, not the arithmetic.
    alike = tokens_routed_alike(checkpoint, sequences, mine, 6) & entries_chosen_alike(checkpoint, sequences, entries)
    starts = np.cumsum([0, *map(len, sequences)])
    kept = np.concatenate([np.cumprod(alike[a:b]).astype(bool) for a, b in zip(starts[:-1], starts[1:])])
    ratios = bfloat16_error_ratios(checkpoint, sequences, mine, kept)
    assert kept.sum() >= 30 and max(ratios.values()) <= 0.7, (kept.sum(), ratios)


def entries_chosen_alike(model_dir: str, sequences: list[list[int]], ours: dict) -> np.ndarray:
    """[tokens of every sequence]: whether transformers' float64 and bfloat16 forwards and ours choose
    the same compressed entries (in any order) at every compressed sparse block."""
    from fixtures.hf_reference import load_reference, reference_sites
    places = [(INDEXED_KEYS, layer) for layer in (1, 3)]
    found = [reference_sites(load_reference(model_dir, dtype), sequences, places) for dtype in ("float64", "bfloat16")]
    chosen = lambda per_sequence: np.sort(np.concatenate(per_sequence), axis=-1)  # [tokens, topk]
    kept = np.ones(sum(map(len, sequences)), bool)
    for place in places:
        exact = chosen([f[place] for f in found[0]])
        for other in ([f[place] for f in found[1]], [ours[i][array_key(*place)] for i in range(len(sequences))]):
            kept &= (chosen(other) == exact).all(-1)
    return kept
