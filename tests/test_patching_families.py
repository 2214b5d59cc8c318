"""Activation patching (``ablation.patching``) on the families whose blocks differ in head layout:
Gemma 4 (full-attention blocks with heads twice as wide as the sliding ones', which attend to
shared keys and values), DeepSeek-V3 (latent attention: values of another head size than the
queries and keys) and gpt-oss (attention sinks). Every grid, exact and attribution, at attn.hook_z
and the stream sites, against transformers' float64 model patched by forward hooks and
differentiated by torch autograd; Qwen3-Next's gated attention patched at its attention block,
its Gated DeltaNet blocks refused in one line; runners.ablate on a Gemma 4 store."""

import numpy as np
import pytest

from ablation.patching import Pair, attribution_grid, attribution_metrics, cells, clean_values, exact_metrics, \
    grid_cells, patching_grid, values_by_block
from model.sites import ATTN_OUT, ATTN_Z, MLP_OUT, RESID_MID, RESID_POST, RESID_PRE

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
SITES = (ATTN_Z, RESID_PRE, ATTN_OUT, RESID_MID, MLP_OUT, RESID_POST)
# The tiny checkpoints (fixtures.tiny_models) cut to the fewest blocks that keep each layout: Gemma 4 a
# sliding and a full block, then two attending to their keys and values (with MLPs twice as wide); a
# dense block before a mixture of experts (DeepSeek-V3); a windowed block and a full one (gpt-oss); a
# Gated DeltaNet block and a gated attention one (Qwen3-Next).
SHAPES = {"gemma4": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2),
          "deepseek_v3": dict(num_hidden_layers=2), "gpt_oss": dict(num_hidden_layers=2),
          "qwen3_next": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                             mlp_only_layers=[1]),
          "glm5_next": dict(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"],
                            mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"]),
          "qwen4_exp": dict(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"],
                            ple_layer_ids=[1], indexer_budget=4, indexer_compress_ratio=2)}


@pytest.fixture(scope="module", params=["gemma4", "deepseek_v3", "gpt_oss"])
def models(request, tmp_path_factory):
    """(ours in float32, transformers' in float64, the checkpoint) of one tiny random checkpoint."""
    return loaded_pair(tmp_path_factory.mktemp(request.param), request.param)


def loaded_pair(folder, family: str):
    import jax.numpy as jnp
    from fixtures.hf_reference import load_reference
    from fixtures.tiny_models import write_checkpoint
    from model.loading import load_model
    path = write_checkpoint(folder, family, **SHAPES[family])
    reference = load_reference(path, "float64")
    reference.requires_grad_(False)  # autograd through the deltas added at the sites alone
    return load_model(path, jnp.float32, with_head=True), reference, path


def a_pair(vocab: int, length: int = 4) -> Pair:
    rng = np.random.default_rng(1)
    clean = rng.integers(0, vocab, length)
    corrupted = clean.copy()
    corrupted[[1, length - 2]] = rng.integers(0, vocab, 2)
    answer, wrong = rng.choice(vocab, 2, replace=False)
    return Pair(tuple(clean.tolist()), tuple(corrupted.tolist()), int(answer), int(wrong))


def edited(model, site: str, layer: int, edit) -> list:
    """Hooks putting ``edit(value [1, S, W])`` in place of block ``layer``'s value at ``site`` in
    transformers' model (where ``model.params.hf_site`` says it is seen); their handles. The
    stream between attention and the MLP is no module's input or output whole (the MLP's norm reads
    it, the residual sum keeps its own reference): attention's output takes the edit's difference."""
    from fixtures.hf_reference import decoder_blocks, our_config
    from model.params import hf_site
    block = decoder_blocks(model)[layer]
    config = our_config(model)
    flat = edit  # hyper-connections' streams [1, S, N, H] edited as the [1, S, N*H] rows stored
    edit = lambda x: flat(x.reshape(*x.shape[:2], -1)).reshape(x.shape)
    if site == RESID_MID and config.hyper is not None:
        return _edited_streams(block, edit, config.hyper.kind == "gated")
    if site == RESID_MID:
        block_input = {}

        def keep(module, args, kwargs):
            block_input["x"] = args[0] if args else kwargs["hidden_states"]

        def through_attention(attn_out):
            mid = block_input["x"] + attn_out
            return attn_out + (edit(mid) - mid)
        return [block.register_forward_pre_hook(keep, with_kwargs=True), *edited(model, ATTN_OUT, layer,
                                                                                through_attention)]
    path, side = hf_site(site, our_config(model), layer)
    module = block.get_submodule(path) if path else block
    if side == "input":
        def pre(module, args, kwargs):
            if args:
                return (edit(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": edit(kwargs["hidden_states"])}
        return [module.register_forward_pre_hook(pre, with_kwargs=True)]

    nth = int(side.split()[-1]) if side.split()[-1].isdigit() else 0  # "output N": a tuple's Nth

    def post(module, args, output):
        return (*output[:nth], edit(output[nth]), *output[nth + 1:]) if isinstance(output, tuple) else edit(output)
    return [module.register_forward_hook(post)]


def _edited_streams(block, edit, gated: bool) -> list:
    """Hooks editing the streams between a hyper-connection block's sublayers: the MLP's
    hyper-connection reads the edited streams, and the mix after the MLP (which reads the block's
    own reference to them) gets comb^T times the edit's difference; Qwen4-Exp's gated residual
    (``gated``) returns the streams it read as those the MLP's output is added to."""
    import torch
    kept = {}

    def streams_in(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        kept["change"] = edit(x) - x  # [1, S, N, H]
        x = x + kept["change"]
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    def weights(module, args, output):
        kept["comb"] = output[1]  # [1, S, N, N]

    def block_out(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        mixed = hidden + torch.matmul(kept["comb"].to(hidden.dtype).transpose(-1, -2), kept["change"])
        return (mixed, *output[1:]) if isinstance(output, tuple) else mixed
    if gated:
        return [block.mlp_hyper_connection.register_forward_pre_hook(streams_in, with_kwargs=True)]
    return [block.ffn_hc.register_forward_pre_hook(streams_in, with_kwargs=True),
            block.ffn_hc.register_forward_hook(weights), block.register_forward_hook(block_out)]


def metric_with(model, pair: Pair, edits):
    """transformers' logit difference at the corrupted prompt's last token with ``edits`` ((site,
    layer, edit) each) hooked in."""
    import torch
    handles = [handle for e in edits for handle in edited(model, *e)]
    try:
        logits = model(torch.tensor([pair.corrupted])).logits[0, -1]
    finally:
        for handle in handles:
            handle.remove()
    return logits[pair.answer] - logits[pair.wrong]


def reference_clean(model, pair: Pair, site: str, layers) -> dict[int, np.ndarray]:
    """{block: [S, W] float64}: the clean prompt's values at ``site``, read by the same hooks."""
    import torch
    found = {}

    def keep(layer):
        def edit(x):
            found[layer] = x[0].detach().numpy().copy()
            return x
        return edit
    with torch.no_grad():
        metric_with(model, Pair(pair.clean, pair.clean, pair.answer, pair.wrong), [(site, i, keep(i)) for i in layers])
    return found


def columns(width: int, heads: int, head: int | None) -> slice:
    """One head's slice of ``attn.hook_z`` [.., N*D] (each block's own D), or all of a stream site."""
    return slice(None) if head is None else slice(head * (width // heads), (head + 1) * (width // heads))


def reference_exact(model, pair: Pair, site: str, layers, heads: int | None) -> np.ndarray:
    """transformers' grid [L, S(, N)]: a forward of the corrupted prompt per cell with the clean
    value put at one position (one head's slice)."""
    import torch
    clean = reference_clean(model, pair, site, layers)

    def put(layer, position, head):
        def edit(x):
            x, at = x.clone(), columns(x.shape[-1], heads or 1, head)
            x[0, position, at] = torch.from_numpy(clean[layer][position, at])
            return x
        return edit
    with torch.no_grad():
        return np.array([[[float(metric_with(model, pair, [(site, layer, put(layer, position, head))]))
                           for head in (range(heads) if heads else [None])]
                          for position in range(len(pair.corrupted))] for layer in layers]).reshape(
            len(layers), len(pair.corrupted), *([heads] if heads else []))


def reference_attribution(model, pair: Pair, site: str, layers, heads: int | None) -> np.ndarray:
    """transformers' attribution grid [L, S(, N)]: the corrupted run's metric plus (clean -
    corrupted) . d metric / d value per cell, the gradient by torch autograd through a zero delta
    added at the site of every block."""
    import torch
    clean, kept = reference_clean(model, pair, site, layers), {}

    def add_delta(layer):
        def edit(x):
            delta = torch.zeros_like(x, requires_grad=True)
            kept[layer] = (x[0].detach().numpy().copy(), delta)
            return x + delta
        return edit
    metric = metric_with(model, pair, [(site, layer, add_delta(layer)) for layer in layers])
    metric.backward()
    grid = []
    for layer in layers:
        corrupted, delta = kept[layer]
        change = (clean[layer] - corrupted) * delta.grad[0].numpy()  # [S, W]
        grid.append(change.reshape(len(pair.corrupted), heads, -1).sum(-1) if heads else change.sum(-1))
    return np.stack(grid) + metric.item()


def assert_close(got: np.ndarray, expected: np.ndarray, tolerance: float, what: str) -> None:
    assert got.shape == expected.shape, what
    error = np.abs(got - expected).max() / np.abs(expected).max()
    print(f"{what}: max abs error {np.abs(got - expected).max():.3g}, {error:.3g} of the grid's scale")
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance * np.abs(expected).max(), err_msg=what)


def test_every_grid_equals_transformers_hooks_and_autograd(models):
    """Exact grids within 1e-5 and attribution grids within 1e-4 of transformers' float64 model, at
    every stream site and per head at attn.hook_z (heads of each block's own width), every site's
    cells in one call of each method. Clean values as a store holds them (each block its own
    width: Gemma 4's full blocks wider) patch as the padded ones; values of another length are one
    line."""
    from common.cli import UserError
    ours, theirs, _ = models
    c = ours.config
    pair, layers, n = a_pair(c.vocab_size), range(c.num_hidden_layers), c.num_attention_heads
    assert {c.layer_config(i).head_dim for i in layers} == ({16, 32} if c.model_type == "gemma4" else {c.head_dim})
    padded = clean_values(ours, pair.clean, ATTN_Z)  # [L, S, N * the widest head]
    own = [block.reshape(len(pair.clean), n, -1)[..., :c.layer_config(i).head_dim].reshape(len(pair.clean), -1)
           for i, block in enumerate(padded)]  # [S, N * D] each
    stream = {key: value for site in SITES[1:] for key, value in values_by_block(clean_values(ours, pair.clean, site),
                                                                                site).items()}
    as_stored, as_padded = {**stream, **values_by_block(own, ATTN_Z)}, {**stream, **values_by_block(padded, ATTN_Z)}
    exact = exact_metrics(ours, pair, every_cell(c, pair), as_stored)
    estimate = attribution_metrics(ours, pair, every_cell(c, pair), as_stored)[0]
    for site, exact_grid, estimate_grid in zip(SITES, grids(c, pair, exact), grids(c, pair, estimate)):
        heads = n if site == ATTN_Z else None
        assert_close(exact_grid, reference_exact(theirs, pair, site, layers, heads), 1e-5,
                     f"{c.model_type} {site} exact")
        assert_close(estimate_grid, reference_attribution(theirs, pair, site, layers, heads), 1e-4,
                     f"{c.model_type} {site} attribution")
    np.testing.assert_array_equal(exact, exact_metrics(ours, pair, every_cell(c, pair), as_padded))
    np.testing.assert_array_equal(estimate, attribution_metrics(ours, pair, every_cell(c, pair), as_padded)[0])
    with pytest.raises(UserError, match=r"^pair '': the clean values at blocks.0.attn.hook_z are of shape \(3, "):
        patching_grid(ours, pair, ATTN_Z, values=[block[1:] for block in own])


@pytest.mark.parametrize("family", ["glm5_next", "qwen4_exp"])
def test_hyper_connection_grids_equal_transformers_hooks_and_autograd(tmp_path, family):
    """GLM-5-next's (a Kimi Delta Attention block, then an indexed attention block with experts; 3
    streams), Qwen4-Exp's (a Gated DeltaNet block adding n-grams, then attention with QSA choosing 2
    pools of 2; 3 gated streams): every stream site's grid and what each sublayer reads of the
    streams, exact and attribution, against transformers' float64 model with the same values put in
    by hooks; the streams between the sublayers edited where the MLP's hyper-connection and the mix
    after it read them."""
    from model.sites import HC_ATTN_COLLAPSE, HC_MLP_COLLAPSE
    ours, theirs, _ = loaded_pair(tmp_path / family, family)
    c = ours.config
    # (Qwen4-Exp's last query sees 3 whole pools and keeps 2: sparse)
    pair, layers = a_pair(c.vocab_size, 7 if family == "qwen4_exp" else 4), range(c.num_hidden_layers)
    sites = (RESID_PRE, HC_ATTN_COLLAPSE, ATTN_OUT, RESID_MID, HC_MLP_COLLAPSE, MLP_OUT, RESID_POST)
    found = [cell for site in sites for cell in grid_cells(site, c.num_hidden_layers, len(pair.corrupted), None)]
    values = {key: value for site in sites for key, value in values_by_block(clean_values(ours, pair.clean, site),
                                                                             site).items()}
    assert values[RESID_MID, 1].shape == (len(pair.clean), 3 * c.hidden_size)
    shape = (c.num_hidden_layers, len(pair.corrupted))
    exact = exact_metrics(ours, pair, found, values).reshape(len(sites), *shape)
    estimate = attribution_metrics(ours, pair, found, values)[0].reshape(len(sites), *shape)
    for site, exact_grid, estimate_grid in zip(sites, exact, estimate):
        assert_close(exact_grid, reference_exact(theirs, pair, site, layers, None), 1e-5, f"{family} {site} exact")
        assert_close(estimate_grid, reference_attribution(theirs, pair, site, layers, None), 1e-4,
                     f"{family} {site} attribution")


def every_cell(config, pair: Pair) -> list:
    """The cells of every site's grid (``SITES``), site after site, each in TransformerLens's order."""
    return [cell for site in SITES for cell in grid_cells(site, config.num_hidden_layers, len(pair.corrupted),
                                                         config.num_attention_heads if site == ATTN_Z else None)]


def grids(config, pair: Pair, metrics: np.ndarray) -> list[np.ndarray]:
    """Each site's grid [L, S(, N)] of the metrics of ``every_cell``."""
    shapes = [(config.num_hidden_layers, len(pair.corrupted), *([config.num_attention_heads] if site == ATTN_Z
                                                                 else [])) for site in SITES]
    parts = np.split(metrics, np.cumsum([np.prod(shape) for shape in shapes])[:-1])
    return [part.reshape(shape) for part, shape in zip(parts, shapes)]


def parse(specs, config):
    from interventions.spec import parse_interventions
    return parse_interventions(specs, config.num_hidden_layers, config.num_attention_heads)


def test_qwen3_next_gated_attention_patches_and_its_deltanet_blocks_are_refused(tmp_path):
    """Qwen3-Next's gated attention block (1): every head at every position, exact and attribution,
    against transformers; a grid of attn.hook_z over every block, and a patch of a Gated DeltaNet
    block's heads, refused in one line (it has none)."""
    import jax.numpy as jnp
    from ablation.patching import _forward, site_values
    from common.cli import UserError
    ours, theirs, _ = loaded_pair(tmp_path / "qwen3_next", "qwen3_next")
    c = ours.config
    pair, n = a_pair(c.vocab_size), c.num_attention_heads
    assert c.attention_layers == (1,)
    found = [cell for iv in parse(["patch:1:attn.hook_z:heads=*:pos=*"], c) for _, cell in cells(iv, pair)]
    _, outputs, sown = _forward(c, False)(ours.params, jnp.asarray([pair.clean]), None)
    values = {(ATTN_Z, 1): site_values(c, outputs, sown, ATTN_Z)[1, 0]}  # [S, N*D]
    grid = lambda metrics: metrics.reshape(1, n, len(pair.corrupted)).transpose(0, 2, 1)  # cells head by head
    assert_close(grid(exact_metrics(ours, pair, found, values)), reference_exact(theirs, pair, ATTN_Z, [1], n), 1e-5,
                 "qwen3_next attn.hook_z exact")
    assert_close(grid(attribution_metrics(ours, pair, found, values)[0]),
                 reference_attribution(theirs, pair, ATTN_Z, [1], n), 1e-4, "qwen3_next attn.hook_z attribution")
    for grid in (patching_grid, attribution_grid):
        with pytest.raises(UserError, match="^no grid of attn.hook_z over every block: block 0 mixes with Gated "
                                            "DeltaNet"):
            grid(ours, pair, ATTN_Z)
    (_, deltanet), = cells(parse(["patch:0:attn.hook_z:heads=0:pos=0"], c)[0], pair)
    with pytest.raises(UserError, match="^pair '': no patch at blocks.0.attn.hook_z: block 0 mixes with Gated"):
        exact_metrics(ours, pair, [deltanet], {(ATTN_Z, 0): values[ATTN_Z, 1]})


@pytest.mark.parametrize("models", ["gemma4"], indirect=True)  # the family whose blocks differ in head size
def test_the_runner_patches_gemma4_heads_from_a_store(models, tmp_path):
    """runners.ablate --metric logit_diff over every head of every block (the [layers, heads] grid)
    of Gemma 4, the clean values read from a runners.tpu_host store (each block's heads at their
    own width): the library's cells, both methods."""
    import json
    import pandas as pd
    from tests.conftest import run_in_process
    ours, _, path = models
    c = ours.config
    pair = a_pair(c.vocab_size)
    with open(tmp_path / "stream.jsonl", "w") as f:
        for sample_id, (variant, ids) in enumerate((("clean", pair.clean), ("corrupted", pair.corrupted))):
            f.write(json.dumps({"sample_id": sample_id, "input_ids": list(ids), "num_tokens": len(ids),
                                "truncated": False, "source": "pairs", "text_preview": "",
                                "roles": [["text", len(ids)]], "special": [],
                                "columns": {"pair": 0, "variant": variant}, "answers": [pair.answer, pair.wrong]})
                    + "\n")
    stream, index = str(tmp_path / "stream.jsonl"), str(tmp_path / "index.parquet")
    for module, *flags in (("runners.tpu_host", "--machine_id", "0", "--dataset_stream", stream, "--model_path", path,
                            "--output_dir", str(tmp_path / "store"), "--sites", ATTN_Z, "--batch_size", "2"),
                           ("pipeline.index", "--activations_dir", str(tmp_path / "store"), "--output", index),
                           ("runners.ablate", "--model_path", path, "--stream", stream, "--metric", "logit_diff",
                            "--patch_from", index, "--method", "both", "--interventions", "patch:*:attn.hook_z:heads=*",
                            "--output_dir", str(tmp_path / "out"), "--no_tensorboard", "--no_charts")):
        done = run_in_process(module, *flags)
        assert done.returncode == 0, done.stderr
    results = pd.read_parquet(tmp_path / "out" / "patching.parquet")
    found = cells(parse(["patch:*:attn.hook_z:heads=*"], c)[0], pair)
    values = values_by_block(clean_values(ours, pair.clean, ATTN_Z), ATTN_Z)
    for method, expected in (("exact", exact_metrics(ours, pair, [cell for _, cell in found], values)),
                             ("attribution", attribution_metrics(ours, pair, [cell for _, cell in found], values)[0])):
        got = results[results["method"] == method].set_index("intervention")["logit_diff"]
        np.testing.assert_allclose(got[[own.name for own, _ in found]], expected, rtol=1e-5, atol=1e-5, err_msg=method)
