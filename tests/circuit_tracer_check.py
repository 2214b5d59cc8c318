"""Loads our circuit-tracer directories with circuit-tracer 0.5.0's own code and runs them.

Runs inside the circuit-tracer environment (``tests/circuit_tracer.py``), so it imports nothing
from the project::

    python tests/circuit_tracer_check.py MANIFEST.json OUTPUT.npz

``MANIFEST.json`` holds ``prompt`` (token ids, a special token first), ``attribute``
(``attribute``'s keyword arguments) and ``cases``, each with ``name``, ``directory`` (absolute),
``model_dir`` (a checkpoint with its tokenizer) and ``rows`` (an ``.npz`` whose ``x``
[layers, rows, d_in] is every layer's input site, raw). For each case:

* ``load_transcoders_from_cache(directory)`` (what ``ReplacementModel.from_pretrained`` does with
  an absolute path) loads it in float32 on the CPU; its ``encode`` of ``x`` and its ``decode``
  (with ``x`` for a skip connection) are written to ``OUTPUT.npz`` as ``{name}/acts``
  [layers, rows, d_sae] and ``{name}/out`` [layers, rows, d_out];
* ``ReplacementModel.from_pretrained(model_dir, directory, backend="nnsight")`` runs ``attribute``
  on the prompt; the graph's active features [n, 3] (layer, position, feature) and their
  activations are written as ``{name}/active_features`` and ``{name}/activation_values``.

Prints a JSON report on stdout: per case what circuit-tracer loaded (its class, hooks, activation,
layers, widths, skip) and the graph's size.
"""

from __future__ import annotations

import json
import os
import sys

# Run as a script, its directory comes first on the path, and there tests/circuit_tracer.py (the
# environment's builder) would be imported for the circuit_tracer package.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
# transformers 4.57 imports scikit-learn (the project venv's) for assisted generation alone, which
# costs seconds on every start here: it is made to look absent.
sys.modules["sklearn"] = None  # type: ignore[assignment]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from circuit_tracer.attribution.attribute import attribute  # noqa: E402
from circuit_tracer.replacement_model import ReplacementModel  # noqa: E402
from circuit_tracer.transcoder.activation_functions import JumpReLU  # noqa: E402
from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder  # noqa: E402
from circuit_tracer.utils.caching import load_transcoders_from_cache  # noqa: E402

CPU = torch.device("cpu")


def loaded_report(transcoders, config: dict) -> dict:
    """What circuit-tracer made of the directory."""
    clt = isinstance(transcoders, CrossLayerTranscoder)
    first = transcoders if clt else transcoders[0]
    return {"class": type(transcoders).__name__, "model_kind": config["model_kind"],
            "model_name": config.get("model_name"), "feature_input_hook": transcoders.feature_input_hook,
            "feature_output_hook": transcoders.feature_output_hook, "n_layers": transcoders.n_layers,
            "d_transcoder": transcoders.d_transcoder, "d_model": first.d_model,
            "activation": "jumprelu" if isinstance(first.activation_function, JumpReLU) else "relu",
            "skip": bool(transcoders.skip_connection), "dtype": str(first.b_enc.dtype)}


def encode_decode(transcoders, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Its encoding of ``x`` [layers, rows, d_in] and the decoding of that, both dense."""
    with torch.no_grad():
        acts = transcoders.encode(x)  # [layers, rows, d_sae]
        out = transcoders.decode(acts, x)  # [layers, rows, d_out]
    return acts.numpy(), out.numpy()


def main(manifest_path: str, output_path: str) -> int:
    with open(manifest_path) as f:
        manifest = json.load(f)
    outputs, report = {}, {}
    for case in manifest["cases"]:
        name = case["name"]
        transcoders, config = load_transcoders_from_cache(case["directory"], device=CPU, dtype=torch.float32)
        report[name] = loaded_report(transcoders, config)
        x = torch.from_numpy(np.load(case["rows"])["x"])
        outputs[f"{name}/acts"], outputs[f"{name}/out"] = encode_decode(transcoders, x)
        model = ReplacementModel.from_pretrained(case["model_dir"], case["directory"], backend="nnsight",
                                                 device=CPU, dtype=torch.float32)
        graph = attribute(manifest["prompt"], model, **manifest["attribute"])
        outputs[f"{name}/active_features"] = graph.active_features.numpy()
        outputs[f"{name}/activation_values"] = graph.activation_values.float().numpy()
        report[name]["graph"] = {"nodes": int(graph.adjacency_matrix.shape[0]),
                                 "active_features": int(graph.active_features.shape[0]),
                                 "selected_features": int(graph.selected_features.shape[0]),
                                 "logit_targets": len(graph.logit_targets),
                                 "input_tokens": graph.input_tokens.tolist()}
        del model
    np.savez(output_path, **outputs)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
