"""An environment holding circuit-tracer 0.5.0, for tests that load our files with its own code.

circuit-tracer pins transformers (>= 4.56, <= 4.57.3) and huggingface-hub (< 1), which the project
venv's transformers 5 and huggingface-hub 2 break, so it lives in a venv of its own, made on first
use and kept under ``.venv/envs/circuit-tracer-0.5.0/``; ``circuit_tracer_python()`` returns that
venv's interpreter, which runs ``tests/circuit_tracer_check.py``.

What the environment holds, and why:

* ``circuit-tracer==0.5.0`` itself, installed without its dependencies, and the versions of its
  pins that the project venv's break: ``transformers==4.57.3`` (its newest allowed),
  ``huggingface-hub==0.36.2`` (the newest 0.x) and ``tokenizers==0.22.1`` (transformers 4.57.3
  takes tokenizers <= 0.23.0; the project venv's is 0.23.3).
* ``nnsight==0.6.3``: circuit-tracer needs >= 0.6 and imports ``Barrier`` from
  ``nnsight.intervention.tracing.tracer``, which nnsight 0.8 moved (0.7.0 keeps it too), with
  the packages nnsight imports at its own import that the project venv lacks: IPython (with
  its pure-Python dependencies below), python-socketio and python-engineio (its remote backend,
  never used here), astor.
* Everything else, torch above all (it must stay the CPU build, and is too heavy to download per
  test), comes from the project venv: its site-packages is put on the path *after* the
  environment's own (a ``.pth`` file), so the packages above win. Of circuit-tracer's pins that
  leaves ``transformer-lens >= 2.16`` met by the project venv's 3.9 in name only: circuit-tracer
  imports TransformerLens for its ``transformerlens`` backend alone, and the check uses the
  ``nnsight`` backend (the one that loads a local checkpoint). accelerate (transformers'
  ``device_map``), safetensors 0.8, einops, pydantic, PyYAML, numpy 2 come from the project venv
  as they are.

How it is made, completed and locked: ``tests/environments.py``.
"""

from __future__ import annotations

import time

from tests.environments import environment_python

# What the environment installs itself, all without dependencies, so that pip never reaches for
# torch (the project venv provides it and the rest).
REQUIREMENTS = (
    "circuit-tracer==0.5.0",
    "transformers==4.57.3",
    "huggingface-hub==0.36.2",
    "tokenizers==0.22.1",
    "nnsight==0.6.3",
    "astor==0.8.1",
    "python-socketio==5.18.1",
    "python-engineio==4.15.1",
    "bidict==0.24.1",
    "simple-websocket==1.1.0",
    # IPython and what it imports (nnsight asks it whether it runs in a notebook).
    "ipython==9.18.1",
    "ipython-pygments-lexers==1.1.1",
    "prompt-toolkit==3.0.53",
    "wcwidth==0.9.4",
    "jedi==0.20.1",
    "parso==0.8.7",
    "matplotlib-inline==0.2.2",
    "traitlets==5.16.1",
    "pexpect==4.9.0",
    "ptyprocess==0.7.0",
    "stack-data==0.6.3",
    "asttokens==3.0.2",
    "executing==2.3.0",
    "pure-eval==0.2.4",
)

# Modules the check imports: if one of them cannot be imported here, the environment is unusable.
SMOKE_TEST = """
import sys
sys.modules["sklearn"] = None  # as the check does (tests/circuit_tracer_check.py)
import torch, transformers, huggingface_hub, nnsight
from circuit_tracer.replacement_model.replacement_model_nnsight import NNSightReplacementModel
from circuit_tracer.attribution.attribute import attribute
from circuit_tracer.utils.caching import load_transcoders_from_cache
assert transformers.__version__ == "4.57.3", transformers.__version__
assert huggingface_hub.__version__ == "0.36.2", huggingface_hub.__version__
assert torch.__version__.endswith("+cpu"), torch.__version__
"""


def circuit_tracer_python() -> str:
    """The interpreter of the circuit-tracer 0.5.0 environment, which is made on first use."""
    return environment_python("circuit-tracer-0.5.0", REQUIREMENTS, SMOKE_TEST)


if __name__ == "__main__":
    began = time.perf_counter()
    print(circuit_tracer_python(), f"({time.perf_counter() - began:.1f} s)")
