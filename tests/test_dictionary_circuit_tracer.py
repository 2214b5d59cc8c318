"""Dictionaries written in circuit-tracer 0.5.0's layouts (``dictionaries.circuit_tracer_format``)
are what circuit-tracer loads and runs: in its own environment (``tests/circuit_tracer.py``) its
loaders read every file, its ``encode`` / ``decode`` equal ours on the same rows in the raw units
(the activation scales folded in), and its nnsight ``ReplacementModel`` of a tiny random Llama and
Qwen3 checkpoint builds an attribution graph whose active features, at every layer and position,
are those our dictionaries find in our own extraction of the sites it reads."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from common.cli import UserError
from dictionaries.circuit_tracer_format import (CONFIG_FILE, circuit_tracer_hooks, clt_inference_weights,
                                                write_clt, write_transcoder_set)
from dictionaries.clt import decode_clt, encode_clt, init_clt
from dictionaries.config import TOP_K, DictionaryConfig
from dictionaries.sae import decode, inference_encode, init_params
from dictionaries.saelens_format import inference_weights

D_SAE, ROWS = 16, 16
PROMPT = [256] + list(b"The cat sat")  # the tokenizer's <|begin_of_text|>, then bytes (fixtures.family_tokenizers)
ATTRIBUTE = {"max_n_logits": 3, "desired_logit_prob": 0.5, "batch_size": 64}
# name: (model family, config, input site, output site, cross-layer); circuit-tracer's hook names follow
# from the family (dictionaries.circuit_tracer_format.HOOKS).
CASES = {
    "standard": ("llama", DictionaryConfig(architecture="standard", d_sae=D_SAE), "mlp.hook_in", "hook_mlp_out",
                 False),
    "batchtopk": ("llama", DictionaryConfig(architecture="batchtopk", d_sae=D_SAE, k=4), "mlp.hook_in",
                  "hook_mlp_out", False),
    "jumprelu_skip": ("llama", DictionaryConfig(architecture="jumprelu", d_sae=D_SAE, skip=True), "hook_resid_mid",
                      "hook_mlp_out", False),
    "qwen3_matryoshka": ("qwen3", DictionaryConfig(architecture="matryoshka_batchtopk", d_sae=D_SAE, k=4,
                                                   matryoshka_widths=(8,)), "mlp.hook_in", "hook_mlp_out", False),
    "clt_standard": ("llama", DictionaryConfig(architecture="standard", d_sae=D_SAE), "hook_resid_mid",
                     "hook_mlp_out", True),
    "clt_jumprelu": ("llama", DictionaryConfig(architecture="jumprelu", d_sae=D_SAE), "mlp.hook_in", "hook_mlp_out",
                     True),
}
FAMILIES = ("llama", "qwen3")


def compiled_init_clt(config, layers, d_in, d_out, key, dtype):
    """``init_clt`` compiled (op by op, JAX dispatches slowly)."""
    return jax.jit(lambda k: init_clt(config, layers, d_in, d_out, k, dtype))(key)


def perturbed(params: dict, seed: int) -> dict[str, np.ndarray]:
    """Weights as after training: none zero (biases, W_skip), decoder rows of several norms,
    thresholds positive, float32."""
    rng = np.random.default_rng(seed)
    out = {name: (np.asarray(v) + rng.normal(0, 0.3, v.shape)).astype(np.float32) for name, v in params.items()}
    for name in out:
        if name.startswith("W_dec"):
            out[name] *= rng.uniform(0.2, 3.0, (out[name].shape[0],) + (1,) * (out[name].ndim - 1)).astype(np.float32)
        if name.startswith("threshold"):
            out[name] = np.abs(out[name])
    return out


def assert_rows_close(theirs: np.ndarray, ours: np.ndarray, rtol: float, what: str) -> None:
    """Each row (the last axis) within ``rtol`` of ours, relative, as a vector."""
    error, norm = np.linalg.norm(theirs - ours, axis=-1), np.linalg.norm(ours, axis=-1)
    assert (error <= rtol * norm).all(), f"{what}: relative error up to {np.max(error / np.maximum(norm, 1e-30)):.2g}"


class Dictionary:
    """A case's weights as trained, its activation scales, and what it computes (ours, in JAX)."""

    def __init__(self, name: str, layers: int, width: int, seed: int):
        self.family, self.config, self.input_site, self.output_site, self.cross_layer = CASES[name]
        rng = np.random.default_rng(seed)
        self.scales_in = rng.uniform(0.5, 3.0, layers).tolist()  # as the store's mean_norm scales
        self.scales_out = rng.uniform(0.5, 3.0, layers).tolist()
        if self.cross_layer:
            key = jax.random.key(seed)
            self.params = perturbed(compiled_init_clt(self.config, layers, width, width, key, jnp.float32), seed)
        else:
            self.params = [perturbed(init_params(self.config, width, width, jax.random.key(seed + l), jnp.float32),
                                     seed + l) for l in range(layers)]
        self.threshold = 0.4  # a BatchTopK kind's running threshold

    def write(self, directory: str, model_name: str) -> None:
        model = dict(input_site=self.input_site, output_site=self.output_site, model_name=model_name,
                     model_type=self.family, num_hidden_layers=len(self.scales_in))
        if self.cross_layer:
            write_clt(directory, self.config, self.params, scales_in=self.scales_in, scales_out=self.scales_out,
                      **model)
        else:
            layers = {l: inference_weights(self.config, p, self.threshold, self.scales_in[l], self.scales_out[l])
                      for l, p in enumerate(self.params)}
            write_transcoder_set(directory, self.config, layers, **model)

    def encode_decode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(activations as circuit-tracer's loaded weights compute them, reconstructions in the raw
        units), [layers, rows, d_sae] and [layers, rows, d_out], of the raw inputs ``x`` [layers, rows, d_in]."""
        scaled = [jnp.asarray(layer * s) for layer, s in zip(x, self.scales_in)]
        if self.cross_layer:
            params = {k: jnp.asarray(v) for k, v in self.params.items()}
            acts = encode_clt(self.config, params, scaled)[0]
            outs = decode_clt(self.config, params, acts)
        else:
            acts, outs = [], []
            for p, xl in zip(self.params, scaled):
                p = {k: jnp.asarray(v) for k, v in p.items()}
                acts.append(inference_encode(self.config, p, jnp.float32(self.threshold), xl, False))
                outs.append(decode(self.config, p, acts[-1], xl))
        # A top-k kind's saved weights fold its decoder norms, and with them the output scale, into
        # its activations (saelens_format.inference_weights).
        folded = [s if self.config.architecture in TOP_K and self.config.rescale_acts_by_decoder_norm else 1.0
                  for s in self.scales_out]
        return (np.stack([np.asarray(a) / f for a, f in zip(acts, folded)]),
                np.stack([np.asarray(o) / s for o, s in zip(outs, self.scales_out)]))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny random Llama and Qwen3 checkpoints in the hub's config layout (transformers 4.57
    reads it), each with a byte-level tokenizer (circuit-tracer's model loads one)."""
    from fixtures.family_tokenizers import build_family_tokenizer
    from fixtures.tiny_models import write_checkpoint
    root = tmp_path_factory.mktemp("circuit_tracer_models")
    out = {}
    for seed, family in enumerate(FAMILIES):
        out[family] = write_checkpoint(root / family, family, seed=seed, layout="hub")
        build_family_tokenizer("llama3", out[family])
    return out


@pytest.fixture(scope="module")
def sites(checkpoints) -> dict[str, dict[str, np.ndarray]]:
    """family -> {hook name: [positions, width]}: our extraction of every site a case reads, at the prompt."""
    from model.extract import Extractor
    out = {}
    for family, path in checkpoints.items():
        extractor = Extractor.load(path, dtype="float32", max_seq_length=32, min_bucket=32, devices=jax.devices()[:1],
                                   sites=["hook_resid_mid", "mlp.hook_in"])
        out[family] = dict(extractor.extract([(0, PROMPT)]))[0]
    return out


@pytest.mark.slow  # circuit-tracer's environment: about 80 s of pip on a fresh clone
def test_circuit_tracer_loads_encodes_and_attributes_as_we_do(checkpoints, sites, tmp_path,
                                                              circuit_tracer_interpreter):
    from model.sites import hook_name
    layers = {family: len({k for k in found if "hook_resid_mid" in k}) for family, found in sites.items()}
    width = {family: next(iter(found.values())).shape[1] for family, found in sites.items()}
    rng = np.random.default_rng(7)
    dictionaries, cases, ours = {}, [], {}
    for seed, name in enumerate(CASES):
        family = CASES[name][0]
        d = dictionaries[name] = Dictionary(name, layers[family], width[family], seed)
        directory = str(tmp_path / name)
        d.write(directory, checkpoints[family])
        x = rng.normal(0, 2.0, (layers[family], ROWS, width[family])).astype(np.float32)  # raw activations
        np.savez(tmp_path / f"{name}_rows.npz", x=x)
        ours[name] = d.encode_decode(x)
        cases.append({"name": name, "directory": directory, "rows": str(tmp_path / f"{name}_rows.npz"),
                      "model_dir": checkpoints[family]})
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"prompt": PROMPT, "attribute": ATTRIBUTE, "cases": cases}))
    result = subprocess.run([circuit_tracer_interpreter, str(pathlib.Path(__file__).parent / "circuit_tracer_check.py"),
                             str(manifest), str(tmp_path / "theirs.npz")], capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    theirs = np.load(tmp_path / "theirs.npz")
    for name, d in dictionaries.items():
        loaded, family = report[name], d.family
        hooks = circuit_tracer_hooks(family, d.input_site, d.output_site)
        assert (loaded["feature_input_hook"], loaded["feature_output_hook"]) == hooks, name
        assert loaded["class"] == ("CrossLayerTranscoder" if d.cross_layer else "TranscoderSet"), name
        assert (loaded["n_layers"], loaded["d_transcoder"], loaded["d_model"]) == (layers[family], D_SAE,
                                                                                 width[family]), name
        assert loaded["activation"] == ("relu" if d.config.architecture == "standard" else "jumprelu"), name
        assert loaded["skip"] == d.config.skip and loaded["model_name"] == checkpoints[family], name
        # encode / decode of the same raw rows
        acts, out = ours[name]
        their_acts, their_out = theirs[f"{name}/acts"], theirs[f"{name}/out"]
        assert ((acts != 0) == (their_acts != 0)).all() and 0 < (acts != 0).mean() < 1, name
        assert_rows_close(their_acts, acts, 1e-5, name)
        assert_rows_close(their_out, out, 1e-5, name)
        # the attribution graph's active features: ours on our extraction of the site it hooks
        x = np.stack([sites[family][hook_name(d.input_site, l)] for l in range(layers[family])])  # [L, S, d_in]
        expected = d.encode_decode(x)[0]
        expected[:, 0] = 0  # circuit-tracer zeroes the first position's (the special token's) features
        found = np.zeros_like(expected)
        layer, position, feature = theirs[f"{name}/active_features"].T
        found[layer, position, feature] = theirs[f"{name}/activation_values"]
        assert ((found != 0) == (expected != 0)).all() and (found != 0).any(), name
        assert_rows_close(found, expected, 1e-4, name)  # two forwards in float32, JAX's and torch's
        graph = loaded["graph"]
        assert graph["input_tokens"] == PROMPT and graph["logit_targets"] >= 1, name
        assert graph["selected_features"] == graph["active_features"] == int((expected != 0).sum()), name


# --- the files themselves, and what is refused (no circuit-tracer needed) ---

def site(model_type: str, input_site: str, layers: int, model_name: str = "m") -> dict:
    """The writers' keyword arguments of a transcoder from ``input_site`` to ``hook_mlp_out``."""
    return dict(input_site=input_site, output_site="hook_mlp_out", model_name=model_name, model_type=model_type,
                num_hidden_layers=layers)


def transcoder_layers(config: DictionaryConfig, count: int = 2, width: int = 6) -> dict[int, dict[str, np.ndarray]]:
    return {l: inference_weights(config, perturbed(init_params(config, width, width, jax.random.key(l), jnp.float32),
                                                   l), 0.4) for l in range(count)}


def test_a_transcoder_set_is_a_layer_file_each_and_a_config(tmp_path):
    config = DictionaryConfig(architecture="jumprelu", d_sae=10, skip=True)
    layers = transcoder_layers(config)
    write_transcoder_set(str(tmp_path), config, layers, **site("qwen3", "mlp.hook_in", 2, "Qwen/Qwen3-0.6B"))
    assert yaml.safe_load((tmp_path / CONFIG_FILE).read_text()) == {
        "model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out",
        "model_name": "Qwen/Qwen3-0.6B"}
    assert sorted(os.listdir(tmp_path)) == [CONFIG_FILE, "layer_0.safetensors", "layer_1.safetensors"]
    saved = load_file(str(tmp_path / "layer_1.safetensors"))
    assert {k: v.shape for k, v in saved.items()} == {"W_enc": (10, 6), "W_dec": (10, 6), "b_enc": (10,),
                                                      "b_dec": (6,), "activation_function.threshold": (10,),
                                                      "W_skip": (6, 6)}
    np.testing.assert_array_equal(saved["W_enc"], layers[1]["W_enc"].T)
    assert all(v.dtype == np.float32 for v in saved.values())


def test_a_clt_is_an_encoder_and_a_decoder_file_a_layer_with_the_scales_folded_in(tmp_path):
    config = DictionaryConfig(architecture="jumprelu", d_sae=10)
    params = perturbed(compiled_init_clt(config, 3, 6, 6, jax.random.key(0), jnp.float32), 0)
    write_clt(str(tmp_path), config, params, scales_in=[2.0, 1.0, 1.0], scales_out=[1.0, 4.0, 0.5],
              **site("llama", "hook_resid_mid", 3))
    assert yaml.safe_load((tmp_path / CONFIG_FILE).read_text())["model_kind"] == "cross_layer_transcoder"
    encoder, decoder = (load_file(str(tmp_path / f"W_{part}_1.safetensors")) for part in ("enc", "dec"))
    assert {k: v.shape for k, v in encoder.items()} == {"W_enc_1": (10, 6), "b_enc_1": (10,), "b_dec_1": (6,),
                                                        "threshold_1": (10,)}
    assert {k: v.shape for k, v in decoder.items()} == {"W_dec_1": (10, 2, 6)}  # layers 1 and 2
    np.testing.assert_allclose(decoder["W_dec_1"][:, 1], params["W_dec_1"][:, 1] / 0.5, rtol=1e-6)
    np.testing.assert_allclose(encoder["b_dec_1"], params["b_dec_1"] / 4.0, rtol=1e-6)
    np.testing.assert_array_equal(encoder["threshold_1"], params["threshold_1"])
    folded = clt_inference_weights(config, params, [2.0, 1.0, 1.0], [1.0, 4.0, 0.5])
    np.testing.assert_allclose(load_file(str(tmp_path / "W_enc_0.safetensors"))["W_enc_0"], folded["W_enc_0"].T)
    np.testing.assert_allclose(folded["W_enc_0"], params["W_enc_0"] * 2.0, rtol=1e-6)


def test_a_rewrite_leaves_no_file_of_the_earlier_one_that_circuit_tracer_would_read(tmp_path):
    config = DictionaryConfig(architecture="standard", d_sae=10)
    write_transcoder_set(str(tmp_path), config, transcoder_layers(config, 3), **site("llama", "mlp.hook_in", 3))
    (tmp_path / "notes.safetensors").write_bytes(b"")  # not circuit-tracer's: kept
    write_clt(str(tmp_path), config, perturbed(compiled_init_clt(config, 2, 6, 6, jax.random.key(0), jnp.float32), 0),
              **site("llama", "hook_resid_mid", 2))
    assert sorted(os.listdir(tmp_path)) == sorted([CONFIG_FILE, "notes.safetensors", "W_enc_0.safetensors",
                                                   "W_enc_1.safetensors", "W_dec_0.safetensors",
                                                   "W_dec_1.safetensors"])


TOPK = DictionaryConfig(architecture="topk", d_sae=10)
STANDARD = DictionaryConfig(architecture="standard", d_sae=10)


@pytest.mark.parametrize("call, message", [
    (lambda d: write_transcoder_set(d, TOPK, transcoder_layers(TOPK), **site("llama", "mlp.hook_in", 2)),
     "circuit-tracer 0.5.0 has no TopK transcoder: train it as batchtopk"),
    (lambda d: write_clt(d, TOPK, compiled_init_clt(TOPK, 2, 6, 6, jax.random.key(0), jnp.float32),
                         **site("llama", "hook_resid_mid", 2)),
     "circuit-tracer 0.5.0 has no TopK cross-layer transcoder: train it as standard or jumprelu"),
    (lambda d: circuit_tracer_hooks("qwen3", "hook_resid_mid", "hook_mlp_out"),
     "circuit-tracer 0.5.0 reads no transcoder input at hook_resid_mid in qwen3 models: it reads mlp.hook_in"),
    (lambda d: circuit_tracer_hooks("qwen2", "mlp.hook_in", "hook_mlp_out"),
     "circuit-tracer 0.5.0 has no hooks in 'qwen2' models: its replacement models are of llama, qwen3, gemma2"),
    (lambda d: circuit_tracer_hooks("llama", "mlp.hook_in", "hook_resid_post"),
     r"replaces the MLP's output \(hook_mlp_out\), not hook_resid_post"),
    (lambda d: write_transcoder_set(d, STANDARD, transcoder_layers(STANDARD, 2), **site("llama", "mlp.hook_in", 3)),
     r"replaces the MLP of each of the model's 3 layers: no transcoder of layers \[2\]"),
    (lambda d: write_clt(d, STANDARD, compiled_init_clt(STANDARD, 3, 6, 6, jax.random.key(0), jnp.float32),
                         **site("llama", "mlp.hook_in", 2)),
     r"replaces the MLP of each of the model's 2 layers: the model has no layers \[2\]"),
], ids=["topk_transcoder", "topk_clt", "qwen3_resid_mid", "unknown_family", "not_the_mlp_output", "missing_layer",
        "clt_past_the_model"])
def test_what_circuit_tracer_cannot_load_is_refused_in_one_line_before_anything_is_written(call, message, tmp_path):
    with pytest.raises(UserError, match=message) as error:
        call(str(tmp_path / "out"))
    assert "\n" not in str(error.value) and not (tmp_path / "out").exists()
