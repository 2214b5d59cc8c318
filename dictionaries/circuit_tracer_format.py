"""Trained transcoders in circuit-tracer 0.5.0's layouts: a directory that its
``load_transcoders_from_cache`` reads, and so ``ReplacementModel.from_pretrained(model, DIR)``
where ``DIR`` is the directory's absolute path (circuit-tracer joins it to its cache root, which
an absolute path replaces). The same files uploaded to a Hugging Face repository load by its name.

Every directory holds ``config.yaml``, written last (circuit-tracer counts a directory with it as
complete): ``model_kind``, ``feature_input_hook`` and ``feature_output_hook`` (its hook names,
from our sites through ``HOOKS``) and ``model_name`` (its command line's default ``--model``).

- A transcoder set (``model_kind: transcoder_set``, one transcoder a layer): ``layer_{i}.safetensors``
  for every layer i of the model (circuit-tracer replaces every MLP), each holding exactly what its
  ``load_relu_transcoder`` loads into a ``SingleLayerTranscoder``: ``W_enc [d_sae, d_in]`` (our
  ``W_enc`` transposed), ``W_dec [d_sae, d_out]``, ``b_enc [d_sae]``, ``b_dec [d_out]``, and
  ``activation_function.threshold [d_sae]`` (a JumpReLU; without it a ReLU) and ``W_skip
  [d_out, d_in]`` (``x @ W_skip.T``, as ours) where there are. The weights are SAELens's inference
  weights (``saelens_format.inference_weights``: activation scales and decoder norms folded in,
  a BatchTopK kind's running threshold a JumpReLU's).
- A cross-layer transcoder (``model_kind: cross_layer_transcoder``): for each layer i,
  ``W_enc_{i}.safetensors`` with ``W_enc_{i} [d_sae, d_in]`` (transposed), ``b_enc_{i} [d_sae]``,
  ``b_dec_{i} [d_out]`` (layer i's output bias) and ``threshold_{i} [d_sae]`` (jumprelu), and
  ``W_dec_{i}.safetensors`` with ``W_dec_{i} [d_sae, N - i, d_out]`` (our layout: slice j writes
  layer i + j). Its ``load_clt`` counts the layers by the ``W_enc_*`` files and takes a JumpReLU
  where ``threshold_0`` exists, else a ReLU.

Arrays are stored in the weights' dtype (float32 or float64 as trained); circuit-tracer casts them
to the dtype it is asked for (``load_clt``'s own default is bfloat16, ``ReplacementModel``'s
float32). It has no TopK activation (``activation_functions.TopK`` is used by no loader): a TopK
transcoder or CLT is refused; a BatchTopK kind is saved as the JumpReLU it infers as.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any, Mapping, Sequence

import numpy as np

from common.cli import UserError
from dictionaries.clt import layer_count
from dictionaries.config import BATCH_TOP_K, DictionaryConfig

CIRCUIT_TRACER_VERSION = "0.5.0"
CONFIG_FILE = "config.yaml"
# Beside a CLT, our own record of the sites each layer reads and writes (TransformerLens hook
# names), which circuit-tracer's files do not hold: what runners.dashboard reads a layer's latents by.
CLT_SITES_FILE = "clt_sites.json"
THRESHOLD = "activation_function.threshold"  # a SingleLayerTranscoder's JumpReLU threshold

# model_type (config.json's) -> ({our input site: circuit-tracer's hook}, {our output site: its hook}):
# the hooks its nnsight backend places for the architecture (utils/tl_nnsight_mapping.py) that read
# or write what our site holds (docs/sites.md). Qwen3 has no ``hook_mlp_out`` there, only the MLP
# module's output ``mlp.hook_out``; Llama's and gpt-oss's have no ``ln2.hook_normalized``, Gemma 2's
# no ``mlp.hook_in``. (Its TransformerLens backend knows these names too.)
_LLAMA = ({"hook_resid_mid": "hook_resid_mid", "mlp.hook_in": "mlp.hook_in"}, {"hook_mlp_out": "hook_mlp_out"})
_GEMMA2 = ({"hook_resid_mid": "hook_resid_mid", "ln2.hook_normalized": "ln2.hook_normalized"},
           {"hook_mlp_out": "hook_mlp_out"})
_GEMMA3 = ({**_GEMMA2[0], "mlp.hook_in": "mlp.hook_in"}, _GEMMA2[1])
HOOKS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "llama": _LLAMA,
    "qwen3": ({"mlp.hook_in": "mlp.hook_in"}, {"hook_mlp_out": "mlp.hook_out"}),
    "gemma2": _GEMMA2,
    "gemma3": _GEMMA3,       # Gemma3ForConditionalGeneration (4B-27B)
    "gemma3_text": _GEMMA3,  # Gemma3ForCausalLM (270M, 1B)
    "gpt_oss": _LLAMA,
}


def circuit_tracer_hooks(model_type: str, input_site: str, output_site: str) -> tuple[str, str]:
    """(``feature_input_hook``, ``feature_output_hook``) of a transcoder from ``input_site`` to
    ``output_site`` (our site names, e.g. ``mlp.hook_in``, ``hook_mlp_out``) in a ``model_type``
    model; ``UserError`` where circuit-tracer has no hook there."""
    if model_type not in HOOKS:
        raise UserError(f"circuit-tracer {CIRCUIT_TRACER_VERSION} has no hooks in {model_type!r} models: its "
                        f"replacement models are of {', '.join(HOOKS)}")
    inputs, outputs = HOOKS[model_type]
    if input_site not in inputs:
        raise UserError(f"circuit-tracer {CIRCUIT_TRACER_VERSION} reads no transcoder input at {input_site} in "
                        f"{model_type} models: it reads {', '.join(inputs)}")
    if output_site not in outputs:
        raise UserError(f"circuit-tracer {CIRCUIT_TRACER_VERSION} replaces the MLP's output ({', '.join(outputs)}), "
                        f"not {output_site}")
    return inputs[input_site], outputs[output_site]


def activation(config: DictionaryConfig, cross_layer: bool) -> str:
    """What circuit-tracer loads the dictionary's activation as (``relu`` or ``jumprelu``); a TopK
    one, which it cannot represent, refused."""
    if config.architecture == "topk":
        what = "cross-layer transcoder" if cross_layer else "transcoder"
        advice = "standard or jumprelu" if cross_layer else "batchtopk (saved as a JumpReLU), jumprelu or standard"
        raise UserError(f"circuit-tracer {CIRCUIT_TRACER_VERSION} has no TopK {what}: train it as {advice}")
    return "jumprelu" if config.architecture == "jumprelu" or config.architecture in BATCH_TOP_K else "relu"


def check_layers(layers: Sequence[int], num_hidden_layers: int) -> None:
    """Refused unless ``layers`` are every layer of the model: circuit-tracer replaces every MLP,
    and runs a model with layers past the transcoders' without a word, those MLPs left as they are."""
    missing = sorted(set(range(num_hidden_layers)) - set(layers))
    extra = sorted(set(layers) - set(range(num_hidden_layers)))
    if missing or extra:
        raise UserError(f"circuit-tracer replaces the MLP of each of the model's {num_hidden_layers} layers: "
                        + (f"no transcoder of layers {missing}" if missing else f"the model has no layers {extra}"))


def write_transcoder_set(directory: str, config: DictionaryConfig, layers: Mapping[int, Mapping[str, np.ndarray]], *,
                         input_site: str, output_site: str, model_name: str, model_type: str,
                         num_hidden_layers: int) -> None:
    """Writes a transcoder set into ``directory`` (made if missing): ``layers[i]`` is layer i's
    weights as ``saelens_format.inference_weights`` returns them, for every layer of the model
    (``model_type``'s, of ``num_hidden_layers``); ``input_site`` and ``output_site`` are our
    site names (``mlp.hook_in``, ``hook_mlp_out``)."""
    hooks = circuit_tracer_hooks(model_type, input_site, output_site)
    jump = activation(config, cross_layer=False) == "jumprelu"
    check_layers(list(layers), num_hidden_layers)
    files = {}
    for layer, w in layers.items():
        tensors = {"W_enc": w["W_enc"].T, "W_dec": w["W_dec"], "b_enc": w["b_enc"], "b_dec": w["b_dec"]}
        if jump:
            tensors[THRESHOLD] = w["threshold"]
        if "W_skip" in w:
            tensors["W_skip"] = w["W_skip"]
        files[f"layer_{layer}.safetensors"] = tensors
    _write(directory, files, {"model_kind": "transcoder_set", "feature_input_hook": hooks[0],
                              "feature_output_hook": hooks[1], "model_name": model_name})


def clt_inference_weights(config: DictionaryConfig, params: Mapping[str, Any], scales_in: Sequence[float],
                          scales_out: Sequence[float]) -> dict[str, np.ndarray]:
    """A CLT's weights (``dictionaries.clt``'s names and layout) with the activation scales folded
    in: training read layer l's input as ``x_l * scales_in[l]`` and reconstructed ``y_j *
    scales_out[j]``, so ``W_enc_l * s_in_l``, and each decoder slice writing layer j and ``b_dec_j``
    divided by ``s_out_j``; the pre-activations, and so the thresholds, do not change."""
    activation(config, cross_layer=True)  # TopK, which would rank by decoder norms too: refused
    n = layer_count(params)
    if len(scales_in) != n or len(scales_out) != n:
        raise ValueError(f"{n} layers, {len(scales_in)} input and {len(scales_out)} output scales")
    out = {name: np.asarray(value) for name, value in params.items()}
    s_out = np.asarray(scales_out, out["W_dec_0"].dtype)
    for l in range(n):
        out[f"W_enc_{l}"] = out[f"W_enc_{l}"] * scales_in[l]
        out[f"W_dec_{l}"] = out[f"W_dec_{l}"] / s_out[l:, None]  # [d_sae, n - l, d_out]: slice j writes l + j
        out[f"b_dec_{l}"] = out[f"b_dec_{l}"] / scales_out[l]
    return out


def write_clt(directory: str, config: DictionaryConfig, params: Mapping[str, Any], *, input_site: str,
              output_site: str, model_name: str, model_type: str | None, num_hidden_layers: int,
              scales_in: Sequence[float] | None = None, scales_out: Sequence[float] | None = None) -> None:
    """Writes a cross-layer transcoder (``dictionaries.clt``'s params as trained, one set for each
    layer of the model) into ``directory`` (made if missing), the activation scales (one a layer;
    none: 1) folded in by ``clt_inference_weights``; the rest as ``write_transcoder_set``'s.
    ``model_type`` None: the weight files alone (``load_clt`` reads them), no ``config.yaml``
    (which ``ReplacementModel`` needs), for a CLT circuit-tracer cannot place in its model."""
    jump = activation(config, cross_layer=True) == "jumprelu"
    n = layer_count(params)
    hooks = None
    if model_type is not None:
        hooks = circuit_tracer_hooks(model_type, input_site, output_site)
        check_layers(range(n), num_hidden_layers)
    w = clt_inference_weights(config, params, [1.0] * n if scales_in is None else scales_in,
                              [1.0] * n if scales_out is None else scales_out)
    files = {}
    for l in range(n):
        encoder = {f"W_enc_{l}": w[f"W_enc_{l}"].T, f"b_enc_{l}": w[f"b_enc_{l}"], f"b_dec_{l}": w[f"b_dec_{l}"]}
        if jump:
            encoder[f"threshold_{l}"] = w[f"threshold_{l}"]
        files[f"W_enc_{l}.safetensors"] = encoder
        files[f"W_dec_{l}.safetensors"] = {f"W_dec_{l}": w[f"W_dec_{l}"]}
    _write(directory, files, hooks and {"model_kind": "cross_layer_transcoder", "feature_input_hook": hooks[0],
                                        "feature_output_hook": hooks[1], "model_name": model_name})


def write_clt_sites(directory: str, input_hooks: Sequence[str], output_hooks: Sequence[str]) -> None:
    """``clt_sites.json``: the hook name each layer of a CLT reads and writes, layer by layer."""
    with open(os.path.join(directory, CLT_SITES_FILE), "w") as f:
        json.dump({"input_hooks": list(input_hooks), "output_hooks": list(output_hooks)}, f, indent=2)


# The files circuit-tracer finds by pattern: one of an earlier write that this one lacks would be loaded too.
_LOADED = re.compile(r"(layer|W_enc|W_dec)_\d+\.safetensors")


def _write(directory: str, files: dict[str, dict[str, np.ndarray]], config: dict[str, str] | None) -> None:
    """The weight files, with any other file circuit-tracer would read removed, then ``config.yaml``
    (removed first: a directory whose writing stopped half-way is not one circuit-tracer loads;
    none written where ``config`` is None)."""
    import yaml
    from safetensors.numpy import save_file
    os.makedirs(directory, exist_ok=True)
    config_path = os.path.join(directory, CONFIG_FILE)
    if os.path.exists(config_path):
        os.remove(config_path)
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        name = os.path.basename(path)
        if _LOADED.fullmatch(name) and name not in files:
            os.remove(path)
    for name, tensors in files.items():
        save_file({key: np.ascontiguousarray(value) for key, value in tensors.items()}, os.path.join(directory, name))
    if config is not None:
        with open(config_path, "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)
