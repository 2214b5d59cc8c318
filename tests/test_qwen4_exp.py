"""Qwen4-Exp (Gated DeltaNet, some blocks adding hashed n-gram embeddings to the streams first;
attention whose keys a QSA indexer chooses in mean-pooled blocks; a gated residual of 3 streams with
no norms in the blocks and a gated final collapse instead of the final norm; experts in every block)
through the one decoder: every block of a padded batch, every site (the streams, the n-gram
addition, the routing) through the runner on a 2d mesh, the chosen keys, against transformers'
float64 forward; greedy generation with the n-gram and indexer state carried; ablation; the reader's
refusals."""

import jax
import numpy as np
import pytest

from common.cli import UserError
from fixtures.hf_reference import (assert_blocks_equal_transformers, assert_family_greedy_equals_transformers,
                                   block_sites, random_sequences)
from model.families import config_from_dict, load_config
from model.sites import ATTN_OUT, ATTN_Z, HC_ATTN_MIX, INDEXED_KEYS, NGRAM_OUT, array_key, missing_reason

LENGTHS = [100, 37, 70]  # one bucket of 128: up to 25 pools of 4, 3 chosen; past the delta rule's chunk of 64
EOS = 3  # the tiny config's eos_token_id: it ends an n-gram's segment
slow = pytest.mark.slow


def sequences_with_segments(vocab: int) -> list[list[int]]:
    """``LENGTHS`` random sequences with an eos every 23 tokens: several n-gram segments each."""
    return [[EOS if i % 23 == 22 else token for i, token in enumerate(sequence)]
            for sequence in random_sequences(LENGTHS, seed=3, vocab=vocab)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Gated DeltaNet with n-gram embeddings on 0 and 3, alone on 1, 4 and 6; attention with QSA on 2
    and 5 (``fixtures.tiny_models``), as save_pretrained writes it (the n-gram tables in 2 row shards)."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("qwen4_exp"), "qwen4_exp", seed=4)


@slow
def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoint, one_torch_thread):
    config = load_config(checkpoint)
    assert config.deltanet.layers == (0, 1, 3, 4, 6) and config.ngram.layers == (0, 3)
    assert (config.hyper.kind, config.hyper.streams, config.final_norm, config.pre_norms) == ("gated", 3, False, False)
    assert_blocks_equal_transformers(checkpoint, sequences_with_segments(config.vocab_size))


@slow
def test_every_site_and_the_routing_through_the_runner_on_a_2d_mesh(checkpoint, tmp_path, one_torch_thread):
    """Every site at the n-gram blocks 0 and 3 (the streams, the n-gram addition, the gated collapses
    and write weights, the delta rule's output, the routing in expert order)."""
    from tests.test_glm5_next import assert_every_stream_site_and_the_routing_equal_transformers
    sites = block_sites(load_config(checkpoint), [0, 3])
    assert NGRAM_OUT in sites and HC_ATTN_MIX not in sites
    assert_every_stream_site_and_the_routing_equal_transformers(checkpoint, tmp_path, [0, 3])


@slow
def test_the_chosen_keys_equal_transformers(checkpoint, one_torch_thread):
    """At attention blocks 2 and 5 each query attends to the keys transformers' indexer selects: its
    3 best whole pools of 4 and the keys after its last whole pool (compared as sets: transformers
    returns a mask); ours lists the pools best first; attention's heads and output equal too."""
    from fixtures.hf_reference import load_reference, reference_sites, relative_error
    from model.extract import Extractor
    sequences = sequences_with_segments(load_config(checkpoint).vocab_size)
    sites = [INDEXED_KEYS, ATTN_Z, ATTN_OUT]
    extractor = Extractor.load(checkpoint, layers=(2, 5), dtype="float32", max_seq_length=128, min_bucket=128,
                               batch_size_per_device=3, devices=jax.devices()[:1], sites=sites)
    ours = dict(extractor.extract(enumerate(sequences)))
    theirs = reference_sites(load_reference(checkpoint, "float64"), sequences,
                             [(site, layer) for site in sites for layer in (2, 5)])
    for i, sequence in enumerate(sequences):
        for layer in (2, 5):
            chosen = ours[i][array_key(INDEXED_KEYS, layer)]                             # [S, 15]
            ascending = np.sort(np.where(chosen < 0, len(sequence), chosen), axis=-1)
            np.testing.assert_array_equal(np.where(ascending < len(sequence), ascending, -1),
                                          theirs[i][INDEXED_KEYS, layer])
            whole = (np.arange(len(sequence)) + 1) // 4
            assert ((chosen[:, :12] >= 0).sum(-1) == 4 * np.minimum(whole, 3)).all()
            for site in (ATTN_Z, ATTN_OUT):
                assert relative_error(ours[i][array_key(site, layer)], theirs[i][site, layer]) <= 1e-5
        assert (ours[i][array_key(INDEXED_KEYS, 2)] != ours[i][array_key(INDEXED_KEYS, 5)]).any()


@slow
def test_bfloat16_with_a_float32_stream_is_closer_than_transformers_bfloat16(checkpoint, one_torch_thread):
    """Every block's error (against transformers' float64) under transformers' bfloat16 forward's
    (measured 0.81-0.90; in bfloat16 throughout 0.97-0.98: the same roundings)."""
    from fixtures.hf_reference import bfloat16_error_ratios, relative_error
    from model.extract import Extractor
    sequences = sequences_with_segments(load_config(checkpoint).vocab_size)
    extractor = Extractor.load(checkpoint, dtype="bfloat16", residual_dtype="float32", activation_dtype="float32",
                               max_seq_length=128, min_bucket=128, batch_size_per_device=3, devices=jax.devices()[:1])
    mine = dict(extractor.extract(enumerate(sequences)))
    ratios = bfloat16_error_ratios(checkpoint, sequences, mine, error=relative_error)
    assert all(ratio <= 1.0 for ratio in ratios.values()), ratios


@slow
def test_greedy_generation_equals_transformers(tmp_path, one_torch_thread):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch (wide weights: peaked logits): the
    n-gram context and window, the raw index keys and the delta rule's state carried; each
    continuation equal to transformers' generate of its prompt alone."""
    assert_family_greedy_equals_transformers(tmp_path / "varied", "qwen4_exp", initializer_range=0.5)


@slow
def test_ablating_attention_and_skipping_a_block_equal_transformers(checkpoint, one_torch_thread):
    """Attention of block 2 removed (its output zero: each stream keeps its input) equals transformers
    with that output zeroed, at blocks 2 and 6; block 3 skipped passes its input streams on."""
    from tests.test_glm5_next import assert_attention_removed_and_block_skipped_equal_transformers
    assert_attention_removed_and_block_skipped_equal_transformers(checkpoint, LENGTHS[1:], attention=2, compared=(2, 6))


# A Qwen4-Exp config.json as the multimodal checkpoint would write it, cut to 8 blocks (the released
# values are not in transformers' source: its defaults, with the QSA and n-gram settings set).
HUB_CONFIG = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
              "tie_word_embeddings": False, "text_config": {
                  "model_type": "qwen4_exp_text", "num_hidden_layers": 8, "hc_count": 4, "hc_lowrank": 320,
                  "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
                  "ple_layer_ids": [1, 5], "ple_embed_dim": 2048, "eos_token_id": 248044,
                  "indexer_n_heads": 32, "indexer_kv_heads": 1, "indexer_head_dim": 256, "indexer_budget": 2048,
                  "indexer_compress_ratio": 64, "output_gate_type": "sigmoid"}}


def test_the_hubs_config_reads_as_transformers_reads_it():
    """The wrapper's text model: full_attention read as indexed_attention, ple_layer_ids 1-based, the
    whole head rotated by default; written back by transformers, it reads the same."""
    from transformers import Qwen4ExpConfig
    config = config_from_dict(HUB_CONFIG)
    theirs = Qwen4ExpConfig(**{k: v for k, v in HUB_CONFIG.items() if k != "model_type"}).text_config
    assert [("linear_attention" if config.is_deltanet(i) else "indexed_attention") for i in range(8)] == \
        theirs.layer_types
    assert config.ngram.layers == (0, 4) and config.ngram.heads == 16 and config.ngram.embed_dim == 2048
    assert (config.attention_indexer.topk, config.attention_indexer.pool, config.index_width) == (2048, 64, 2111)
    assert config.rotary_dim is None and config.deltanet.output_gate == "sigmoid"
    assert (config.moe.num_experts, config.moe.top_k, config.moe.shared_expert_size) == (512, 10, 512)
    assert missing_reason(NGRAM_OUT, config, 1) and missing_reason(NGRAM_OUT, config, 4) is None
    assert config_from_dict({**theirs.to_dict(), "architectures": ["Qwen4ExpForCausalLM"]}) == config


TEXT = HUB_CONFIG["text_config"]


@pytest.mark.parametrize("text, message", [
    ({**TEXT, "indexer_kv_heads": 2}, "indexer_kv_heads = 2 is not supported: the indexer has one key head"),
    ({**TEXT, "indexer_budget": 100}, "indexer_budget = 100 is not supported: a multiple of indexer_compress_ratio"),
    ({k: v for k, v in TEXT.items() if k != "indexer_head_dim"}, "indexer_head_dim = None is not supported"),
    ({**TEXT, "ple_layer_ids": [4]}, "ple_layer_ids = .* is not supported: n-gram embeddings are added on linear"),
    ({**TEXT, "ple_embed_dim": 100}, "ple_embed_dim = 100 is not supported: a multiple of"),
    ({**TEXT, "eos_token_id": [1, 2]}, "eos_token_id = .* is not supported: one token id"),
    ({**TEXT, "hc_count": 1}, "hc_count = 1 is not supported: the gated residual has 2 or more streams"),
    ({**TEXT, "output_gate_type": "tanh"}, "output_gate_type = 'tanh' is not supported"),
    ({**TEXT, "layer_types": ["linear_attention"] * 7 + ["sliding_attention"]}, "layer_types = .* is not supported"),
])
def test_a_config_the_reader_does_not_handle_is_one_line_naming_the_field(text, message):
    with pytest.raises(UserError, match=message) as caught:
        config_from_dict({**HUB_CONFIG, "text_config": text})
    assert "\n" not in str(caught.value)
