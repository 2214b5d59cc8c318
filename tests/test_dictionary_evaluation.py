"""The held-out evaluation of a saved dictionary (``dictionaries.evaluation``): its metrics against
SAELens's own model of the saved files and its evaluation's formulas, ``sparsity.safetensors``
against SAELens's trainer's, and the CE loss score against transformers' float64 forward of the
checkpoint with a hook splicing the same output in."""

from __future__ import annotations

import functools
import json
import warnings

import jax
import numpy as np
import pytest

from activations.index import arrays_path
from activations.reader import read_activations
from activations.token_loader import LoaderConfig, TokenLoader
from activations.token_plan import stored_arrays
from common.cli import UserError
from dictionaries.config import DictionaryConfig
from dictionaries.evaluation import DENSE_DENSITY, ce_loss, check_ce_loss, evaluate, scoring_model, write_sparsity
from dictionaries.sae import init_params
from dictionaries.saelens_format import inference_weights, write_saelens
from fixtures.stored_activations import StoredSpec, write_stored
from model.sites import normalized_key
from tests.conftest import run_in_process

torch = pytest.importorskip("torch")
sae_lens = pytest.importorskip("sae_lens")

RESID, LN2, MLP_OUT = "blocks.0.hook_resid_post", "blocks.0.ln2.hook_normalized", "blocks.0.hook_mlp_out"
STORE = StoredSpec(num_machines=1, samples_per_machine=8, lengths=(4, 12), hidden_size=8, layers=(0,),
                   sites=("hook_resid_post", "ln2.hook_normalized", "hook_mlp_out"),
                   linked=("ln2.hook_normalized", "hook_mlp_out"), shard_size_bytes=3_000)


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> str:
    return write_stored(str(tmp_path_factory.mktemp("store")), STORE)


def trained_like(config: DictionaryConfig, d_in: int, d_out: int) -> dict[str, np.ndarray]:
    """Initial weights with every bias drawn, latents 0-1 held off (dead) and 2-3 held on (dense)."""
    params = {k: np.array(v) for k, v in init_params(config, d_in, d_out, jax.random.key(1), np.float32).items()}
    rng = np.random.default_rng(2)
    params["b_enc"] = rng.normal(0, 0.05, params["b_enc"].shape).astype(np.float32)
    params["b_enc"][:4] = [-100, -100, 100, 100]
    params["b_dec"] = rng.normal(0, 0.1, params["b_dec"].shape).astype(np.float32)
    if "threshold" in params:  # a negative one: SAELens's JumpReLU still fires only on positive pre-activations
        params["threshold"][4], params["b_enc"][4] = -0.5, -0.2
    if "W_skip" in params:
        params["W_skip"] = rng.normal(0, 0.1, params["W_skip"].shape).astype(np.float32)
    return params


CASES = {  # name: (config, transcoder, BatchTopK's threshold)
    "standard": (DictionaryConfig(architecture="standard", d_sae=16), False, 0.0),
    "topk": (DictionaryConfig(architecture="topk", d_sae=16, k=4), False, 0.0),
    "batchtopk": (DictionaryConfig(architecture="batchtopk", d_sae=16, k=4), False, 0.05),
    "jumprelu_skip_transcoder": (DictionaryConfig(architecture="jumprelu", d_sae=16, skip=True), True, 0.0),
}


@pytest.mark.parametrize("case", CASES)
def test_the_metrics_are_saelens_evaluation_of_the_saved_files(index, tmp_path, case):
    config, transcoder, threshold = CASES[case]
    keys = (LN2, MLP_OUT) if transcoder else (RESID,)
    scales = (0.5, 2.0) if transcoder else (0.5, 0.5)
    params = trained_like(config, 8, 8)
    weights = inference_weights(config, params, threshold, *scales)
    # Every key the store holds, as a job training several dictionaries reads them; batches of 16
    # with a short last one, whose padding rows must not count.
    loader = TokenLoader(LoaderConfig(index=index, layers=(RESID, LN2, MLP_OUT), batch_tokens=16, buffer_tokens=32,
                                      seed=3))
    assert loader.total_tokens % 16
    input_key, target_key = (normalized_key(k) for k in (keys[0], keys[-1]))
    found = evaluate(loader, config, weights, input_key, target_key)

    hooks = {"hook_name": keys[0], "hook_name_out": keys[-1]}
    write_saelens(str(tmp_path), config, params, threshold, transcoder, hooks, *scales)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sae = sae_lens.SAE.load_from_disk(str(tmp_path))
    every = next(iter(TokenLoader(LoaderConfig(index=index, layers=keys, batch_tokens=10_000, seed=None))))
    x, y = (torch.from_numpy(every.activations[k]) for k in (input_key, target_key))
    with torch.no_grad():
        acts = sae.encode(x)
        out = sae(x)  # a skip-transcoder's skip included
    calculator = sae_lens.evals.ExplainedVarianceCalculator()
    calculator.add_batch(sae_output=out, hidden_acts=y)
    density = (acts != 0).double().mean(0).numpy()
    assert found.tokens == len(x)
    np.testing.assert_allclose(found.explained_variance, calculator.compute(), rtol=1e-5)
    np.testing.assert_allclose(found.mse, (y - out).pow(2).sum(-1).mean().item(), rtol=1e-5)
    np.testing.assert_allclose(found.l0, (acts != 0).sum(-1).double().mean().item(), rtol=1e-6)
    np.testing.assert_allclose(found.l1, acts.abs().sum(-1).mean().item(), rtol=1e-5)
    np.testing.assert_allclose(found.density, density, atol=1e-12)
    assert found.dead == np.sum(density == 0) >= 2 and found.dense == np.sum(density > DENSE_DENSITY) >= 2


def test_sparsity_is_saelens_log10_density_file(tmp_path):
    from safetensors.torch import load_file
    from sae_lens.training.sae_trainer import _log_feature_sparsity
    density = np.array([0.0, 1e-7, 0.015625, 0.5, 1.0])
    path = write_sparsity(str(tmp_path), density)
    assert path == str(tmp_path / sae_lens.constants.SPARSITY_FILENAME)
    saved = load_file(path)  # as SAELens's hub loader reads it: the "sparsity" tensor
    assert list(saved) == ["sparsity"] and saved["sparsity"].dtype == torch.float32
    np.testing.assert_allclose(saved["sparsity"].numpy(), _log_feature_sparsity(torch.tensor(density)).numpy(),
                               rtol=1e-6)


def test_a_site_the_model_cannot_replace_is_refused_in_one_line():
    check_ce_loss(MLP_OUT)
    check_ce_loss(3)  # block 3's output
    with pytest.raises(UserError, match="no CE loss score at blocks.0.ln2.hook_normalized: the model's forward puts"):
        check_ce_loss(LN2)


# The CE loss: a tiny Qwen2 and a store of its own activations, made by the runner.
CE_LAYER = 1
CE_SITES = ("hook_resid_post", "attn.hook_z", "ln2.hook_normalized", "hook_mlp_out")
CE_KEYS = {"resid_post": ("hook_resid_post",), "attn_z": ("attn.hook_z",),  # an SAE's site, or a transcoder's
           "transcoder": ("ln2.hook_normalized", "hook_mlp_out")}              # input and output sites
CE_LENGTHS = (9, 14, 6, 17, 11)


@pytest.fixture(scope="module")
def model_store(tmp_path_factory):
    """(the checkpoint, the merged index, {sample_id: token ids}) of a runners.tpu_host store."""
    from fixtures.tiny_models import SMALL_VOCAB, write_checkpoint
    tmp = tmp_path_factory.mktemp("ce")
    path = write_checkpoint(tmp / "qwen2", "qwen2", norm_std=0.2, vocab_size=SMALL_VOCAB)
    rng = np.random.default_rng(5)
    ids = {i: rng.integers(0, SMALL_VOCAB, n).tolist() for i, n in enumerate(CE_LENGTHS)}
    (tmp / "stream.jsonl").write_text("".join(json.dumps(
        {"sample_id": i, "input_ids": seq, "num_tokens": len(seq), "truncated": False, "source": "random",
         "text_preview": "", "roles": [["text", len(seq)]], "special": []}) + "\n" for i, seq in ids.items()))
    done = run_in_process("runners.tpu_host", "--machine_id", "0", "--dataset_stream", str(tmp / "stream.jsonl"),
                          "--model_path", path, "--output_dir", str(tmp / "store"), "--layers_to_extract",
                          str(CE_LAYER), "--sites", ",".join(CE_SITES),
                          "--batch_size", "8", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    merged = run_in_process("pipeline.index", "--activations_dir", str(tmp / "store"), "--output",
                            str(tmp / "index.parquet"))
    assert merged.returncode == 0, merged.stderr
    return path, str(tmp / "index.parquet"), ids


@pytest.fixture(scope="module")
def scorer(model_store):
    """The store's model, loaded once for every dictionary (as a job with several loads it)."""
    _, index, _ = model_store
    return scoring_model(TokenLoader(LoaderConfig(index=index, layers=(CE_LAYER,))), batch_size=4)


@functools.lru_cache(maxsize=1)
def reference_model(path: str):
    from fixtures.hf_reference import load_reference
    return load_reference(path, "float64")


def reference_ce(path: str, site: str, splices: dict[int, tuple[list[int], np.ndarray, np.ndarray | None]]):
    """transformers' float64 mean next-token loss over the predictions at each sample's positions,
    with ``site`` of block CE_LAYER given the values there (None: as it is), by a hook on the
    module where the site is seen (``model.params.hf_site``)."""
    from fixtures.hf_reference import decoder_blocks, our_config
    from model.params import hf_site
    model = reference_model(path)
    where, side = hf_site(site, our_config(model), CE_LAYER)
    module = decoder_blocks(model)[CE_LAYER].get_submodule(where)
    losses = []
    for ids, positions, values in splices.values():
        def put(first, positions=positions, values=values):
            first = first.clone()
            first[0, positions] = torch.from_numpy(values)
            return first
        if values is None:
            handle = None
        elif side == "output":
            handle = module.register_forward_hook(lambda m, args, output: (put(output[0]), *output[1:])
                                                  if isinstance(output, tuple) else put(output))
        else:  # attn.hook_z: o_proj's input
            handle = module.register_forward_pre_hook(lambda m, args: (put(args[0]), *args[1:]))
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        if handle:
            handle.remove()
        log_probs = torch.log_softmax(logits, -1)
        losses += [-log_probs[p, ids[p + 1]].item() for p in positions if p + 1 < len(ids)]
    return float(np.mean(losses))


@pytest.mark.slow
@pytest.mark.parametrize("case", CE_KEYS)
def test_the_ce_loss_score_equals_transformers_with_the_output_spliced_by_a_hook(model_store, scorer, case):
    path, index, ids = model_store
    sites = CE_KEYS[case]
    keys = tuple(normalized_key(f"blocks.{CE_LAYER}.{site}") for site in sites)
    transcoder = len(keys) == 2
    every = tuple(normalized_key(f"blocks.{CE_LAYER}.{site}") for site in CE_SITES)
    stored = stored_arrays(index, every).rows(np.array([0, 1, 3]))  # the held-out rows
    loader = TokenLoader(LoaderConfig(index=index, layers=every, batch_tokens=64, exclude_first_positions=1,
                                      with_token_ids=True), stored=stored)
    config = DictionaryConfig(architecture="standard", d_sae=128)
    params = trained_like(config, 64, 64)
    if case == "resid_post":  # near the identity, relu(x) - relu(-x): a score near 1
        eye = np.eye(64, dtype=np.float32)
        params["W_enc"] = np.concatenate([eye, -eye], 1) + np.float32(0.1) * params["W_enc"]
        params["W_dec"], params["b_enc"], params["b_dec"] = np.concatenate([eye, -eye]), np.zeros(128, np.float32), \
            np.zeros(64, np.float32)
    weights = inference_weights(config, params, 0.0, 0.7, 0.7 if not transcoder else 1.3)
    got = ce_loss(loader, config, weights, keys[0], keys[-1], scorer)

    # The reference: each held-out sample's stored input, its output in float64 by the formula.
    key = keys[0]
    x = read_activations(arrays_path(index), stored.sample_id, [key])
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    splices = {}
    for sample in stored.sample_id.tolist():
        inputs = x[sample, key][1:].astype(np.float64)  # positions 1..: the first left out
        pre = (inputs if transcoder else inputs - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
        splices[sample] = (ids[sample], np.arange(1, len(ids[sample])), np.maximum(pre, 0) @ w["W_dec"] + w["b_dec"])
    site = sites[-1]
    clean = reference_ce(path, site, {s: (i, p, None) for s, (i, p, _) in splices.items()})
    spliced = reference_ce(path, site, splices)
    zero = reference_ce(path, site, {s: (i, p, np.zeros_like(v)) for s, (i, p, v) in splices.items()})
    assert got.samples == 3 and got.tokens == sum(CE_LENGTHS[s] - 2 for s in stored.sample_id)
    np.testing.assert_allclose([got.clean, got.spliced, got.zero], [clean, spliced, zero], atol=1e-5)
    assert got.score == (got.zero - got.spliced) / (got.zero - got.clean)
    if case == "resid_post":  # (a random dictionary's score is far from 1)
        assert 0.9 < got.score < 1 and 0.9 < (zero - spliced) / (zero - clean) < 1


@pytest.mark.slow
def test_the_job_evaluates_each_dictionary_on_its_held_out_samples(model_store, scorer, tmp_path):
    """The training job's evaluation.json and sparsity.safetensors: the metrics and CE loss score of
    the weights it saved, on the samples it held out of training."""
    from safetensors.numpy import load_file
    from dictionaries.job import split_rows
    _, index, _ = model_store
    site = f"blocks.{CE_LAYER}.hook_resid_post"
    done = run_in_process("runners.train_dictionary", "--index", index, "--site", site, "--output_dir",
                          str(tmp_path / "sae"), "--architecture", "topk", "--k", "8", "--expansion", "2",
                          "--steps", "6", "--batch_tokens", "16", "--eval_tokens", "20", "--no_tensorboard",
                          "--ce_loss_samples", "1")
    assert done.returncode == 0, done.stderr
    written = json.loads((tmp_path / "sae" / "evaluation.json").read_text())
    key = normalized_key(site)
    stored = stored_arrays(index, [key])
    held, _ = split_rows(stored, 20, 0, 1)
    loader = TokenLoader(LoaderConfig(index=index, layers=(key,), batch_tokens=16, with_token_ids=True),
                         stored=stored.rows(held))
    config = DictionaryConfig(architecture="topk", k=8, expansion=2)
    weights = load_file(str(tmp_path / "sae" / "sae_weights.safetensors"))
    found, ce = evaluate(loader, config, weights, key, key), ce_loss(loader, config, weights, key, key, scorer, 1)
    assert written["ce_loss"]["samples"] == 1 < len(held)
    assert written["tokens"] == found.tokens == int(stored.num_tokens[held].sum()) >= 20
    # Absolute as well: explained variance is 1 - a ratio of order 1, so near 0 its rounding is not relative.
    np.testing.assert_allclose([written[k] for k in ("explained_variance", "l0", "dead", "dense")],
                               [found.explained_variance, found.l0, found.dead, found.dense], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose([written["ce_loss"][k] for k in ("clean", "spliced", "zero")],
                               [ce.clean, ce.spliced, ce.zero], rtol=1e-6)
    sparsity = load_file(str(tmp_path / "sae" / "sparsity.safetensors"))["sparsity"]
    np.testing.assert_allclose(sparsity, np.log10(found.density + 1e-10), rtol=1e-6)
