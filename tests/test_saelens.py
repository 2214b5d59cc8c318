"""SAELens as the real client of the runner's output: it reads the export as it is and trains on it,
and on the token loader directly; TransformerLens names the stored layers as docs/training.md says."""

import copy
import os
import re
import shutil
import warnings

import numpy as np
import pytest

from activations.reader import iter_activations
from activations.token_loader import LoaderConfig, TokenLoader
from fixtures.stored_activations import export_order
from tests.conftest import REPO, read_streams, run_in_process

pytestmark = pytest.mark.slow
LAYERS = (1, 3)
HIDDEN = 64  # the tiny model's
CONTEXT = 32


@pytest.fixture(scope="module")
def run_output(arc_streams, tiny_checkpoints, tmp_path_factory):
    """The runner's output for 24 real ARC prompts on 2 machines (several shards each), merged."""
    out = tmp_path_factory.mktemp("activations")
    for machine in (0, 1):
        result = run_in_process("runners.tpu_host", "--machine_id", str(machine), "--streams_dir", str(arc_streams),
                                "--model_path", tiny_checkpoints["gqa_tied"], "--output_dir", str(out / "run"),
                                "--shard_size_gb", "0.0002", "--batch_size", "2", "--max_seq_length", "160",
                                "--dtype", "float32", "--layers_to_extract", "1,3")
        assert result.returncode == 0, result.stderr
    index = out / "index.parquet"
    result = run_in_process("pipeline.index", "--activations_dir", str(out / "run"), "--output", str(index))
    assert result.returncode == 0, result.stderr
    assert len(list((out / "run").glob("machine_*/shard_*.pkl.gz"))) >= 3
    return str(index)


def export(index, out, *flags):
    result = run_in_process("pipeline.export", "--format", "saelens", "--index", index, "--output_dir", str(out),
                            "--layers", "1,3", "--context_size", str(CONTEXT), *flags)
    assert result.returncode == 0, result.stderr
    return str(out)


def activations_store(path, hook_name, d_in=HIDDEN, context=CONTEXT, **kw):
    from sae_lens.training.activations_store import ActivationsStore
    settings = dict(n_batches_in_buffer=8, store_batch_size_prompts=1, train_batch_size_tokens=64)
    settings.update(kw)
    return ActivationsStore(model=None, dataset=None, streaming=False, hook_name=hook_name,
                            hook_head_index=None, context_size=context, d_in=d_in, total_training_tokens=10**6,
                            prepend_bos=False, normalize_activations="none", device="cpu", dtype="float32",
                            cached_activations_path=path, **settings)


def one_epoch(store):
    """([tokens, d_in] activations, [tokens] token ids) of the store's rows, read in order once."""
    acts, ids = [], []
    while True:
        try:
            a, t = store.get_raw_llm_batch(raise_on_epoch_end=True)
        except StopIteration:
            return np.concatenate(acts), np.concatenate(ids)
        acts.append(a.numpy())
        ids.append(t.numpy())


def stored_in_order(index, layer):
    """Every stored token of ``layer`` in an unshuffled export's order (by sample id, position by
    position), read from whole shards."""
    ids = export_order(index)
    arrays = dict(iter_activations(index, ids, layer))
    return np.concatenate([arrays[i] for i in ids])


def test_activations_store_reads_the_unshuffled_export_as_stored(run_output, arc_streams, tmp_path):
    path = export(run_output, tmp_path / "ordered", "--seed", "none")
    streams = {r["sample_id"]: r for s in read_streams(arc_streams, 2) for r in s}
    stored_ids = np.concatenate([streams[i]["input_ids"] for i in export_order(run_output)])
    for layer in LAYERS:
        got, ids = one_epoch(activations_store(path, f"blocks.{layer}.hook_resid_post"))
        expected = stored_in_order(run_output, layer)
        assert got.dtype == np.float32 and len(got) == len(expected) // CONTEXT * CONTEXT
        assert np.array_equal(got, expected[:len(got)])  # bitwise
        assert np.array_equal(ids, stored_ids[:len(got)])


def sae_loss(sae, batch):
    """SAELens's own training loss (reconstruction + L1) of ``sae`` on ``batch``."""
    import torch
    from sae_lens.saes.sae import TrainStepInput
    step = TrainStepInput(sae_in=batch, coefficients={"l1": 1e-3}, dead_neuron_mask=None,
                          n_training_steps=0, is_logging_step=False)
    with torch.no_grad():
        return float(sae.training_forward_pass(step).loss)


def train(data_provider, save_to, steps=60, batch=64):
    """A small standard SAE trained by SAELens's own SAETrainer; its loss on one held batch before
    and after, and the SAE read back from disk."""
    import torch
    from sae_lens import SAE, SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import LoggingConfig, SAETrainerConfig
    torch.manual_seed(0)
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=HIDDEN, d_sae=128, l1_coefficient=1e-3))
    held = next(data_provider).clone()
    before = sae_loss(copy.deepcopy(sae), held)
    cfg = SAETrainerConfig(total_training_samples=steps * batch, train_batch_size_samples=batch, lr=3e-3,
                           lr_end=3e-3, device="cpu", logger=LoggingConfig(log_to_wandb=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "beginning new epoch": the data is small on purpose
        trainer = SAETrainer(cfg=cfg, sae=sae, data_provider=data_provider)
        trained = trainer.fit()
    assert trainer.n_training_steps == steps
    after = sae_loss(trained, held)
    trained.save_model(str(save_to))
    loaded = SAE.load_from_disk(str(save_to))
    for name, value in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    return before, after


def test_sae_trainer_trains_from_the_export(run_output, tmp_path):
    path = export(run_output, tmp_path / "shuffled", "--seed", "0")
    store = activations_store(path, "blocks.3.hook_resid_post", store_batch_size_prompts=4)
    before, after = train(iter(store), tmp_path / "sae")
    assert after < 0.5 * before, (before, after)


def test_sae_trainer_trains_from_the_loader_directly(run_output, tmp_path):
    loader = TokenLoader(LoaderConfig(index=run_output, layers=(3,), batch_tokens=64, buffer_tokens=1024,
                                      seed=0, drop_last=True))
    before, after = train(loader.arrays(as_torch=True), tmp_path / "sae")
    assert after < 0.5 * before, (before, after)


def test_stored_layers_are_transformer_lens_resid_post(run_output, arc_streams, tiny_checkpoints):
    """Layer L is TransformerLens's blocks.L.hook_resid_post for every L, and Hugging Face's
    hidden_states[L + 1] except the last block (normed there)."""
    import torch
    from transformer_lens import HookedTransformer
    from transformer_lens import loading_from_pretrained as loading
    from transformer_lens.pretrained.weight_conversions import convert_qwen2_weights
    from transformers import Qwen2ForCausalLM
    path = tiny_checkpoints["gqa_tied"]
    hf = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = loading.get_pretrained_model_config(path, device="cpu", dtype=torch.float32)
    tl = HookedTransformer(cfg)
    tl.load_and_process_state_dict(convert_qwen2_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                   center_unembed=False, fold_value_biases=False)
    records = read_streams(arc_streams, 2)[0][:3]
    for layer in LAYERS:
        stored = dict(iter_activations(run_output, [r["sample_id"] for r in records], layer))
        for record in records:
            tokens = torch.tensor([record["input_ids"]])
            _, cache = tl.run_with_cache(tokens, names_filter=[f"blocks.{layer}.hook_resid_post"])
            expected = cache[f"blocks.{layer}.hook_resid_post"][0].detach().numpy()
            ours = stored[record["sample_id"]]
            assert np.abs(ours - expected).max() <= 1e-5 * np.abs(expected).max()
            hidden = hf(tokens, output_hidden_states=True).hidden_states[layer + 1][0].detach().numpy()
            last = layer == cfg.n_layers - 1
            assert np.allclose(ours, hidden, atol=1e-5 * np.abs(hidden).max()) != last


def documented_snippets() -> list[str]:
    text = (REPO / "docs" / "training.md").read_text()
    return re.findall(r"```python\n(# SAELens: .*?)```", text, re.S)


def test_the_documented_snippets_train_offline(run_output, tmp_path, monkeypatch):
    """docs/training.md's two SAELens blocks, as written, on the tiny model's output (settings scaled down)."""
    export(run_output, tmp_path / "sae_cache", "--seed", "0")
    for name in ("index.parquet", "index_arrays.parquet", "merged_metadata.json"):
        shutil.copy(os.path.join(os.path.dirname(run_output), name), tmp_path / name)
    monkeypatch.chdir(tmp_path)
    from_export, from_loader = documented_snippets()
    settings = 'HOOK, D_IN, CONTEXT, BATCH, TOKENS = "blocks.12.hook_resid_post", 896, 128, 4096, 100_000_000'
    assert settings in from_export and "layers=(12,)" in from_loader
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(from_export.replace(settings, f'HOOK, D_IN, CONTEXT, BATCH, TOKENS = "blocks.3.hook_resid_post", '
                                           f'{HIDDEN}, {CONTEXT}, 64, 3200'), namespace)
        exec(from_loader.replace("layers=(12,)", "layers=(3,)"), namespace)
    for folder in ("sae_out", "sae_out_loader"):
        assert (tmp_path / folder / "cfg.json").exists() and (tmp_path / folder / "sae_weights.safetensors").exists()
    assert namespace["sae"].cfg.d_in == HIDDEN


@pytest.fixture(scope="module")
def shuffled_export(run_output, tmp_path_factory):
    return export(run_output, tmp_path_factory.mktemp("exports") / "shuffled", "--seed", "0")


def test_train_sae_prints_a_falling_loss_curve_and_saves_a_loadable_sae(shuffled_export, tmp_path):
    from sae_lens import SAE
    result = run_in_process("runners.train_sae", "--export_dir", shuffled_export, "--hook_name",
                            "blocks.3.hook_resid_post", "--steps", "40", "--batch_tokens", "64",
                            "--log_every", "10", "--dead_window", "20", "--lr", "3e-3", "--l1_coefficient", "1e-3",
                            "--output_dir", str(tmp_path / "sae"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    curve = [float(re.search(r"loss +([\d.]+)", line).group(1)) for line in lines if line.startswith("step")]
    assert [line.split()[1] for line in lines if line.startswith("step")] == ["10", "20", "30", "40"]
    assert curve[-1] < 0.5 * curve[0], curve
    summary = re.search(r"runners.train_sae: 40 steps of 64 tokens, 256 latents: .* dead latents ([\d.]+)%", lines[-1])
    assert summary and 0 <= float(summary.group(1)) <= 100, lines[-1]
    assert SAE.load_from_disk(str(tmp_path / "sae")).cfg.d_sae == 256


@pytest.mark.parametrize("flags, message", [
    (["--dead_window", "50", "--steps", "10"], "--dead_window 50 is longer than the training (--steps 10)"),
    (["--hook_name", "blocks.9.hook_resid_post"], "--hook_name: choose one of the export's columns: "
                                                  "blocks.1.hook_resid_post, blocks.3.hook_resid_post"),
])
def test_train_sae_refuses_bad_settings_in_one_line(shuffled_export, flags, message):
    result = run_in_process("runners.train_sae", "--export_dir", shuffled_export, *flags)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"runners.train_sae: error: {message}"]


def test_train_sae_names_a_directory_that_is_no_export(tmp_path):
    result = run_in_process("runners.train_sae", "--export_dir", str(tmp_path))
    assert result.returncode == 2 and "is not a pipeline.export --format saelens directory" in result.stderr
