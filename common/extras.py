"""Optional dependencies: each command that needs one names the extra that installs it.

``pip install -e .`` installs what prepare, the runner and the reader need (what a Dataflow
worker or a TPU host installs); the rest comes in extras (``setup.py``): ``tpu-vm``, ``gke``,
``charts``, ``tracking``, ``probes``. ``require`` imports a module of one, or says in one line which extra
to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from common.cli import UserError

PACKAGE = "activation-extraction"


def require(module: str, extra: str, needed_for: str) -> ModuleType:
    """``module``, imported; ``UserError`` naming ``extra`` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{needed_for} needs the {extra!r} extra ({module.split('.')[0]} is not installed): "
                        f"pip install '{PACKAGE}[{extra}]'") from None
