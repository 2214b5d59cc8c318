"""A trained dictionary in SAELens's ``save_inference_model`` layout: ``cfg.json`` and
``sae_weights.safetensors``, read by ``sae_lens.SAE.load_from_disk`` (and by ``runners.dashboard``).

What is written is what SAELens 6.54 writes at the end of its training: the activation scale the
training read in (the store's ``mean_norm``: ``sqrt(width) / mean norm``) folded into the weights
first (``W_enc * s_in``, ``W_dec / s_out``, ``b_dec / s_out``, BatchTopK's threshold ``/ s_out``),
then, for the top-k kinds that rescale by the decoder's norms, those norms (``W_enc * n``,
``b_enc * n``, ``W_dec / n``); BatchTopK and Matryoshka BatchTopK saved as JumpReLU with their
running threshold. Transcoders are SAELens's ``transcoder``, ``skip_transcoder``,
``jumprelu_transcoder`` or ``jumprelu_skip_transcoder``; a TopK transcoder has no SAELens class.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from common.cli import UserError
from dictionaries.config import BATCH_TOP_K, TOP_K, DictionaryConfig

SAELENS_VERSION = "6.54.12"  # the metadata SAELens needs (>= 6) to read hook_name
CONFIG_FILE, WEIGHTS_FILE = "cfg.json", "sae_weights.safetensors"


def saved_architecture(config: DictionaryConfig, transcoder: bool) -> str:
    """SAELens's inference architecture for a trained dictionary; a TopK transcoder refused."""
    kind = config.architecture
    jump = kind == "jumprelu" or kind in BATCH_TOP_K
    if not transcoder:
        return "jumprelu" if jump else kind
    if kind == "topk":
        raise UserError("SAELens has no TopK transcoder to load one: train a transcoder as batchtopk (saved as "
                        "SAELens's jumprelu_transcoder), jumprelu or standard")
    return ("jumprelu_" if jump else "") + ("skip_transcoder" if config.skip else "transcoder")


def inference_weights(config: DictionaryConfig, params: dict[str, Any], topk_threshold: float,
                      scale_in: float = 1.0, scale_out: float = 1.0) -> dict[str, np.ndarray]:
    """The weights SAELens's ``save_inference_model`` writes (float32 or float64 as trained), the
    activation scales folded first, then the decoder norms where the top-k kinds rescale by them."""
    p = {name: np.asarray(value) for name, value in params.items()}
    p["W_enc"], p["W_dec"], p["b_dec"] = p["W_enc"] * scale_in, p["W_dec"] / scale_out, p["b_dec"] / scale_out
    if "W_skip" in p:
        p["W_skip"] = p["W_skip"] * scale_in / scale_out
    if config.architecture in TOP_K and config.rescale_acts_by_decoder_norm:
        topk_threshold = topk_threshold / scale_out
        norms = np.maximum(np.linalg.norm(p["W_dec"], axis=-1), 1e-8)  # [d_sae]
        p["W_enc"], p["b_enc"], p["W_dec"] = p["W_enc"] * norms, p["b_enc"] * norms, p["W_dec"] / norms[:, None]
    if config.architecture in BATCH_TOP_K:
        p["threshold"] = np.full_like(p["b_enc"], topk_threshold)
    return p


def saelens_config(config: DictionaryConfig, weights: dict[str, np.ndarray], transcoder: bool,
                   metadata: dict[str, Any]) -> dict[str, Any]:
    """``cfg.json``: SAELens's inference config of the architecture, ``metadata`` (``hook_name``
    and, for a transcoder, ``hook_name_out``) with the version SAELens needs to read it."""
    d_in, d_sae = weights["W_enc"].shape
    cfg: dict[str, Any] = {"architecture": saved_architecture(config, transcoder), "d_in": d_in, "d_sae": d_sae,
                           "dtype": str(weights["W_enc"].dtype), "device": "cpu",
                           "apply_b_dec_to_input": not transcoder, "normalize_activations": "none",
                           "reshape_activations": "none"}
    if transcoder:
        cfg["d_out"] = weights["W_dec"].shape[1]
    if cfg["architecture"] == "topk":
        cfg.update(k=int(config.k), rescale_acts_by_decoder_norm=config.rescale_acts_by_decoder_norm)
    cfg["metadata"] = {"sae_lens_version": SAELENS_VERSION, "sae_lens_training_version": SAELENS_VERSION,
                       "training_architecture": config.architecture, **metadata}
    return cfg


def write_saelens(directory: str, config: DictionaryConfig, params: dict[str, Any], topk_threshold: float,
                  transcoder: bool, metadata: dict[str, Any], scale_in: float = 1.0, scale_out: float = 1.0) -> None:
    """Writes ``cfg.json`` and ``sae_weights.safetensors`` into ``directory`` (made if missing)."""
    from safetensors.numpy import save_file
    weights = inference_weights(config, params, topk_threshold, scale_in, scale_out)
    cfg = saelens_config(config, weights, transcoder, metadata)
    os.makedirs(directory, exist_ok=True)
    save_file({name: np.ascontiguousarray(value) for name, value in weights.items()},
              os.path.join(directory, WEIGHTS_FILE))
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(cfg, f, indent=2)
