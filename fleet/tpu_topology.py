"""What a GKE TPU node selector means in hosts: ``--gke_accelerator`` and ``--gke_topology`` ->
chips, hosts (pods) per machine, chips per host (``google.com/tpu`` of each pod).

The chips are the product of the topology's dimensions (``4x4`` = 16, ``2x2x2`` = 8). A topology
that fits on one host is single-host (v5e/v6e: ``1x1``, ``2x2``, ``2x4`` hold 1, 4, 8 chips on one
VM; v4/v5p: ``2x2x1``, 4 chips); anything larger is a multi-host slice of 4 chips per host
(v5e ``4x4`` = 4 hosts, v4 ``2x2x2`` = 2). v5e/v6e ``2x4`` also exists as a 2-host slice of the
4-chip machine type: ``--tpu_chips 4`` says so. Sources: GKE's "About TPUs in GKE" and "Plan TPUs
in GKE" (a v5litepod-16, topology 4x4, is four TPU VMs of four chips each) and xpk's
``src/xpk/core/system_characteristics.py`` (``chips_per_vm = 1 if total_chips == 1 else 4`` for
the multi-host machine types ct5lp-hightpu-4t, ct6e-standard-4t, ct4p-hightpu-4t, ct5p-hightpu-4t).
"""

from __future__ import annotations

import dataclasses
import math

from common.cli import UserError

MULTI_HOST_CHIPS = 4  # chips per host of every multi-host TPU slice GKE offers for these accelerators


@dataclasses.dataclass(frozen=True)
class Accelerator:
    dimensions: int                    # 2 (v5e, v6e: 2x4) or 3 (v4, v5p: 2x2x1)
    single_host_chips: tuple[int, ...]  # the chip counts one host holds by itself


ACCELERATORS = {
    "tpu-v4-podslice": Accelerator(3, (4,)),
    "tpu-v5p-slice": Accelerator(3, (4,)),
    "tpu-v5-lite-podslice": Accelerator(2, (1, 4, 8)),
    "tpu-v6e-slice": Accelerator(2, (1, 4, 8)),
}


@dataclasses.dataclass(frozen=True)
class SliceShape:
    chips: int            # in the whole slice (one machine)
    chips_per_host: int   # google.com/tpu of each pod
    hosts: int            # pods per machine

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1


def topology_chips(accelerator: str, topology: str) -> int:
    """The chips of ``topology`` (``"4x4"`` -> 16); one line for an unknown accelerator or a
    topology that is not its number of dimensions."""
    if accelerator not in ACCELERATORS:
        raise UserError(f"--gke_accelerator {accelerator!r} is not a TPU accelerator this fleet knows "
                        f"(choose from {', '.join(ACCELERATORS)})")
    dims = ACCELERATORS[accelerator].dimensions
    parts = topology.split("x")
    if len(parts) != dims or not all(p.isdigit() and int(p) > 0 for p in parts):
        example = "2x4" if dims == 2 else "2x2x1"
        raise UserError(f"--gke_topology {topology!r}: {accelerator} topologies have {dims} dimensions, "
                        f"e.g. {example}")
    return math.prod(int(p) for p in parts)


def chips_per_host_options(accelerator: str, chips: int) -> list[int]:
    """The chips one host of a ``chips``-chip slice may hold: the whole slice (single-host), and
    4 when it is a multi-host slice of 4-chip hosts."""
    options = [chips] if chips in ACCELERATORS[accelerator].single_host_chips else []
    if chips % MULTI_HOST_CHIPS == 0 and chips > MULTI_HOST_CHIPS:
        options.append(MULTI_HOST_CHIPS)
    return options


def slice_shape(accelerator: str, topology: str, chips_per_host: int | None = None) -> SliceShape:
    """Hosts and chips per host of one machine; ``chips_per_host`` (``--tpu_chips``) picks between
    the shapes a topology has (v5e/v6e ``2x4``: 8 on one host, or 4 on each of 2) and is refused
    where it contradicts the topology."""
    chips = topology_chips(accelerator, topology)
    options = chips_per_host_options(accelerator, chips)
    if not options:
        raise UserError(f"--gke_topology {topology} ({chips} chips) is not a slice GKE offers for "
                        f"{accelerator}")
    chosen = options[0] if chips_per_host is None else chips_per_host
    if chosen not in options:
        fits = " or ".join(f"{n} ({chips // n} host{'s' if chips // n > 1 else ''})" for n in options)
        raise UserError(f"--tpu_chips {chips_per_host} does not fit --gke_topology {topology} of "
                        f"{accelerator} ({chips} chips): chips per host must be {fits}")
    return SliceShape(chips=chips, chips_per_host=chosen, hosts=chips // chosen)
