"""An environment holding SAEDashboard 0.8.0, for tests that check our files against its own code.

SAEDashboard's pins (safetensors < 0.5, transformers < 4.57, transformer-lens < 3, and the numpy
1.26 its pinned stack runs on) conflict with the project venv, so it lives in a venv of its own,
made on first use and kept under ``.venv/envs/saedashboard-0.8.0/``; ``saedashboard_python()``
returns that venv's interpreter, which runs ``tests/saedashboard_check.py``.

What the environment holds, and why:

* ``sae-dashboard==0.8.0`` itself, installed without its dependencies, and the small pure-Python
  packages its modules import that the project venv lacks: dataclasses-json (< 0.7, with
  marshmallow < 4, typing-inspect, mypy-extensions) and eindex-callum (< 0.2).
* Its one pin that can be honoured in the environment itself: ``numpy==1.26.4``. The project
  venv's pandas 3.1 (which sae-lens pulls in through datasets) refuses numpy < 2.0.2 at import, so
  the environment also holds ``pandas==2.2.3``, a pandas 2 built for numpy 1.26 and 2. The
  project venv's torch 2.13 (CPU), transformer-lens 3.9, sae-lens 6.54, transformers 5.24,
  matplotlib and wandb all import and run on numpy 1.26 for the parts of SAEDashboard the check
  uses (its converter, sequence generator, histograms, logits table and runner's vocabulary).
* ``safetensors < 0.5`` cannot be honoured: transformers 5.24 checks its dependencies at import and
  raises ``ImportError: safetensors>=0.8.0 is required`` (SAEDashboard's runner module imports
  transformers, and so does sae-lens), so the project venv's safetensors 0.8 is used.
* Everything else (torch, transformer-lens, sae-lens, transformers, matplotlib, wandb, ...) is too
  heavy to download per test, and torch must stay the CPU build: the project venv's site-packages
  is put on the path *after* the environment's own (a ``.pth`` file), so the environment's numpy
  and pandas win. Its other pins (safetensors < 0.5, transformers < 4.57, transformer-lens < 3,
  datasets < 4, rich < 14, jaxtyping < 0.3, typer < 0.13) are therefore not honoured.

How it is made, completed and locked: ``tests/environments.py``.
"""

from __future__ import annotations

from tests.environments import environment_python

# What the environment installs itself; all without dependencies, so that pip never reaches for
# torch or transformers (the project venv provides those).
REQUIREMENTS = (
    "sae-dashboard==0.8.0",
    "numpy==1.26.4",
    "pandas==2.2.3",  # the project venv's pandas 3.1 needs numpy >= 2.0.2
    "dataclasses-json==0.6.7",
    "marshmallow==3.26.2",
    "typing-inspect==0.9.0",
    "mypy-extensions==1.1.0",
    "eindex-callum==0.1.2",
)
# Modules the check imports: if one of them cannot be imported here, the environment is unusable.
SMOKE_TEST = """
import numpy, pandas, torch
import sae_dashboard.neuronpedia.neuronpedia_converter
import sae_dashboard.neuronpedia.neuronpedia_runner
import sae_dashboard.sequence_data_generator, sae_dashboard.data_parsing_fns
assert numpy.__version__ == "1.26.4", numpy.__version__
"""


def saedashboard_python() -> str:
    """The interpreter of the SAEDashboard 0.8.0 environment, which is made on first use."""
    return environment_python("saedashboard-0.8.0", REQUIREMENTS, SMOKE_TEST)


if __name__ == "__main__":
    print(saedashboard_python())
