"""Per-sample statistics of the stored rows, computed on the device inside the extraction step.

For every stored array (a site's layers stacked, ``model.extract.width_groups``) and every sample
of the batch, over the rows that are stored (the selection's rows, padding excluded) and their
values as stored (after the cast to the stored dtype), in float32: the row count, the mean, the sum
of squared deviations from the sample's own mean (``m2``: centred on the device, so that no
float32 cancellation of E[x^2] - E[x]^2 enters it) and the sum of the rows' L2 norms; for a
mixture of experts' expert ids, the rows routed to each expert. Grouped by role
(``runners.tpu_host --stats_by role``), the same again per role of the rows, each row centred by
its own role's mean: group 0 is every stored row, group ``1 + c`` the rows of role code ``c``
(``common.roles.ROLES``).

Only these small arrays ([layers, rows, groups, width] against the activations' [layers, rows,
tokens, width]) cross to the host, where ``activations.site_stats`` merges them per shard and per
fleet in float64 (Chan et al.). ``sample_statistics`` runs the same computation on host arrays
(stored activations written without a model).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from common.roles import ROLES

HIGHEST = jax.lax.Precision.HIGHEST  # float32 sums as float32 (no bfloat16 passes on a TPU's MXU)


@dataclasses.dataclass(frozen=True)
class StatisticsSpec:
    """What the extraction step measures: per role too (``by_role``), and ``experts`` (> 0: a
    mixture's expert-id arrays count the rows routed to each of that many experts)."""
    by_role: bool = False
    experts: int = 0

    @property
    def groups(self) -> int:
        """Groups per sample: every row, then one per role when grouped."""
        return 1 + len(ROLES) if self.by_role else 1


class KeyStatistics(NamedTuple):
    """One stored array's statistics over one sample's rows, per group (0: every row; ``1 + c``:
    the rows of role code ``c``), as they come off the device."""
    count: np.ndarray             # [G] int32
    mean: np.ndarray              # [G, width] float32
    m2: np.ndarray                # [G, width] float32: sum of squared deviations from the group's mean
    norm_sum: np.ndarray          # [G] float32: sum of the rows' L2 norms
    experts: np.ndarray | None    # [G, E] int32: rows routed to each expert (expert ids only)


STAT_FIELDS = KeyStatistics._fields


def row_statistics(values: jax.Array, valid: jax.Array, row_roles: jax.Array | None, spec: StatisticsSpec,
                   integer: bool = False) -> dict[str, jax.Array]:
    """The statistics of ``values`` [L, B, K, W] (the stored rows, stored dtype) over each row
    ``b``'s ``valid`` [B, K] rows, grouped by ``row_roles`` [B, K] (role codes) when ``spec``
    says so: ``{field: [L, B, G, ...]}`` (``KeyStatistics``' fields; ``experts`` where
    ``integer``, the values being expert ids [L, B, K, k])."""
    stored = valid[None, :, :, None]  # [1, B, K, 1]
    # [L, B, K, W]: exact for every stored dtype; rows not stored zeroed (a padding row's float16
    # overflow would otherwise turn the sums into nan).
    x = jnp.where(stored, values.astype(jnp.float32), 0.0)
    count = jnp.sum(valid, axis=1, dtype=jnp.int32)[:, None]  # [B, 1]
    # Every row: plain reductions, which XLA fuses into two passes over the rows (sums and norms;
    # centred squares), the bulk of the cost where the rows are many.
    mean = (jnp.sum(x, axis=2) / jnp.maximum(count, 1).astype(jnp.float32))[:, :, None]  # [L, B, 1, W]
    centred = jnp.where(stored, x - mean, 0.0)
    m2 = jnp.sum(centred * centred, axis=2)[:, :, None]
    norms = jnp.sqrt(jnp.sum(x * x, axis=-1))  # [L, B, K]
    norm_sum = jnp.sum(norms, axis=2)[:, :, None]  # [L, B, 1]
    member = valid[:, :, None]  # [B, K, G]: which group(s) each row counts in
    if spec.by_role:
        roles = jax.nn.one_hot(row_roles, len(ROLES), dtype=jnp.bool_) & valid[:, :, None]  # [B, K, R]
        weights = roles.astype(jnp.float32)
        role_count = jnp.sum(roles, axis=1, dtype=jnp.int32)  # [B, R]
        role_mean = (jnp.einsum("lbkw,bkr->lbrw", x, weights, precision=HIGHEST)
                     / jnp.maximum(role_count, 1)[None, :, :, None].astype(jnp.float32))  # [L, B, R, W]
        # Each row centred by its own role's mean.
        own = x - jnp.einsum("bkr,lbrw->lbkw", weights, role_mean, precision=HIGHEST)
        count = jnp.concatenate([count, role_count], axis=1)
        mean = jnp.concatenate([mean, role_mean], axis=2)
        m2 = jnp.concatenate([m2, jnp.einsum("lbkw,bkr->lbrw", own * own, weights, precision=HIGHEST)], axis=2)
        norm_sum = jnp.concatenate([norm_sum, jnp.einsum("lbk,bkr->lbr", norms, weights, precision=HIGHEST)], axis=2)
        member = jnp.concatenate([member, roles], axis=2)
    out = {"count": jnp.broadcast_to(count, (x.shape[0], *count.shape)), "mean": mean, "m2": m2,
           "norm_sum": norm_sum}
    if integer:
        out["experts"] = expert_loads(values, member, spec.experts)
    return out


def expert_loads(ids: jax.Array, member: jax.Array, experts: int) -> jax.Array:
    """[L, B, G, E] int32: per group, the rows routed to each expert (a row counts once for each
    of its k experts), counted by a scatter-add of ``ids`` [L, B, K, k] over ``member`` [B, K, G]."""
    layers, rows, _, _ = ids.shape
    groups = member.shape[2]
    counts = jnp.zeros((layers, rows, groups, experts), jnp.int32)
    lidx = jnp.arange(layers)[:, None, None, None]
    bidx = jnp.arange(rows)[None, :, None, None]
    for g in range(groups):  # G is 1, or 1 + the roles
        weight = member[None, :, :, g, None].astype(jnp.int32)  # [1, B, K, 1]
        counts = counts.at[lidx, bidx, g, ids].add(jnp.broadcast_to(weight, ids.shape), mode="drop")
    return counts


def split_statistics(stats: dict[str, np.ndarray], layer: int, row: int) -> KeyStatistics:
    """One layer's and one batch row's ``KeyStatistics`` of ``row_statistics``' host copy."""
    return KeyStatistics(*(stats[name][layer, row] if name in stats else None for name in STAT_FIELDS))


@functools.lru_cache(maxsize=None)
def _host_program(by_role: bool, experts: int, integer: bool):
    spec = StatisticsSpec(by_role, experts)
    return jax.jit(lambda values, valid, roles: row_statistics(values, valid, roles, spec, integer))


def sample_statistics(arrays: dict[Any, np.ndarray], spec: StatisticsSpec = StatisticsSpec(),
                      row_roles: np.ndarray | None = None, integer: bool = False) -> dict[Any, KeyStatistics]:
    """``row_statistics`` of one sample's host arrays, ``{key: [rows, width]}`` (every row stored;
    ``row_roles`` [rows]: their role codes, when ``spec`` groups by role), run by JAX on the host:
    what stored activations written without a model carry. Arrays of one width and dtype go
    through one call, their rows padded to a power of two (a compile per size, not per sample)."""
    groups: dict[tuple, list] = {}
    for key, array in arrays.items():
        groups.setdefault((array.shape[1:], array.dtype), []).append(key)
    out = {}
    for keys in groups.values():
        first = arrays[keys[0]]
        rows = len(first)
        padded = 1 << max(0, rows - 1).bit_length()
        values = np.zeros((len(keys), 1, padded, *first.shape[1:]), first.dtype)  # [L, B=1, K, W]
        for layer, key in enumerate(keys):
            values[layer, 0, :rows] = arrays[key]
        valid = np.arange(padded)[None, :] < rows  # [B=1, K]
        roles = np.zeros((1, padded), np.int32)
        if row_roles is not None:
            roles[0, :rows] = row_roles
        measured = jax.device_get(_host_program(spec.by_role, spec.experts, integer)(
            values, valid, roles if spec.by_role else None))
        out.update({key: split_statistics(measured, layer, 0) for layer, key in enumerate(keys)})
    return out
