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

A marker file, written last, says the environment is complete (a half-made one is rebuilt), and a
file lock keeps two pytest workers from building it at once.
"""

from __future__ import annotations

import fcntl
import shutil
import time
from pathlib import Path

from tests.saedashboard import PROJECT_VENV, _base_python, _run, _site_packages

ENV_DIR = PROJECT_VENV / "envs" / "circuit-tracer-0.5.0"
MARKER = ENV_DIR / "complete"
LOCK = ENV_DIR.parent / "circuit-tracer-0.5.0.lock"

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
# The marker holds the requirements, so changing them rebuilds the environment.
MARKER_TEXT = "\n".join(REQUIREMENTS) + "\n"

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
    python = ENV_DIR / "bin" / "python"
    if _complete():  # the usual case: no lock, no subprocess
        return str(python)
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be building it; wait for it
        if not _complete():
            _build()
    return str(python)


def _complete() -> bool:
    return MARKER.is_file() and MARKER.read_text() == MARKER_TEXT


def _build() -> None:
    """Make the environment from scratch (whatever a failed attempt left is thrown away)."""
    shutil.rmtree(ENV_DIR, ignore_errors=True)
    # Without pip of its own: the project venv's pip installs into it (--python).
    _run([_base_python(), "-m", "venv", "--without-pip", str(ENV_DIR)], "could not create its venv")
    env_python = str(ENV_DIR / "bin" / "python")
    # Compiled on install (pip's default): transformers' thousands of modules would otherwise be
    # compiled on every import where bytecode is not written (PYTHONDONTWRITEBYTECODE).
    _run([str(PROJECT_VENV / "bin" / "python"), "-m", "pip", "--python", env_python, "install", "--quiet",
          "--no-deps", "--disable-pip-version-check", "--no-warn-conflicts", *REQUIREMENTS],
         "pip could not install circuit-tracer 0.5.0 (is the package registry reachable?)")
    # Only now the project venv's packages become visible: pip above must neither count them as
    # installed nor touch them.
    (Path(_site_packages(env_python)) / "project_venv.pth").write_text(
        _site_packages(str(PROJECT_VENV / "bin" / "python")) + "\n")
    _run([env_python, "-c", SMOKE_TEST], "circuit-tracer 0.5.0's modules do not import in its environment")
    MARKER.write_text(MARKER_TEXT)


if __name__ == "__main__":
    began = time.perf_counter()
    print(circuit_tracer_python(), f"({time.perf_counter() - began:.1f} s)")
