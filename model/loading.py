"""Loading a checkpoint onto a mesh in one call: config, mesh and parameter tree."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from model.checkpoint import Checkpoint
from model.hub import resolve_model_dir
from model.config import DecoderConfig
from model.families import load_config
from model.params import load_params
from model.sharding import make_mesh


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: DecoderConfig
    mesh: Mesh
    params: dict
    dtype: Any


def load_model(model_path: str, dtype: Any, mesh_type: str = "1d", model_axis_size: int | None = None,
               num_layers: int | None = None, with_head: bool = False,
               devices: list | None = None, revision: str | None = None) -> LoadedModel:
    """Blocks ``0..num_layers-1`` (all by default; plus norm and LM head with ``with_head``);
    ``revision``: of a hub id (``model.hub.resolve_model_dir``)."""
    model_dir = resolve_model_dir(model_path, revision)
    config = load_config(model_dir)
    mesh = make_mesh(mesh_type, config, model_axis_size, devices)
    params = load_params(Checkpoint(model_dir), config, mesh, dtype, num_layers, with_head)
    return LoadedModel(config, mesh, params, dtype)
