"""The XLA flags this project sets for itself, before JAX starts a backend (importing ``model``
applies them; a flag already in ``XLA_FLAGS`` is left as the user set it).

``--xla_cpu_enable_concurrency_optimized_scheduler=false``: with XLA:CPU's concurrency-optimized
scheduler (on by default in jax 0.10.2) a program holding Gated DeltaNet's chunked recurrence
often never finishes on one CPU device: every XLA thread waits for work and the result never
becomes ready (``model.deltanet.chunked`` over 512 positions, 40 calls a process: 8 processes of 9
hung; none of 13 with the scheduler off, at the same speed; none either on 8 host devices;
``tests/test_deltanet.py``). It only schedules CPU programs: other backends ignore it.
"""

from __future__ import annotations

import os
from typing import MutableMapping

FLAGS = {"--xla_cpu_enable_concurrency_optimized_scheduler": "false"}


def apply(environ: MutableMapping[str, str] = os.environ) -> None:
    """Adds each of ``FLAGS`` that ``environ["XLA_FLAGS"]`` does not name already."""
    flags = environ.get("XLA_FLAGS", "")
    for name, value in FLAGS.items():
        if name not in flags:
            flags = f"{flags} {name}={value}".strip()
    environ["XLA_FLAGS"] = flags
