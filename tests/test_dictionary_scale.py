"""The training job's scale and kinds: several dictionaries sharing one read (each what it would be
alone), a cross-layer transcoder, latent- and data-parallel meshes and several processes giving a
single device's weights, and the refusals that come before anything is written."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from activations.token_loader import LoaderConfig, TokenLoader
from activations.token_plan import stored_arrays
from dictionaries.config import DictionaryConfig, OptimizerConfig
from dictionaries.job import TrainingConfig, run, split_rows
from dictionaries.records import CHECKPOINT_FILE
from features.encoders import load_features
from fixtures.gcs_emulator import free_port
from fixtures.stored_activations import StoredSpec, write_stored
from model.sites import normalized_key
from tests.conftest import REPO, run_in_process

sae_lens = pytest.importorskip("sae_lens")

STORE = StoredSpec(num_machines=2, samples_per_machine=8, lengths=(8, 24), hidden_size=8, layers=(0, 1),
                   sites=("hook_resid_post", "ln2.hook_normalized", "hook_mlp_out"),
                   linked=("ln2.hook_normalized", "hook_mlp_out"), shard_size_bytes=4_000)
SMALL = dict(batch_tokens=32, buffer_tokens=128, eval_tokens=48, checkpoint_every=10, log_every=10, tensorboard=False)


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> str:
    return write_stored(str(tmp_path_factory.mktemp("store")), STORE)


def checkpoint(output_dir) -> dict[str, np.ndarray]:
    with np.load(os.path.join(output_dir, CHECKPOINT_FILE)) as saved:
        return {name: saved[name] for name in saved.files if "/params/" in name}


def test_a_layer_number_names_its_block_output():
    assert [t.inputs for t in TrainingConfig(index="i", site="12, blocks.3.hook_mlp_out", output_dir="o").trainees()] \
        == [(12,), (normalized_key("blocks.3.hook_mlp_out"),)]


def test_several_saes_share_a_read_and_each_is_what_it_would_be_alone(index, tmp_path):
    topk = DictionaryConfig(architecture="topk", k=3, expansion=4)
    both = run(TrainingConfig(index=index, site="blocks.0.hook_resid_post,blocks.1.hook_resid_post",
                              output_dir=str(tmp_path / "both"), steps=12, **SMALL), topk, OptimizerConfig(lr=3e-3))
    assert both.names == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    run(TrainingConfig(index=index, site="blocks.1.hook_resid_post", output_dir=str(tmp_path / "alone"),
                               steps=12, **SMALL), topk, OptimizerConfig(lr=3e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in both.names:
            loaded = sae_lens.SAE.load_from_disk(str(tmp_path / "both" / name))
            assert loaded.cfg.metadata.hook_name == name
    shared, single = checkpoint(tmp_path / "both"), checkpoint(tmp_path / "alone")
    for name, value in single.items():
        np.testing.assert_allclose(shared[name.replace("0/", "1/", 1)], value, rtol=1e-6, atol=1e-7)


def test_a_cross_layer_transcoder_trains_in_the_job(index, tmp_path):
    result = run(TrainingConfig(index=index, site="blocks.0.ln2.hook_normalized,blocks.1.ln2.hook_normalized",
                                target="blocks.0.hook_mlp_out,blocks.1.hook_mlp_out", clt=True,
                                output_dir=str(tmp_path / "clt"), steps=60, **SMALL),
                 DictionaryConfig(architecture="jumprelu", expansion=4, l0_coefficient=1e-3,
                                  jumprelu_init_threshold=0.01), OptimizerConfig(lr=1e-2))
    assert result.names == ["clt"] and result.widths == [(8, 32, 8)]
    saved = checkpoint(tmp_path / "clt")
    assert saved["0/params/W_dec_0"].shape == (32, 2, 8) and saved["0/params/W_dec_1"].shape == (32, 1, 8)
    assert result.final["clt"]["explained_variance"] > 0.5, result.final
    # circuit-tracer's CLT files, without config.yaml: the store names no model family it hooks
    assert sorted(os.listdir(tmp_path / "clt")) == [
        "W_dec_0.safetensors", "W_dec_1.safetensors", "W_enc_0.safetensors", "W_enc_1.safetensors", "checkpoint.npz",
        "clt_sites.json", "evaluation.json", "metrics.csv", "sparsity.safetensors"]
    # The held-out evaluation: the written files' CLT, by numpy, on the raw held-out rows.
    from safetensors.numpy import load_file
    files = {k: v.astype(np.float64) for name in os.listdir(tmp_path / "clt") if name.startswith("W_")
             for k, v in load_file(str(tmp_path / "clt" / name)).items()}
    keys = [normalized_key(f"blocks.{layer}.{site}") for site in ("ln2.hook_normalized", "hook_mlp_out")
            for layer in (0, 1)]
    stored = stored_arrays(index, keys)
    held, _ = split_rows(stored, 48, 0, 1)
    rows = {k: np.concatenate([b.activations[k] for b in TokenLoader(LoaderConfig(
        index=index, layers=tuple(keys), seed=None), stored=stored.rows(held)).batches()]).astype(np.float64)
        for k in keys}
    acts = []
    for layer in (0, 1):
        pre = rows[keys[layer]] @ files[f"W_enc_{layer}"].T + files[f"b_enc_{layer}"]
        acts.append(pre * (pre > files[f"threshold_{layer}"]))
    outs = [sum(acts[l] @ files[f"W_dec_{l}"][:, j - l] for l in range(j + 1)) + files[f"b_dec_{j}"] for j in (0, 1)]
    y, out = np.concatenate([rows[k] for k in keys[2:]], 1), np.concatenate(outs, 1)
    explained = 1 - np.sum((out - y) ** 2) / len(y) / (np.sum(y ** 2) / len(y) - np.sum(y.mean(0) ** 2))
    # runners.dashboard's features of layer 1: its latents as the files encode them, its whole write as the decoder
    layer_1 = load_features(str(tmp_path / "clt"), "blocks.1.ln2.hook_normalized")
    assert layer_1.output_key == normalized_key("blocks.1.hook_mlp_out")
    np.testing.assert_allclose(np.asarray(layer_1.encode(rows[keys[1]])), acts[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer_1.decoder, files["W_dec_1"].sum(1), rtol=1e-6)
    written = json.loads((tmp_path / "clt" / "evaluation.json").read_text())
    assert written["tokens"] == len(y)
    np.testing.assert_allclose([written["explained_variance"], written["l0"]],
                               [explained, np.mean([np.sum(f != 0, 1).mean() for f in acts])], rtol=1e-5)


def parity_config(output_dir, **changes) -> TrainingConfig:
    return TrainingConfig(index=str(changes.pop("index")), site="blocks.0.hook_resid_post", output_dir=str(output_dir),
                          steps=20, dtype="float64", data_parts=2, **{**SMALL, "checkpoint_every": 20}, **changes)


TOPK, ADAM = DictionaryConfig(architecture="topk", k=3, d_sae=32), OptimizerConfig(lr=3e-3, dead_feature_window=3)


def test_latents_over_four_devices_and_data_over_two_give_one_devices_weights(index, tmp_path):
    run(parity_config(tmp_path / "one", index=index), TOPK, ADAM, devices=1)
    run(parity_config(tmp_path / "mesh", index=index, model_axis=4), TOPK, ADAM)
    one, mesh = checkpoint(tmp_path / "one"), checkpoint(tmp_path / "mesh")
    for name, value in one.items():
        np.testing.assert_allclose(mesh[name], value, rtol=1e-5, atol=1e-12, err_msg=name)


@pytest.mark.slow
def test_two_processes_give_one_devices_weights(index, tmp_path):
    run(parity_config(tmp_path / "one", index=index), TOPK, ADAM, devices=1)
    port, env = free_port(), {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    flags = ["--index", index, "--site", "blocks.0.hook_resid_post", "--output_dir", str(tmp_path / "two"),
             "--steps", "20", "--dtype", "float64", "--data_parts", "2", "--model_axis", "2", "--batch_tokens", "32",
             "--buffer_tokens", "128", "--eval_tokens", "48", "--checkpoint_every", "20", "--no_tensorboard",
             "--architecture", "topk", "--k", "3", "--d_sae", "32", "--lr", "3e-3", "--dead_feature_window", "3",
             "--coordinator_address", f"localhost:{port}", "--num_processes", "2"]
    procs = [subprocess.Popen([sys.executable, "-m", "runners.train_dictionary", *flags, "--process_id", str(p)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for p in (0, 1)]
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    one, two = checkpoint(tmp_path / "one"), checkpoint(tmp_path / "two")
    for name, value in one.items():
        np.testing.assert_allclose(two[name], value, rtol=1e-5, atol=1e-12, err_msg=name)


HUGE = 1 << 34  # latents: far more than any device holds
BASE = ("--site", "blocks.0.hook_resid_post", "--eval_tokens", "48", "--batch_tokens", "32", "--steps", "5")


@pytest.mark.parametrize("flags, message", [
    (("--d_sae", "30", "--model_axis", "4"), "--d_sae 30 does not split over --model_axis 4 devices"),
    (("--batch_tokens", "36"), "--batch_tokens 36 does not split over the mesh's 8 data devices"),
    # float32 W_enc, W_dec (8 wide), b_enc, b_dec and Adam's two moments of each, the firing counts, the
    # step and the threshold; six [4, d_sae] step arrays a device (32 tokens over 8 data devices)
    (("--d_sae", str(HUGE)), f"needs {(3 * 4 * (17 * HUGE + 8) + 4 * HUGE + 8 + 6 * 4 * HUGE * 4) / 1e9:.2f} GB a "
     "device with --model_axis 1"),
    (("--tokens", "mean", "--target", "blocks.0.hook_mlp_out", "--site", "blocks.0.ln2.hook_normalized",
      "--architecture", "batchtopk"), "a pooled row is no token's input or output"),
    (("--site", "blocks.0.ln2.hook_normalized,blocks.1.ln2.hook_normalized", "--target", "blocks.0.hook_mlp_out"),
     "--target names 1 sites for --site's 2"),
    (("--clt", "--site", "blocks.1.ln2.hook_normalized,blocks.0.ln2.hook_normalized", "--target",
      "blocks.1.hook_mlp_out,blocks.0.hook_mlp_out"), "got layers [1, 0]"),
    (("--site", "blocks.7.hook_resid_post"), "layer 7 not stored under this index"),
])
def test_bad_input_is_one_line_and_writes_nothing(index, tmp_path, flags, message):
    result = run_in_process("runners.train_dictionary", "--index", index, "--output_dir", str(tmp_path / "out"),
                            *BASE, *flags)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1].startswith("runners.train_dictionary: error:"), result.stderr
    assert message in lines[-1] and "Traceback" not in result.stderr, lines[-1]
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_statistics_of_part_of_the_store_are_refused_when_normalizing(tmp_path):
    from tests.test_device_statistics import PARTIAL, STORE as PLANTED, without_statistics
    store = os.path.dirname(write_stored(str(tmp_path / "store"), dataclasses.replace(PLANTED, planted=None)))
    index, _ = without_statistics(store, tmp_path, [1])
    result = run_in_process("runners.train_dictionary", "--index", index, "--output_dir", str(tmp_path / "out"),
                            "--site", "blocks.0.hook_resid_post", "--eval_tokens", "8", "--batch_tokens", "8")
    assert result.returncode == 2 and PARTIAL in result.stderr.splitlines()[-1], result.stderr
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_transcoders_of_every_layer_are_written_as_circuit_tracers_transcoder_set(index, tmp_path):
    """Where the store's model is a family circuit-tracer hooks (here its metadata says Gemma 2,
    which reads ln2.hook_normalized), every layer's transcoder goes into its transcoder set too."""
    import shutil

    import yaml
    from safetensors.numpy import load_file

    from activations.index import merged_metadata_path
    store = tmp_path / "store"
    shutil.copytree(os.path.dirname(index), store)
    copy = str(store / os.path.basename(index))
    metadata = json.loads(open(merged_metadata_path(copy)).read())
    for machine in metadata["machines"]:
        machine.update(model="google/gemma-2-2b", model_type="gemma2", num_hidden_layers=2)
    open(merged_metadata_path(copy), "w").write(json.dumps(metadata))
    run(TrainingConfig(index=copy, site="blocks.0.ln2.hook_normalized,blocks.1.ln2.hook_normalized",
                       target="blocks.0.hook_mlp_out,blocks.1.hook_mlp_out", output_dir=str(tmp_path / "set"), steps=4,
                       **SMALL), DictionaryConfig(architecture="jumprelu", expansion=2), OptimizerConfig(lr=1e-3))
    config = yaml.safe_load((tmp_path / "set" / "config.yaml").read_text())
    assert config == {"model_kind": "transcoder_set", "feature_input_hook": "ln2.hook_normalized",
                      "feature_output_hook": "hook_mlp_out", "model_name": "google/gemma-2-2b"}
    for layer in (0, 1):
        saelens = load_file(str(tmp_path / "set" / f"blocks.{layer}.ln2.hook_normalized" / "sae_weights.safetensors"))
        tracer = load_file(str(tmp_path / "set" / f"layer_{layer}.safetensors"))
        np.testing.assert_array_equal(tracer["W_enc"], saelens["W_enc"].T)
        np.testing.assert_array_equal(tracer["activation_function.threshold"], saelens["threshold"])
        shown = load_features(str(tmp_path / "set" / f"blocks.{layer}.ln2.hook_normalized"))  # runners.dashboard's
        assert shown.activation == "jumprelu" and shown.output_key == normalized_key(f"blocks.{layer}.hook_mlp_out")
