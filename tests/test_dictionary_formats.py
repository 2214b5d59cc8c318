"""Dictionaries written in SAELens's layout are what SAELens loads: ``SAE.load_from_disk`` picks the
class, reads ``metadata.hook_name``, and its ``encode`` / ``decode`` equal ours on the same rows
(with the store's activation scales folded in, its reconstructions equal ours in the raw units)."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common.cli import UserError
from dictionaries.config import DictionaryConfig
from dictionaries.sae import decode, inference_encode, init_params
from dictionaries.saelens_format import saved_architecture, write_saelens

torch = pytest.importorskip("torch")
sae_lens = pytest.importorskip("sae_lens")

D_IN, D_OUT, D_SAE = 8, 6, 24
CASES = {  # name: (config, transcoder) and the class SAELens loads it as
    "standard": (DictionaryConfig(architecture="standard", d_sae=D_SAE), False, "StandardSAE"),
    "topk": (DictionaryConfig(architecture="topk", d_sae=D_SAE, k=4), False, "TopKSAE"),
    "batchtopk": (DictionaryConfig(architecture="batchtopk", d_sae=D_SAE, k=4), False, "JumpReLUSAE"),
    "jumprelu": (DictionaryConfig(architecture="jumprelu", d_sae=D_SAE), False, "JumpReLUSAE"),
    "matryoshka": (DictionaryConfig(architecture="matryoshka_batchtopk", d_sae=D_SAE, k=4, matryoshka_widths=(8,)),
                   False, "JumpReLUSAE"),
    "transcoder": (DictionaryConfig(architecture="standard", d_sae=D_SAE), True, "Transcoder"),
    "skip_transcoder": (DictionaryConfig(architecture="standard", d_sae=D_SAE, skip=True), True, "SkipTranscoder"),
    "batchtopk_transcoder": (DictionaryConfig(architecture="batchtopk", d_sae=D_SAE, k=4), True,
                             "JumpReLUTranscoder"),
    "jumprelu_skip_transcoder": (DictionaryConfig(architecture="jumprelu", d_sae=D_SAE, skip=True), True,
                                 "JumpReLUSkipTranscoder"),
}


def trained_like(config: DictionaryConfig, transcoder: bool) -> tuple[dict, float]:
    """Weights as after training (no bias zero, decoder rows of several norms), and a running threshold."""
    rng = np.random.default_rng(3)
    params = {k: np.asarray(v) for k, v in init_params(config, D_IN, D_OUT if transcoder else D_IN,
                                                         jax.random.key(0), jnp.float32).items()}
    for name, value in params.items():
        params[name] = (value + rng.normal(0, 0.3, value.shape)).astype(np.float32)
    params["W_dec"] *= rng.uniform(0.2, 3.0, (D_SAE, 1)).astype(np.float32)
    if "threshold" in params:
        params["threshold"] = np.abs(params["threshold"]).astype(np.float32)
    return params, 0.4


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("scales", [(1.0, 1.0), (2.5, 0.7)], ids=["raw", "normalized"])
def test_saelens_loads_what_is_written_and_encodes_as_we_do(name, scales, tmp_path):
    config, transcoder, class_name = CASES[name]
    params, threshold = trained_like(config, transcoder)
    hook = "blocks.1.ln2.hook_normalized" if transcoder else "blocks.1.hook_resid_post"
    metadata = {"hook_name": hook, **({"hook_name_out": "blocks.1.hook_mlp_out"} if transcoder else {})}
    scale_in, scale_out = scales if transcoder else (scales[0], scales[0])  # an SAE's input is its target
    write_saelens(str(tmp_path), config, params, threshold, transcoder, metadata, scale_in, scale_out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = sae_lens.SAE.load_from_disk(str(tmp_path))
    assert type(loaded).__name__ == class_name and loaded.cfg.metadata.hook_name == hook
    rows = np.random.default_rng(1).normal(0, 2.0, (32, D_IN)).astype(np.float32)  # raw activations
    x = jnp.asarray(rows * scale_in)
    acts = np.asarray(inference_encode(config, {k: jnp.asarray(v) for k, v in params.items()},
                                       jnp.float32(threshold), x, not transcoder))
    ours = np.asarray(decode(config, {k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(acts), x)) / scale_out
    with torch.no_grad():
        theirs_acts = loaded.encode(torch.from_numpy(rows)).numpy()
        theirs = loaded.decode(torch.from_numpy(theirs_acts)).numpy()
        if "Skip" in class_name:
            theirs = loaded.forward(torch.from_numpy(rows)).numpy()
    assert ((acts != 0) == (theirs_acts != 0)).all() and (acts != 0).any()
    if scale_out == 1.0:
        np.testing.assert_allclose(theirs_acts, acts, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5)


def test_a_topk_transcoder_is_refused_in_one_line():
    with pytest.raises(UserError, match="SAELens has no TopK transcoder"):
        saved_architecture(DictionaryConfig(architecture="topk"), transcoder=True)


def test_the_config_names_the_training(tmp_path):
    config = CASES["matryoshka"][0]
    params, threshold = trained_like(config, False)
    write_saelens(str(tmp_path), config, params, threshold, False, {"hook_name": "blocks.0.hook_resid_post"})
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert cfg["architecture"] == "jumprelu" and cfg["metadata"]["training_architecture"] == "matryoshka_batchtopk"
