"""``python -m runners.dashboard``: feature dashboards of a 2-machine store, checked against a plain
numpy recomputation over every stored token (top tokens, density, histograms, intervals, contexts,
logit effects through the checkpoint's unembedding as transformers holds it), written
byte-identically by 1 and 2 workers, read back by SAELens and DuckDB; bad input in one line.
Every test here runs dashboard jobs over a store (end-to-end: marked slow)."""

import json
import os
import pathlib
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from activations.index import arrays_path
from activations.reader import read_activations
from features.neuronpedia import token_strings
from fixtures.qwen_tokenizer import cached_tokenizer_dir
from fixtures.stored_activations import StoredSpec, stream_token_ids, write_stored
from fixtures.tiny_models import write_checkpoint
from tests.conftest import run_in_process
from tests.test_host_errors import one_line_error

pytestmark = pytest.mark.slow

HIDDEN, D_SAE, LENGTH = 64, 24, 16  # the tiny Qwen2's width; every sample LENGTH tokens (SAEDashboard's prompts)
BINS, INTERVALS = 50, 5  # SAEDashboard's histogram bins and activation intervals (docs/dashboards.md)
SPEC = StoredSpec(num_machines=2, samples_per_machine=6, lengths=(LENGTH, LENGTH), hidden_size=HIDDEN, layers=(1,),
                  vocab_size=5000, seed=1, shard_size_bytes=12_000)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the store's index, a tiny Qwen2 checkpoint with the Qwen2.5 tokenizer, a saved SAELens SAE of layer 1)."""
    import sae_lens
    import torch
    from sae_lens.saes.sae import SAEMetadata
    root = tmp_path_factory.mktemp("dashboard")
    index = write_stored(str(root / "store"), SPEC)
    model = write_checkpoint(root / "model", "qwen2", norm_std=0.2, vocab_size=6000)  # the store's ids are < 5000
    for name in os.listdir(cached_tokenizer_dir()):
        shutil.copy(cached_tokenizer_dir() / name, model)
    sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(
        d_in=HIDDEN, d_sae=D_SAE, metadata=SAEMetadata(hook_name="blocks.1.hook_resid_post")))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in sae.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        sae.b_enc -= 1.5  # sparse enough that the intervals and histograms have shape
        sae.b_enc[3] = -100.0  # a feature that never fires
    sae.save_model(str(root / "sae"))
    return index, model, str(root / "sae")


def dashboards(setup, out, *flags) -> None:
    index, model, sae = setup
    result = run_in_process("runners.dashboard", "--index", index, "--features", sae, "--model_path", model,
                            "--output_dir", str(out), "--features_per_batch", "10", *flags)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def written(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "dashboards"
    dashboards(setup, out, "--context", "all")
    return out


@pytest.fixture(scope="module")
def plain(setup) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(activations [tokens, F] float64 as the SAE with unit decoder rows gives them, sample ids,
    positions) of every stored token, from the stored arrays and the saved weights."""
    from safetensors.numpy import load_file
    index, _, sae = setup
    weights = {k: v.astype(np.float64) for k, v in load_file(os.path.join(sae, "sae_weights.safetensors")).items()}
    norm = np.linalg.norm(weights["W_dec"], axis=1)
    ids = sorted(stream_token_ids(os.path.dirname(index)))
    stored = read_activations(arrays_path(index), ids, [1])
    rows = np.concatenate([stored[s, 1] for s in ids]).astype(np.float64)
    acts = np.maximum((rows - weights["b_dec"]) @ weights["W_enc"] + weights["b_enc"], 0) * norm
    sample_ids = np.concatenate([np.full(len(stored[s, 1]), s) for s in ids])
    positions = np.concatenate([np.arange(len(stored[s, 1])) for s in ids])
    return acts, sample_ids, positions


@pytest.fixture(scope="module")
def unembedding(setup) -> np.ndarray:
    """TransformerLens's W_U [hidden, vocab] from transformers' weights: the final norm folded in,
    centred (the checkpoint loaded once for the module)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(setup[1])
    folded = hf.model.norm.weight.detach().double().numpy()[:, None] * hf.lm_head.weight.detach().double().numpy().T
    return folded - folded.mean(axis=1, keepdims=True)


@pytest.fixture(scope="module")
def vocab(setup) -> dict[str, int]:
    """The tokenizer's strings -> ids, added tokens included (what SAEDashboard reads: ``tokenizer.vocab``)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(setup[1]).vocab


def percent(share: float) -> float:
    """A share as a percentage to 3 places, over 100 (docs/dashboards.md: frac_nonzero, an interval's share)."""
    return round(share * 100, 3) / 100


def files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def features_of(out: pathlib.Path) -> list[dict]:
    batches = sorted(out.glob("batch-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return [f for path in batches for f in json.loads(path.read_text())["features"]]


def test_every_number_is_the_plain_recomputation_over_every_stored_token(setup, written, plain, vocab):
    import torch
    acts, sample_ids, positions = plain
    tokens, features = len(acts), features_of(written)
    assert [f["feature_index"] for f in features] == list(range(D_SAE))
    assert [len(json.loads(p.read_text())["features"]) for p in sorted(written.glob("batch-*.json"))] == [8, 8, 8]
    top = pq.read_table(written / "top_activations.parquet").to_pandas()
    strings = token_strings(vocab, 0)
    ids = stream_token_ids(os.path.dirname(setup[0]))
    for f, feature in enumerate(features):
        values = acts[:, f]
        order = np.lexsort((positions, sample_ids, -values))[:20]  # by value, then sample id, then position
        mine = top[top.feature == f].sort_values("rank")
        assert mine["sample_id"].tolist() == sample_ids[order].tolist()
        assert mine["position"].tolist() == positions[order].tolist()
        np.testing.assert_allclose(mine["value"], values[order], rtol=1e-5, atol=1e-5)
        positive = values[values > 0]
        assert feature["frac_nonzero"] == (percent(len(positive) / tokens) if len(positive) else 0)
        if len(positive):  # the histogram: torch.histc's, over its default range [least, maximum] of the values
            counts = torch.histc(torch.from_numpy(positive.astype(np.float32)), bins=BINS).numpy()
            lo, hi = positive.min(), positive.max()
            edges = lo + (hi - lo) * np.arange(1, BINS) / BINS
            near_edge = int((np.abs(positive[:, None] - edges) < 1e-4 * hi).sum())  # float32 rounding may move these
            assert np.abs(np.array(feature["freq_hist_data_bar_heights"]) - counts).sum() <= 2 * near_edge
        else:
            assert feature["freq_hist_data_bar_heights"] == [] and f == 3
        groups = [a for a in feature["activations"] if a["bin_min"] == -1]
        assert len(groups) == 20
        for example, k in zip(groups, order):  # whole samples but their first token, as SAEDashboard shows them
            s, p = sample_ids[k], positions[k]
            assert example["tokens"] == [strings[t] for t in ids[s][1:LENGTH]]
            assert example["qualifying_token_index"] == p - 1
            np.testing.assert_allclose(example["values"], np.round(acts[sample_ids == s, f][1:], 3), atol=1.01e-3)
        bounds = np.linspace(0, values.max(), INTERVALS + 1)  # equal-width intervals over [0, maximum]
        intervals = [a for a in feature["activations"] if a["bin_min"] != -1]
        for i in range(INTERVALS) if len(positive) else ():  # highest first; each example inside its interval
            low, high = bounds[INTERVALS - 1 - i], bounds[INTERVALS - i]
            inside = (values >= low - 1e-5) & (values <= high + 1e-5)
            group = [a for a in intervals if abs(a["bin_max"] - high) < 6e-4]  # written to 3 places
            assert len(group) == min(5, int(inside.sum()))
            for example in group:
                assert example["bin_contains"] == percent(inside.sum() / tokens)
                if example["qualifying_token_index"] >= 0:  # -1: a sample's first token, not shown (SAEDashboard's)
                    value = example["values"][example["qualifying_token_index"]]
                    assert low - 1e-3 <= value <= high + 1e-3
    from safetensors.numpy import load_file
    sparsity = load_file(str(written / "sparsity.safetensors"))
    expected = np.log10((acts > 0).mean(axis=0) + 1e-10).astype(np.float32)
    np.testing.assert_allclose(sparsity["sparsity"], expected, rtol=1e-6)
    viewer = json.loads((written / "viewer" / "data.js").read_text().removeprefix("const DASHBOARD = ").rstrip(";\n"))
    assert viewer["features"] == features and viewer["key"] == "blocks.1.hook_resid_post"  # the same dashboards
    manifest = json.loads((written / "dashboard.json").read_text())
    assert manifest["tokens_read"] == tokens and manifest["logit_effects"] and not (written / "_work").exists()


def test_logit_effects_are_the_unit_decoder_rows_through_the_folded_centred_unembedding(setup, written, unembedding,
                                                                                        vocab):
    from safetensors.numpy import load_file
    from features.dashboard import logit_effects
    decoder = load_file(os.path.join(setup[2], "sae_weights.safetensors"))["W_dec"].astype(np.float64)
    logits = (decoder / np.linalg.norm(decoder, axis=1, keepdims=True)) @ unembedding  # [F, vocab]
    ours = logit_effects((decoder / np.linalg.norm(decoder, axis=1, keepdims=True)).astype(np.float32),
                         unembedding.astype(np.float32))
    scale = np.abs(logits).max()
    for f in range(D_SAE):
        top, bottom = np.argsort(-logits[f])[:10], np.argsort(logits[f])[:10]
        assert ours.top_ids[f].tolist() == top.tolist() and ours.bottom_ids[f].tolist() == bottom.tolist()
        np.testing.assert_allclose(ours.top_values[f], logits[f, top], rtol=1e-5, atol=1e-5 * scale)
        np.testing.assert_allclose(ours.bottom_values[f], logits[f, bottom], rtol=1e-5, atol=1e-5 * scale)
        assert ours.histogram[f].sum() == logits.shape[1]
    strings = token_strings(vocab, logits.shape[1])
    for f, feature in enumerate(features_of(written)):  # the job's own, from model.unembedding
        assert feature["pos_str"] == [strings[i] for i in np.argsort(-logits[f])[:10]]
        assert feature["neg_str"] == [strings[i] for i in np.argsort(logits[f])[:10]]
        np.testing.assert_allclose(feature["pos_values"], np.round(logits[f, np.argsort(-logits[f])[:10]], 3),
                                   atol=1.01e-3)


def test_two_workers_write_what_one_does_and_consumers_read_it(setup, written, tmp_path):
    import duckdb
    out = tmp_path / "two"
    dashboards(setup, out, "--context", "all", "--direct_num_workers", "2", "--direct_running_mode",
               "multi_processing")
    assert files(out) == files(written)
    table = duckdb.sql(f"SELECT feature, count(*) AS n, max(value) AS top FROM '{written}/top_activations.parquet' "
                       "GROUP BY feature ORDER BY feature").fetchall()
    assert [row[1] for row in table] == [20] * D_SAE


def test_most_active_and_context_windows(setup, written, tmp_path):
    out = tmp_path / "windows"
    dashboards(setup, out, "--context", "2", "--most_active", "5")
    shown = features_of(out)
    density = {f["feature_index"]: f["frac_nonzero"] for f in features_of(written)}
    assert [f["feature_index"] for f in shown] == sorted(sorted(density, key=lambda i: (-density[i], i))[:5])
    for feature in shown:
        for example in feature["activations"]:
            assert 1 <= len(example["tokens"]) <= 5 and 0 <= example["qualifying_token_index"] <= 2
    assert (out / "sparsity.safetensors").exists()  # every feature measured: SAELens's file is written


def test_bad_input_is_one_line(setup, tmp_path):
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata
    index, model, sae = setup
    run = lambda *flags: run_in_process("runners.dashboard", "--index", index, "--model_path", model,  # noqa: E731
                                        "--output_dir", str(tmp_path / "out"), *flags)
    narrow = tmp_path / "narrow"
    sae_lens.StandardSAE(sae_lens.StandardSAEConfig(
        d_in=32, d_sae=4, metadata=SAEMetadata(hook_name="blocks.1.hook_resid_post"))).save_model(str(narrow))
    one_line_error(run("--features", str(narrow)), "reads 32 dimensions, but the store holds layer 1 64 wide",
                   "runners.dashboard")
    elsewhere = tmp_path / "elsewhere"
    sae_lens.StandardSAE(sae_lens.StandardSAEConfig(
        d_in=HIDDEN, d_sae=4, metadata=SAEMetadata(hook_name="blocks.3.hook_resid_post"))).save_model(str(elsewhere))
    one_line_error(run("--features", str(elsewhere)), "layer 3", "runners.dashboard")
    from activations.directions import write_directions
    other = str(tmp_path / "other.npz")
    write_directions(other, {("probe", 1): np.ones(HIDDEN)}, {"model": "x", "model_type": "llama",
                                                              "num_hidden_layers": 28, "hidden_size": HIDDEN})
    one_line_error(run("--features", other), "holds directions of another model", "runners.dashboard")
    one_line_error(run("--features", sae, "--streams_dir", str(tmp_path)), "stream", "runners.dashboard")
    one_line_error(run("--features", sae, "--tokenizer", str(tmp_path / "none")), "cannot load tokenizer",
                   "runners.dashboard")
    assert not (tmp_path / "out").exists()  # nothing written before the job could run


def test_saelens_reads_the_sparsity_beside_the_sae_from_the_hub(setup, written, plain, tmp_path, monkeypatch):
    """``SAE.from_pretrained_with_cfg_and_sparsity`` over the real hub client, offline, from a hub
    cache holding the SAE with the job's sparsity.safetensors beside it."""
    from fixtures.hub_cache import write_hub_cache
    repo = tmp_path / "repo"
    shutil.copytree(setup[2], repo / "layer_1")
    shutil.copy(written / "sparsity.safetensors", repo / "layer_1")
    write_hub_cache(str(tmp_path / "hub"), "tests/dashboard-sae", {"main": str(repo)})
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    from sae_lens import SAE
    _, _, sparsity = SAE.from_pretrained_with_cfg_and_sparsity("tests/dashboard-sae", "layer_1")
    acts, _, _ = plain
    np.testing.assert_allclose(sparsity.numpy(), np.log10((acts > 0).mean(axis=0) + 1e-10), rtol=1e-6)


def test_saedashboard_reads_every_batch_file_and_its_own_functions_agree(setup, written, plain, vocab, tmp_path,
                                                                         saedashboard_interpreter):
    """SAEDashboard 0.8.0, in an environment of its own (tests/saedashboard.py), loads every batch
    file with NeuronpediaDashboardBatch, finds exactly its keys, and its SequenceDataGenerator,
    ActsHistogramData.from_data and get_logits_table_data, fed the same arrays, agree feature by
    feature within its own tolerances (tests/saedashboard_check.py)."""
    import subprocess
    from features.dashboard import folded, logit_vectors
    from features.encoders import load_features
    from model.unembedding import folded_unembedding
    index, model, sae = setup
    acts, sample_ids, positions = plain
    ids = stream_token_ids(os.path.dirname(index))
    samples = sorted(ids)
    # The job's own logits (their values are checked against transformers' weights above): SAEDashboard
    # bins them exactly, and 150k values computed twice differ in the last bit near some bin edge.
    features = folded(load_features(sae))
    unit = features.decoder / np.linalg.norm(features.decoder, axis=1, keepdims=True)
    logits = np.concatenate([np.asarray(part) for part in logit_vectors(unit, folded_unembedding(model))])  # [F, V]
    by_id = {i: text for text, i in vocab.items()}
    np.savez(tmp_path / "input.npz", tokens=np.array([ids[s] for s in samples], np.int64),  # [B, S]
             feature_acts=acts.T.reshape(D_SAE, len(samples), LENGTH).astype(np.float32),  # [F, B, S]
             feature_indices=np.arange(D_SAE), logits=logits.astype(np.float32),
             vocab_json=np.array(json.dumps([by_id.get(i) for i in range(logits.shape[1])])))
    assert (sample_ids.reshape(len(samples), LENGTH)[:, 0] == samples).all()  # rows in ascending sample id
    result = subprocess.run([saedashboard_interpreter, str(pathlib.Path(__file__).parent / "saedashboard_check.py"),
                             str(tmp_path / "input.npz"), str(written)], capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["ok"], [f for f in report["features"] if not f["ok"]][:2]
    assert report["features_in_files"] == D_SAE and all(f["ok"] for f in report["features"])


def top_rows(out: pathlib.Path) -> dict[int, list[tuple]]:
    """top_activations.parquet as feature -> [(sample id, position, value), ...] by rank."""
    table = pq.read_table(out / "top_activations.parquet").to_pandas().sort_values(["feature", "rank"])
    return {int(f): list(zip(g.sample_id, g.position, g.value)) for f, g in table.groupby("feature")}


def test_a_subset_of_features_neurons_directions_and_topk_keep_their_numbers_and_values(setup, written, unembedding,
                                                                                        vocab, tmp_path):
    import sae_lens
    import torch
    from sae_lens.saes.sae import SAEMetadata
    from activations.directions import write_directions
    index, model, sae = setup
    # A subset: the same numbers, tokens and logit tables as in the run over every feature.
    dashboards(setup, tmp_path / "subset", "--feature_indices", "5,7-9")
    subset, full = features_of(tmp_path / "subset"), {f["feature_index"]: f for f in features_of(written)}
    assert [f["feature_index"] for f in subset] == [5, 7, 8, 9]
    for feature in subset:
        mine = full[feature["feature_index"]]
        assert feature["pos_str"] == mine["pos_str"] and feature["frac_nonzero"] == mine["frac_nonzero"]
        assert feature["freq_hist_data_bar_heights"] == mine["freq_hist_data_bar_heights"]
    assert {f: top_rows(written)[f] for f in (5, 7, 8, 9)} == top_rows(tmp_path / "subset")
    assert not (tmp_path / "subset" / "sparsity.safetensors").exists()  # SAELens's needs every feature
    # Neurons keep their dimensions' numbers; the first 2 positions of each sample left out.
    result = run_in_process("runners.dashboard", "--index", index, "--features", "neurons:hook_resid_post:1:40-43",
                            "--model_path", model, "--output_dir", str(tmp_path / "neurons"),
                            "--exclude_first_positions", "2", "--feature_indices", "41,43")
    assert result.returncode == 0, result.stderr
    ids = sorted(stream_token_ids(os.path.dirname(index)))
    stored = read_activations(arrays_path(index), ids, [1])
    for dim, rows in top_rows(tmp_path / "neurons").items():
        values = [(s, p, stored[s, 1][p, dim].astype(np.float32)) for s in ids for p in range(2, LENGTH)]
        expected = sorted(values, key=lambda t: (-t[2], t[0], t[1]))[:20]
        assert dim in (41, 43) and [(s, p) for s, p, _ in rows] == [(s, p) for s, p, _ in expected]
    strings = token_strings(vocab, unembedding.shape[1])
    for feature in features_of(tmp_path / "neurons"):
        assert feature["pos_str"] == [strings[i] for i in np.argsort(-unembedding[feature["feature_index"]])[:10]]
    # Directions: signed projections, named in dashboard.json.
    rng = np.random.default_rng(4)
    write_directions(str(tmp_path / "d.npz"), {("probe", 1): rng.standard_normal(HIDDEN),
                                               ("diff_in_means", 1): rng.standard_normal(HIDDEN)}, {"model": "x"})
    result = run_in_process("runners.dashboard", "--index", index, "--features", str(tmp_path / "d.npz"),
                            "--model_path", model, "--output_dir", str(tmp_path / "directions"))
    assert result.returncode == 0, result.stderr
    names = json.loads((tmp_path / "directions" / "dashboard.json").read_text())["feature_names"]
    assert sorted(names.values()) == ["diff_in_means/blocks.1.hook_resid_post", "probe/blocks.1.hook_resid_post"]
    assert all(0.2 < f["frac_nonzero"] < 0.8 for f in features_of(tmp_path / "directions"))  # signed: half above 0
    # A TopK SAE: a subset's features still compete with every other for the k slots.
    topk = sae_lens.TopKSAE(sae_lens.TopKSAEConfig(d_in=HIDDEN, d_sae=D_SAE, k=3, rescale_acts_by_decoder_norm=True,
                                                   metadata=SAEMetadata(hook_name="blocks.1.hook_resid_post")))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in topk.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    topk.save_model(str(tmp_path / "topk"))
    for name, flags in (("topk_all", ()), ("topk_two", ("--feature_indices", "2,11"))):
        result = run_in_process("runners.dashboard", "--index", index, "--features", str(tmp_path / "topk"),
                                "--model_path", model, "--output_dir", str(tmp_path / name), *flags)
        assert result.returncode == 0, result.stderr
    everything = top_rows(tmp_path / "topk_all")
    assert top_rows(tmp_path / "topk_two") == {2: everything[2], 11: everything[11]}
