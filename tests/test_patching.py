"""Activation patching (``ablation.patching``): every grid equals TransformerLens's own ``patching``
functions on the same tiny model loaded into both (a GPT-2 and a Llama-style Qwen2), the
[layers, heads] one through the spec language's ``patch:`` cells; patching every position of a
block's input recovers the clean run, patching nothing gives the corrupted one; clean values of
another length are one line; the library's pairs are tokenized as pipeline.prepare tokenizes (a BOS
in front). Other families' head layouts: test_patching_families.py."""

import numpy as np
import pytest

from ablation.patching import Pair, baselines, cells, clean_values, exact_metrics, patching_grid, values_by_block
from interventions.spec import parse_interventions
from model.sites import ATTN_OUT, ATTN_Z, MLP_OUT, RESID_PRE


# GPT-2's cases run in make test's slow tier only: the quick tier keeps the Llama-style model's (GPT-2's
# 56 s of CPU there, its attribution grids compiling once a site, took the tier to its 4-minute edge).
@pytest.fixture(scope="module", params=[pytest.param("gpt2", marks=pytest.mark.slow), "qwen2"])
def models(request, tmp_path_factory):
    """(ours, TransformerLens's) of one tiny random checkpoint."""
    import jax.numpy as jnp
    from fixtures.tiny_models import write_checkpoint
    from fixtures.transformer_lens_reference import hooked_transformer
    from model.loading import load_model
    path = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, norm_std=0.2, vocab_size=512)
    return load_model(path, jnp.float32, with_head=True), hooked_transformer(path)


def a_pair(vocab: int) -> Pair:
    rng = np.random.default_rng(0)
    clean = rng.integers(0, vocab, 5)
    corrupted = clean.copy()
    corrupted[[1, 3]] = rng.integers(0, vocab, 2)  # two tokens swapped, as an IOI pair swaps names
    answer, wrong = rng.choice(vocab, 2, replace=False)
    return Pair(tuple(clean.tolist()), tuple(corrupted.tolist()), int(answer), int(wrong))


@pytest.mark.slow  # the quick tier's slowest (every grid kind against TransformerLens, two models); make test runs it
def test_every_grid_equals_transformer_lens_patching(models):
    import torch
    from transformer_lens import patching
    ours, theirs = models
    pair = a_pair(ours.config.vocab_size)
    clean, corrupted = torch.tensor([pair.clean]), torch.tensor([pair.corrupted])
    _, cache = theirs.run_with_cache(clean)

    def metric(logits):
        return logits[0, -1, pair.answer] - logits[0, -1, pair.wrong]

    for site, function in ((RESID_PRE, patching.get_act_patch_resid_pre), (ATTN_OUT, patching.get_act_patch_attn_out),
                           (MLP_OUT, patching.get_act_patch_mlp_out),
                           (ATTN_Z, patching.get_act_patch_attn_head_out_by_pos)):
        expected = function(theirs, corrupted, cache, metric).double().numpy()
        got = patching_grid(ours, pair, site)
        assert got.shape == expected.shape, site
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(), err_msg=site)
    # [layers, heads], each head at every position: the spec language's patch atoms, cell by cell.
    expected = patching.get_act_patch_attn_head_out_all_pos(theirs, corrupted, cache, metric).double().numpy()
    layers, heads = ours.config.num_hidden_layers, ours.config.num_attention_heads
    grid = parse_interventions(["patch:*:attn.hook_z:heads=*"], layers, heads)
    found = [cell for intervention in grid for _, cell in cells(intervention, pair)]
    got = exact_metrics(ours, pair, found, values_by_block(clean_values(ours, pair.clean, ATTN_Z), ATTN_Z))
    np.testing.assert_allclose(got.reshape(layers, heads), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # A cell of two blocks at one site (a row holding two slots), against TransformerLens's hooks.
    names = ["blocks.0.hook_attn_out", "blocks.1.hook_attn_out"]
    expected = metric(theirs.run_with_hooks(corrupted, fwd_hooks=[(n, lambda _, hook: cache[hook.name])
                                                                  for n in names])).item()
    (_, cell), = cells(parse_interventions(["+".join(f"patch:{i}:hook_attn_out" for i in (0, 1))], layers, heads)[0],
                       pair)
    got = exact_metrics(ours, pair, [cell], values_by_block(clean_values(ours, pair.clean, ATTN_OUT), ATTN_OUT))
    np.testing.assert_allclose(got, [expected], rtol=1e-5, atol=1e-6)


def test_patching_every_position_recovers_the_clean_run_and_nothing_the_corrupted(models):
    import jax.numpy as jnp
    from ablation.patching import _forward, logit_diff
    import torch
    from model.interventions import add_patch, kept_arrays
    ours, theirs = models
    pair = a_pair(ours.config.vocab_size)
    clean_run, corrupted_run = baselines(ours, pair)
    with torch.no_grad():  # TransformerLens's logit differences of the two prompts
        expected = [float(logits[0, -1, pair.answer] - logits[0, -1, pair.wrong])
                    for logits in (theirs(torch.tensor([pair.clean])), theirs(torch.tensor([pair.corrupted])))]
    np.testing.assert_allclose([clean_run, corrupted_run], expected, rtol=1e-5, atol=1e-5 * max(map(abs, expected)))
    grid = patching_grid(ours, pair, RESID_PRE, normalized=True)
    np.testing.assert_allclose(grid[0, [0, 2, 4]], 0, atol=1e-5)  # tokens the pair shares: nothing changes
    # One program for all three: row 0 patched nowhere, row 1 at every position of block 1's input.
    forward, layers, length = _forward(ours.config, True), ours.config.num_hidden_layers, len(pair.clean)
    arrays = kept_arrays(ours.config, layers)
    values = clean_values(ours, pair.clean, RESID_PRE)  # [L, S, H]
    add_patch(arrays, RESID_PRE, 1, np.stack([values[1], values[1]]), np.array([[False] * length, [True] * length]))
    corrupted, recovered = logit_diff(forward(ours.params, jnp.asarray([pair.corrupted] * 2), arrays)[0], pair)
    clean = logit_diff(forward(ours.params, jnp.asarray([pair.clean] * 2), arrays | {
        k: np.zeros_like(v) for k, v in arrays.items() if k.startswith("patch_tokens")})[0], pair)[0]
    assert abs((recovered - corrupted) / (clean - corrupted) - 1) < 1e-6
    assert abs(corrupted - corrupted_run) < 1e-5 * abs(corrupted_run) and abs(clean - clean_run) < 1e-5 * abs(clean_run)


def test_clean_values_of_another_length_are_one_line(models):
    """Values of a tokenization with a token more (a BOS the pair lacks), or another width, are
    refused in one line by both grids, before any forward."""
    from ablation.patching import attribution_grid
    from common.cli import UserError
    ours, _ = models
    pair = a_pair(ours.config.vocab_size)
    values = np.zeros((ours.config.num_hidden_layers, len(pair.clean) + 1, ours.config.hidden_size), np.float32)
    for grid in (patching_grid, attribution_grid):
        with pytest.raises(UserError, match=r"^pair '': the clean values at blocks.0.hook_resid_pre are of shape "
                                            r"\(6, \d+\), the clean prompt has 5 tokens"):
            grid(ours, pair, RESID_PRE, values=values)
        with pytest.raises(UserError, match=r"^pair '': the clean values at blocks.0.hook_resid_pre are 3 wide, "
                                            r"the block's are \d+: values of another model"):
            grid(ours, pair, RESID_PRE, values=values[:, 1:, :3])


def test_attribution_equals_pytorch_autograd_through_the_same_hooks(models):
    """(clean - corrupted) . d metric / d activation at every cell, against PyTorch autograd of the
    TransformerLens model (transformers' weights, nothing folded): its hooks keep each activation's
    gradient in one backward pass of the corrupted prompt."""
    import torch
    from ablation.patching import agreement, attribution_grid
    ours, theirs = models
    pair = a_pair(ours.config.vocab_size)
    _, clean_cache = theirs.run_with_cache(torch.tensor([pair.clean]))
    sites = {RESID_PRE: "hook_resid_pre", ATTN_OUT: "hook_attn_out", MLP_OUT: "hook_mlp_out", ATTN_Z: "attn.hook_z"}
    kept = {}

    def keep(activation, hook):
        activation.retain_grad()
        kept[hook.name] = activation

    names = [f"blocks.{layer}.{name}" for layer in range(theirs.cfg.n_layers) for name in sites.values()]
    logits = theirs.run_with_hooks(torch.tensor([pair.corrupted]), fwd_hooks=[(name, keep) for name in names])
    metric = logits[0, -1, pair.answer] - logits[0, -1, pair.wrong]
    metric.backward()
    for site, name in sites.items():
        expected = np.stack([((clean_cache[f"blocks.{layer}.{name}"] - kept[f"blocks.{layer}.{name}"]) *
                              kept[f"blocks.{layer}.{name}"].grad).sum(-1)[0].detach().numpy()
                             for layer in range(theirs.cfg.n_layers)]) + metric.item()  # [L, S] or [L, S, N]
        got = attribution_grid(ours, pair, site)
        assert got.shape == expected.shape, site
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max(), err_msg=site)
    exact, estimate = patching_grid(ours, pair, RESID_PRE), attribution_grid(ours, pair, RESID_PRE)
    report = agreement(exact, estimate)
    x, y = exact.ravel() - exact.mean(), estimate.ravel() - estimate.mean()  # Pearson's r, written out
    assert abs(report["correlation"] - (x * y).sum() / np.sqrt((x * x).sum() * (y * y).sum())) < 1e-12
    (cell, at_cell, estimated), *_ = report["worst"]
    assert abs(at_cell - estimated) == np.abs(exact - estimate).max() and exact[cell] == at_cell


@pytest.mark.slow
def test_a_grid_patches_the_values_a_store_holds_for_the_clean_sample(tmp_path):
    """The clean values read from a run's store (runners.tpu_host, merged by pipeline.index) are the
    clean run's, and give the same grids without running the clean prompt again."""
    import json
    import jax.numpy as jnp
    from ablation.patching import stored_values
    from common.cli import UserError
    from fixtures.tiny_models import write_checkpoint
    from model.loading import load_model
    from tests.conftest import run_in_process
    path = write_checkpoint(tmp_path / "gpt2", "gpt2", norm_std=0.2, vocab_size=512)
    ours = load_model(path, jnp.float32, with_head=True)
    pair = a_pair(512)
    with open(tmp_path / "stream.jsonl", "w") as f:
        for sample_id, ids in enumerate((pair.clean, pair.corrupted)):
            f.write(json.dumps({"sample_id": sample_id, "input_ids": list(ids), "num_tokens": len(ids),
                                "source": "pair", "text_preview": ""}) + "\n")
    result = run_in_process("runners.tpu_host", "--machine_id", "0", "--dataset_stream", str(tmp_path / "stream.jsonl"),
                            "--model_path", path, "--output_dir", str(tmp_path / "out"), "--sites",
                            "hook_resid_pre,attn.hook_z", "--max_seq_length", "16", "--batch_size", "2")
    assert result.returncode == 0, result.stderr
    index = str(tmp_path / "index.parquet")
    merged = run_in_process("pipeline.index", "--activations_dir", str(tmp_path / "out"), "--output", index)
    assert merged.returncode == 0, merged.stderr
    layers = ours.config.num_hidden_layers
    for site in (RESID_PRE, ATTN_Z):
        read = stored_values(index, 0, [(site, layer) for layer in range(layers)])
        stored = np.stack([read[site, layer] for layer in range(layers)])
        np.testing.assert_allclose(stored, clean_values(ours, pair.clean, site), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(patching_grid(ours, pair, site, values=stored), patching_grid(ours, pair, site),
                                   rtol=1e-6, atol=1e-6)
    with pytest.raises(UserError, match="holds no layer 0's hook_mlp_out|holds no .*hook_mlp_out of sample 0"):
        stored_values(index, 0, [(MLP_OUT, 0)])


def test_ioi_pairs_tokenize_to_twins_and_bad_pairs_are_one_line(qwen_tokenizer):
    """fixtures.ioi's pairs through the real Qwen2.5 vocabulary: twins of one length differing in one
    token, one-token answers that swap; a missing twin, unequal lengths, a two-token answer refused."""
    from ablation.patching import pairs_from_rows
    from common.cli import UserError
    from fixtures.ioi import ioi_rows
    rows = ioi_rows(8)
    pairs = pairs_from_rows(rows, qwen_tokenizer)
    assert len(pairs) == 8
    for pair, clean in zip(pairs, rows[::2]):
        assert sum(a != b for a, b in zip(pair.clean, pair.corrupted)) == 1
        assert qwen_tokenizer.decode([pair.answer]) == clean["answer"] != clean["wrong_answer"]
        assert qwen_tokenizer.decode(pair.clean) == clean["text"]
    for bad, message in ((rows[:1], "pair 0 has no corrupted prompt"),
                         ([rows[0], {**rows[1], "text": rows[1]["text"] + " them"}], "the clean prompt has 14 tokens"),
                         ([{**rows[0], "answer": " Mary Ann"}, rows[1]], "answer ' Mary Ann' is 2 tokens")):
        with pytest.raises(UserError, match=message):
            pairs_from_rows(bad, qwen_tokenizer)


def test_pairs_get_the_bos_prepare_puts_in_front(tmp_path):
    """A Gemma-style tokenizer's settings put a BOS before every text: the library's pairs start
    with it as pipeline.prepare's samples do (a byte-level vocabulary: a character's id is its code)."""
    from ablation.patching import pairs_from_rows
    from fixtures.family_tokenizers import build_family_tokenizer
    from transforms.tokenizers import load_tokenizer
    tokenizer = load_tokenizer(str(build_family_tokenizer("gemma2", tmp_path / "tokenizer")))
    rows = [{"pair": 0, "variant": "clean", "text": "M and J, J:", "answer": "M", "wrong_answer": "J"},
            {"pair": 0, "variant": "corrupted", "text": "M and J, M:", "answer": "J", "wrong_answer": "M"}]
    (pair,) = pairs_from_rows(rows, tokenizer)
    bos = tokenizer.convert_tokens_to_ids("<bos>")
    assert pair.clean == (bos, *b"M and J, J:") and pair.corrupted == (bos, *b"M and J, M:")
    assert (pair.answer, pair.wrong) == (ord("M"), ord("J"))
