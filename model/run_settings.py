"""The settings that decide the numbers a run writes, compared when a run goes on into an output.

Each runner keeps its settings with its output (the host's checkpoint, an ablation's
``experiment.json``) and refuses to go on with other ones: the output would mix two kinds of
numbers. A setting that the stored ones lack (output older than the setting) reads as what runs
did before it existed (``BEFORE``), or None.
"""

from __future__ import annotations

from typing import Any, Callable

from model.sites import DEFAULT_SITES

# What output made before a setting existed had, given its other settings.
BEFORE: dict[str, Callable[[dict[str, Any]], Any]] = {
    # The residual stream was kept in the compute dtype.
    "residual_dtype": lambda stored: stored.get("dtype"),
    # Only block outputs were stored (model.sites).
    "sites": lambda stored: list(DEFAULT_SITES),
    # Every shard got its statistics (computed on the host; on the devices since, the same to 1e-5).
    "statistics": lambda stored: "device",
}
# Where a setting is stored resolved, how to ask for a value again.
HINTS = {"residual_dtype": "--residual_dtype compute: a stream in the compute dtype; float32: in float32"}


def changed_settings(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``--name old -> new`` for each setting of ``current`` that ``stored`` has otherwise."""
    def before(name: str) -> Any:
        if name in stored:
            return stored[name]
        return BEFORE[name](stored) if name in BEFORE else None

    def change(name: str, value: Any) -> str:
        hint = f" ({HINTS[name]})" if name in HINTS else ""
        return f"--{name} {before(name)!r} -> {value!r}{hint}"
    return [change(name, value) for name, value in current.items() if before(name) != value]
