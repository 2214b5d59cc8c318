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

A marker file, written last, says the environment is complete (a half-made one is rebuilt), and a
file lock keeps two pytest workers from building it at once.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT_VENV = REPO / ".venv"
ENV_DIR = PROJECT_VENV / "envs" / "saedashboard-0.8.0"
MARKER = ENV_DIR / "complete"
LOCK = ENV_DIR.parent / "saedashboard-0.8.0.lock"

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
# The marker holds the requirements, so changing them rebuilds the environment.
MARKER_TEXT = "\n".join(REQUIREMENTS) + "\n"

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
    # Without pip of its own: the project venv's pip installs into it (--python), which saves the
    # seconds ensurepip takes.
    _run([_base_python(), "-m", "venv", "--without-pip", str(ENV_DIR)], "could not create its venv")
    env_python = str(ENV_DIR / "bin" / "python")
    _run([str(PROJECT_VENV / "bin" / "python"), "-m", "pip", "--python", env_python, "install", "--quiet",
          "--no-deps", "--disable-pip-version-check", "--no-warn-conflicts", *REQUIREMENTS],
         "pip could not install SAEDashboard 0.8.0 (is the package registry reachable?)")
    # Only now the project venv's packages become visible: pip above must neither count them as
    # installed nor touch them.
    (Path(_site_packages(env_python)) / "project_venv.pth").write_text(
        _site_packages(str(PROJECT_VENV / "bin" / "python")) + "\n")
    _run([env_python, "-c", SMOKE_TEST], "SAEDashboard 0.8.0's modules do not import in its environment")
    MARKER.write_text(MARKER_TEXT)


def _base_python() -> str:
    """The interpreter the project venv was made from (the environment's Python must be the same
    version, since it loads the project venv's compiled packages)."""
    return subprocess.run([str(PROJECT_VENV / "bin" / "python"), "-c", "import sys; print(sys._base_executable)"],
                          check=True, capture_output=True, text=True).stdout.strip()


def _site_packages(python: str) -> str:
    return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()


def _run(command: list[str], failure: str) -> None:
    """Run quietly; on failure raise one clear line (with the command's last line of output)."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise RuntimeError(f"{failure}: {lines[-1] if lines else f'exit status {result.returncode}'}")


if __name__ == "__main__":
    print(saedashboard_python())
