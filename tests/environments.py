"""Environments of their own for the clients whose pins conflict with the project venv
(SAEDashboard, circuit-tracer): a venv under ``.venv/envs/<name>/`` made on first use, holding
the client's own pinned packages (installed without dependencies) and, through a ``.pth`` file
placed after its own site-packages, the project venv's (CPU torch and the rest). A marker file
holding the requirements, written last, says the environment is complete (a half-made one, or
one of other requirements, is rebuilt); a file lock keeps two pytest workers from building it at
once. Each client's module (``tests/saedashboard.py``, ``tests/circuit_tracer.py``) says what
it installs and why."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
PROJECT_VENV = REPO / ".venv"


def environment_python(name: str, requirements: Sequence[str], smoke_test: str) -> str:
    """The interpreter of the environment ``name`` (e.g. ``saedashboard-0.8.0``), made on first use:
    ``requirements`` installed, then ``smoke_test`` (Python source) run in it."""
    env_dir = PROJECT_VENV / "envs" / name
    python, marker, marker_text = env_dir / "bin" / "python", env_dir / "complete", "\n".join(requirements) + "\n"

    def complete() -> bool:
        return marker.is_file() and marker.read_text() == marker_text
    if complete():  # the usual case: no lock, no subprocess
        return str(python)
    lock_path = env_dir.parent / f"{name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be building it; wait for it
        if not complete():
            _build(name, env_dir, requirements, smoke_test)
            marker.write_text(marker_text)
    return str(python)


def _build(name: str, env_dir: Path, requirements: Sequence[str], smoke_test: str) -> None:
    """Make the environment from scratch (whatever a failed attempt left is thrown away)."""
    shutil.rmtree(env_dir, ignore_errors=True)
    # Without pip of its own: the project venv's pip installs into it (--python), which saves the
    # seconds ensurepip takes.
    _run([_base_python(), "-m", "venv", "--without-pip", str(env_dir)], f"{name}: could not create its venv")
    env_python = str(env_dir / "bin" / "python")
    # Compiled on install (pip's default): transformers' thousands of modules would otherwise be
    # compiled on every import where bytecode is not written (PYTHONDONTWRITEBYTECODE).
    _run([str(PROJECT_VENV / "bin" / "python"), "-m", "pip", "--python", env_python, "install", "--quiet",
          "--no-deps", "--disable-pip-version-check", "--no-warn-conflicts", *requirements],
         f"pip could not install {name} (is the package registry reachable?)")
    # Only now the project venv's packages become visible: pip above must neither count them as
    # installed nor touch them.
    (Path(_site_packages(env_python)) / "project_venv.pth").write_text(
        _site_packages(str(PROJECT_VENV / "bin" / "python")) + "\n")
    _run([env_python, "-c", smoke_test], f"{name}'s modules do not import in its environment")


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
