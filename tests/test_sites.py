"""The site table (``model.sites``), the per-site statistics (``activations.site_stats``) and what
the extraction computes for a site: only the blocks it needs."""

import jax
import numpy as np
import pytest

from activations.site_stats import Moments, merged_moments, stats_table, table_moments
from common.cli import UserError
from model.families import load_config
from model.sites import (ATTN_PATTERN, ATTN_Z, MLP_OUT, MLP_POST, RESID_POST, RESID_PRE, array_keys, blocks_needed,
                         check_row_size, check_sites, cost_line, interp_engine_names, key_parts, normalized_key,
                         parse_sites)


def test_sites_parse_into_block_order_and_a_wrong_name_is_one_line():
    assert parse_sites("hook_resid_post,attn.hook_z hook_resid_pre") == (RESID_PRE, ATTN_Z, RESID_POST)
    with pytest.raises(UserError, match="unknown site 'mlp_output' .*hook_mlp_out.*interp-engine's point names"):
        parse_sites("hook_resid_post,mlp_output")


def test_block_outputs_keep_their_layer_key_and_other_sites_their_hook_name():
    assert array_keys((RESID_POST,), (6, 12)) == [6, 12]
    assert array_keys((MLP_OUT, RESID_POST, ATTN_Z), (6,)) == ["blocks.6.attn.hook_z", "blocks.6.hook_mlp_out", 6]
    assert key_parts("blocks.12.mlp.hook_post") == (MLP_POST, 12) and key_parts(3) == (RESID_POST, 3)
    assert normalized_key("blocks.6.hook_resid_post") == 6
    with pytest.raises(UserError, match="names no stored array"):
        key_parts("blocks.6.hook_q")


def test_blocks_needed_stop_before_a_block_whose_input_alone_is_asked_for():
    assert blocks_needed((RESID_PRE,), (2,)) == 2
    assert blocks_needed((RESID_PRE, MLP_OUT), (2,)) == 3
    assert blocks_needed((RESID_PRE,), (0,)) == 1  # a model needs a block to load


def test_the_cost_line_names_each_site_against_the_residual_stream(tiny_checkpoints):
    config = load_config(tiny_checkpoints["gqa_tied"])  # hidden 64, intermediate 176
    line = cost_line((MLP_POST, RESID_POST), (0, 1), config, 4)
    assert line == ("storing 2 site(s) at 2 layer(s): 1.9 KiB per token (mlp.hook_post 1.4 KiB (2.8x resid), "
                    "hook_resid_post 0.5 KiB (1x resid))")


def float64_moments(array: np.ndarray) -> Moments:
    """The moments of [tokens, width], in float64 (the reference)."""
    x = array.astype(np.float64)
    return Moments(len(x), x.mean(0), ((x - x.mean(0)) ** 2).sum(0), float(np.linalg.norm(x, axis=1).mean()))


def test_moments_merge_in_any_grouping_to_the_statistics_of_all_tokens():
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((n, 5)).astype(np.float32) * 3 + 100 for n in (1, 7, 30, 2)]
    every = np.concatenate(parts).astype(np.float64)
    pairwise = merged_moments([{"k": float64_moments(p)} for p in parts])["k"]
    halves = float64_moments(np.concatenate(parts[:2])).merged(float64_moments(np.concatenate(parts[2:])))
    for m in (pairwise, halves):
        assert m.count == len(every)
        np.testing.assert_allclose(m.mean, every.mean(0), rtol=1e-14)
        np.testing.assert_allclose(m.variance, every.var(0), rtol=1e-11)
        assert abs(m.mean_norm - np.linalg.norm(every, axis=1).mean()) <= 1e-13 * m.mean_norm
    table = stats_table({6: pairwise, "blocks.6.hook_mlp_out": halves})
    assert table.column("site").to_pylist() == ["hook_mlp_out", "hook_resid_post"]
    back = table_moments(table)
    np.testing.assert_allclose(back[6].m2, pairwise.m2, rtol=1e-15)


def test_an_input_site_alone_loads_and_computes_only_the_blocks_before_it(tiny_checkpoints):
    from model.extract import Extractor
    extractor = Extractor.load(tiny_checkpoints["gqa_tied"], layers=[2], dtype="float32", max_seq_length=32,
                               min_bucket=32, devices=jax.devices()[:1], sites=[RESID_PRE])
    assert sorted(k for k in extractor.params if k.startswith("layers_")) == ["layers_0", "layers_1"]
    ids = list(range(1, 12))
    pre = dict(extractor.extract([(0, ids)]))[0]["blocks.2.hook_resid_pre"]
    outputs = Extractor.load(tiny_checkpoints["gqa_tied"], layers=[1], dtype="float32", max_seq_length=32,
                             min_bucket=32, devices=jax.devices()[:1])
    np.testing.assert_array_equal(pre, dict(outputs.extract([(0, ids)]))[0][1])  # block 1's output


def test_output_stored_before_sites_existed_resumes_with_block_outputs_only():
    from model.run_settings import changed_settings
    old = {"layers_to_extract": [0, 1]}  # a checkpoint's settings from before --sites
    assert changed_settings(old, {"layers_to_extract": [0, 1], "sites": [RESID_POST]}) == []
    assert changed_settings(old, {"sites": [RESID_POST, MLP_OUT]}) == \
        ["--sites ['hook_resid_post'] -> ['hook_resid_post', 'hook_mlp_out']"]


def family_config(family: str, **overrides):
    """Our ``DecoderConfig`` of a family's tiny transformers config (no weights written)."""
    from fixtures.tiny_models import tiny_config
    from model.families import config_from_dict
    return config_from_dict(tiny_config(family, **overrides).to_dict())


def test_interp_engine_point_names_store_as_transformer_lens_sites():
    assert parse_sites("attn_probs,resid_post mlp_pre q_norm_out") == (
        "attn.q_norm.hook_out", "attn.hook_pattern", "mlp.hook_pre", RESID_POST)
    assert interp_engine_names("attn_probs,hook_mlp_out,mlp_act") == {"attn_probs": "attn.hook_pattern",
                                                                     "mlp_act": MLP_POST}


def test_a_site_a_family_lacks_is_one_line_naming_the_families_that_have_it():
    with pytest.raises(UserError, match=r"--sites attn.q_norm.hook_out: qwen2 has no QK-norm \(the families with "
                                        r"one: Qwen3, .*OLMo 2"):
        check_sites(parse_sites("q_norm_out"), family_config("qwen2"))
    with pytest.raises(UserError, match=r"llama's attention has no output gate \(gated attention: Qwen3.5"):
        check_sites(parse_sites("attn_gate"), family_config("llama"))
    with pytest.raises(UserError, match="no rotary"):
        check_sites(parse_sites("attn.hook_rot_q"), family_config("gpt2"))
    with pytest.raises(UserError, match="block 0 mixes with Gated DeltaNet: no attention heads; its attention "
                                        "blocks are 2"):
        check_sites(parse_sites("attn_probs"), family_config("qwen3_5"), [0, 2])
    with pytest.raises(UserError, match="is not gated: it has one input projection"):
        check_sites(parse_sites("mlp_pre_linear"), family_config("gpt2"))
    check_sites(parse_sites("attn_gate,attn_probs,q_norm_in,k_norm_out"), family_config("qwen3_5"), [2])


def test_a_pattern_costs_its_heads_times_the_sequence_and_past_the_limit_is_refused_without_a_selection():
    config = family_config("qwen2")  # 4 heads, hidden 64
    line = cost_line((ATTN_PATTERN, RESID_POST), (0, 1), config, 4, length=512)
    assert "attn.hook_pattern 16.0 KiB (32x resid at 512 tokens: a sample's [S, heads, S])" in line
    with pytest.raises(UserError, match=r"--sites attn.hook_pattern: 16 KiB per token at 512 tokens over 2 layer\(s\), "
                                        r"past --max_row_kib 8 .* \(--tokens last\)"):
        check_row_size((ATTN_PATTERN,), (0, 1), config, 4, 512, 8, selected=False)
    check_row_size((ATTN_PATTERN,), (0, 1), config, 4, 512, 8, selected=True)
    with pytest.raises(UserError, match=r"--sites hook_logits: 594 KiB per token, past --max_row_kib 64 \(the logits "
                                        r"are .*\(--tokens last\), their top k \(--logits_top_k K\)"):
        check_row_size(("hook_logits",), (0,), config, 4, 512, 64, selected=False)  # Qwen2.5's 151,936 tokens
    check_row_size((ATTN_PATTERN,), (0, 1), config, 4, 512, 16, selected=False)
