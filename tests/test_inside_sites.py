"""The sites inside attention and the MLP (queries, keys, values, QK-norms, rotated queries and
keys, scores, patterns, the output gate, pre-activations, module outputs before a post-norm), at
two blocks of odd configs of fourteen families: what is stored equals transformers' float64 forward
(``model.params.hf_site``, ``fixtures.hf_reference``) and interp-engine's eager capture of the
same points (``fixtures.interp_engine_reference``) within 1e-5."""

import jax
import numpy as np
import pytest

from fixtures.hf_reference import load_reference, random_sequences, reference_sites, relative_error
from fixtures.interp_engine_reference import interp_engine_points
from fixtures.tiny_models import write_checkpoint
from model.extract import Extractor
from model.families import load_config
from model.params import layout_of
from model.sites import (ATTN_PATTERN, ATTN_SCORES, EMBED, ENTROPY, FINAL_NORM, FINAL_NORMALIZED, INTERP_ENGINE_POINTS,
                         LOGITS, LOSS, MODEL_SITES, RANK, ROUTING, SITES, TOP_K_IDS, TOP_K_LOGPROBS, array_key,
                         missing_reason)

pytestmark = pytest.mark.slow
LENGTHS = (19, 40)  # the second past gpt-oss's sliding window (16)
QWEN3_5_BLOCKS = dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention",
                                   "linear_attention"])
CASES = [("qwen2", (0, 1), {}), ("llama", (0, 2), {}), ("gemma3", (0, 1), {}), ("gemma2", (0, 1), {}),
         ("qwen3", (1, 2), {}), ("olmo2", (0, 1), {}), ("gpt_oss", (0, 1), {}), ("qwen3_moe", (0, 2), {}),
         ("qwen3_5", (1, 3), QWEN3_5_BLOCKS), ("qwen3_5", (0, 2), QWEN3_5_BLOCKS),  # attention, DeltaNet blocks
         ("olmo_hybrid", (1, 4), {}), ("olmo_hybrid", (0, 2), {}),  # post-norm attention, pre-norm DeltaNet blocks
         ("llama4", (0, 1), {}), ("llama4", (2, 4), {}),  # chunked RoPE blocks (experts, dense), NoPE blocks
         ("granitemoehybrid", (1, 4), {}), ("granitemoehybrid", (0, 2), {}),  # attention, Mamba-2 blocks
         # blocks of one sublayer: attention, Mamba-2, experts, a plain MLP
         ("nemotron_h", (1, 5), {}), ("nemotron_h", (0, 4), {}), ("nemotron_h", (2, 6), {}), ("nemotron_h", (3, 8), {}),
         # attention beside Mamba-2, its gated norm on and off
         ("falcon_h1", (0, 2), {}), ("falcon_h1", (0, 1), {"mamba_rms_norm": False}),
         ("kimi_linear", (1, 4), {}), ("kimi_linear", (0, 2), {}),  # latent attention (experts), KDA (dense MLPs)
         ("glm5_next", (1, 5), {}), ("glm5_next", (0, 3), {})]  # hyper-connections: indexed attention, KDA blocks


def close(ours: np.ndarray, ref: np.ndarray) -> float:
    """The relative error over the finite entries; a masked score (-inf ours; -inf or the dtype's
    minimum theirs) must be masked in both."""
    masked = ~np.isfinite(ours)
    assert np.array_equal(masked, ref < -1e30)
    return relative_error(ours[~masked], ref[~masked])


@pytest.mark.parametrize("family, layers, overrides", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_every_site_equals_transformers_and_interp_engine(tmp_path, family, layers, overrides):
    model_dir = write_checkpoint(tmp_path / family, family, seed=5, **overrides)
    config = load_config(model_dir)
    sites = [site for site in SITES if site not in MODEL_SITES
             and all(missing_reason(site, config, layer) is None for layer in (None, *layers))]
    sequences = random_sequences(list(LENGTHS), seed=2, vocab=config.vocab_size)
    extractor = Extractor.load(model_dir, layers=layers, dtype="float32", max_seq_length=64, min_bucket=64,
                               batch_size_per_device=2, devices=jax.devices()[:1], sites=sites)
    ours = dict(extractor.extract(enumerate(sequences)))
    places = [(site, layer) for layer in layers for site in sites]
    theirs = reference_sites(load_reference(model_dir, "float64"), sequences, places)
    # interp-engine's q_norm_in and k_norm_in exist only where there is a QK-norm; our q and k everywhere.
    # interp-engine 1.14 reads Granite 4's router as returning its outputs in another order (and refuses
    # them), takes one module's output for its MLP's, which is the experts' and the shared MLP's sum, and
    # has no attention points at Mamba-2 blocks (Granite's, Nemotron-H's): there, those are compared with
    # transformers alone. With hyper-connections (GLM-5-next) its residual points name one stream of several.
    granite = config.model_type == "granitemoehybrid"
    mamba = any(config.is_mamba(layer) for layer in layers)
    points = {name: site for name, site in INTERP_ENGINE_POINTS.items() if site in sites
              and (config.qk_norm or name not in ("q_norm_in", "k_norm_in"))
              and not (granite and (site in ROUTING or name in ("mlp_out", "mlp_out_post")))
              and not (mamba and name.startswith("attn"))
              # its resid_pre, resid_mid and resid_post name one stream of several (resid_streams is all of them),
              # and it has no resid_streams on a model of one stream
              and not (config.hyper and name in ("resid_pre", "resid_mid", "resid_post"))
              and not (not config.hyper and name == "resid_streams")}
    engine = interp_engine_points(model_dir, sequences, [(name, layer) for layer in layers for name in points])
    for i in range(len(sequences)):
        for site, layer in places:
            stored = ours[i][array_key(site, layer)]
            assert stored.shape == theirs[i][site, layer].shape, (site, layer)
            assert close(stored, theirs[i][site, layer]) <= 1e-5, (site, layer)
        for name, site in points.items():
            for layer in layers:
                assert close(ours[i][array_key(site, layer)], engine[i][name, layer]) <= 1e-5, (name, layer)
    windowed = [layer for layer in layers if isinstance(config.window(layer), int) and ATTN_SCORES in sites]
    for layer in windowed:  # the last query (39) sees no key past the window (16), as the model applies it
        last = ours[1][array_key(ATTN_SCORES, layer)][-1].reshape(config.num_attention_heads, -1)
        assert np.isinf(last[:, :LENGTHS[1] - config.window(layer)]).all() and np.isfinite(last[:, -1]).all()
    if config.attention_sinks:  # each head's sink takes its share: no row sums to 1
        rows = ours[1][array_key(ATTN_PATTERN, layers[0])].reshape(LENGTHS[1], config.num_attention_heads, -1)
        assert (rows.sum(-1) < 1 - 1e-3).all()


MODEL_CASES = ["qwen2", "gemma2", "gpt2", "qwen3_5"]  # tied; soft-capped, scaled embeddings; learned positions


@pytest.mark.parametrize("family", MODEL_CASES)
def test_the_model_level_sites_equal_transformers_and_interp_engine(tmp_path, family):
    """The embeddings, the final norm, the logits, their top k and the per-token loss, entropy and
    rank (every token, and a selection of rows, whose logits alone are computed) against
    transformers' float64 forward; the embeddings, final norm and logits against interp-engine's."""
    import torch
    from fixtures.hf_reference import normalized
    model_dir = write_checkpoint(tmp_path / family, family, seed=6)
    config = load_config(model_dir)
    sequences = random_sequences(list(LENGTHS), seed=3, vocab=config.vocab_size)
    sites = [EMBED, FINAL_NORMALIZED, FINAL_NORM, LOGITS, LOSS, ENTROPY, RANK]
    extractor = Extractor.load(model_dir, layers=[0], dtype="float32", max_seq_length=64, min_bucket=64,
                               batch_size_per_device=2, devices=jax.devices()[:1], sites=sites, logits_top_k=3)
    ours = dict(extractor.extract(enumerate(sequences)))
    chosen = [np.array([0, 5, len(s) - 1]) for s in sequences]  # the last has no next token
    selected = dict(extractor.extract((i, s, chosen[i]) for i, s in enumerate(sequences)))
    reference = load_reference(model_dir, "float64")
    final_norm = reference.base_model.get_submodule(layout_of(config).final_norm)  # GPT-2's ln_f
    engine = interp_engine_points(model_dir, sequences, [("embeddings", None), ("final_norm", None), ("lm_head", None)])
    for i, sequence in enumerate(sequences):
        with torch.no_grad():
            out = reference(torch.tensor([sequence]), output_hidden_states=True)
            before_norm = []
            handle = final_norm.register_forward_pre_hook(lambda m, a, found=before_norm: found.append(a[0]))
            reference(torch.tensor([sequence]))
            handle.remove()
        logits = out.logits[0].numpy()
        logprobs = torch.log_softmax(out.logits[0], -1).numpy()
        following = np.array(sequence[1:])
        loss = -logprobs[np.arange(len(following)), following]
        rank = (logits[:-1] > logits[np.arange(len(following)), following][:, None]).sum(-1)
        top = np.argsort(-logprobs, axis=-1, kind="stable")[:, :3]
        expected = {
            EMBED: reference.get_input_embeddings()(torch.tensor(sequence)).detach().numpy(),
            FINAL_NORMALIZED: normalized(final_norm, before_norm[0][0]).numpy(),
            FINAL_NORM: out.hidden_states[-1][0].numpy(), LOGITS: logits,
            ENTROPY: -(np.exp(logprobs) * logprobs).sum(-1, keepdims=True),
            TOP_K_LOGPROBS: np.take_along_axis(logprobs, top, -1)}
        for site, value in expected.items():
            assert relative_error(ours[i][site], value) <= 1e-5, site
        assert relative_error(ours[i][LOSS][:-1, 0], loss) <= 1e-5 and np.isnan(ours[i][LOSS][-1, 0])
        assert np.array_equal(ours[i][RANK][:, 0], [*rank, -1])
        assert np.array_equal(ours[i][TOP_K_IDS], top)
        for site in (LOGITS, LOSS, ENTROPY, RANK, TOP_K_IDS):  # the selected rows' alone, the same values
            np.testing.assert_allclose(selected[i][site], ours[i][site][chosen[i]], rtol=1e-5, atol=1e-6)
        assert relative_error(ours[i][EMBED], engine[i]["embeddings", None]) <= 1e-5
        assert relative_error(ours[i][FINAL_NORM], engine[i]["final_norm", None]) <= 1e-5
        if config.final_logit_softcap is None:  # interp-engine's lm_head is before Gemma 2's soft cap
            assert relative_error(ours[i][LOGITS], engine[i]["lm_head", None]) <= 1e-5


def test_the_stored_losses_average_to_runners_ablate_clean_loss(tmp_path):
    """``hook_loss`` stored by the runner at every token: each sample's mean (its last token has no
    next) and the stream's token-weighted mean equal the unablated model's loss ``runners.ablate``
    reports on the same stream."""
    import pandas as pd
    from tests.conftest import run_in_process
    from tests.test_family_runs import runner, stored, write_stream
    model_dir = write_checkpoint(tmp_path / "qwen2", "qwen2", seed=7, vocab_size=512)
    write_stream(tmp_path / "stream.jsonl", model_dir, count=6)
    done = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", model_dir,
                                                      "--sites", "hook_loss", "--layers_to_extract", "0"))
    assert done.returncode == 0, done.stderr[-2000:]
    losses = {sample: arrays[LOSS][:-1, 0] for sample, arrays in stored(tmp_path / "out" / "machine_000").items()}
    done = run_in_process("runners.ablate", "--model_path", model_dir, "--stream", str(tmp_path / "stream.jsonl"),
                          "--interventions", "head:0.0", "--output_dir", str(tmp_path / "ablation"), "--dtype",
                          "float32", "--max_seq_length", "64")
    assert done.returncode == 0, done.stderr[-2000:]
    results = pd.read_parquet(tmp_path / "ablation" / "results.parquet")
    baseline = results[results["intervention"] == "baseline"].set_index("sample_id")
    for sample, loss in losses.items():
        assert baseline.loc[sample, "scored_tokens"] == len(loss)
        assert abs(loss.mean() - baseline.loc[sample, "loss"]) <= 1e-5 * loss.mean()
    every = np.concatenate(list(losses.values()))
    clean = (baseline["loss"] * baseline["scored_tokens"]).sum() / baseline["scored_tokens"].sum()
    assert abs(every.mean() - clean) <= 1e-5 * clean
