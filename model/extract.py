"""The extraction forward: residual stream at chosen layers, bucketed, sharded, unpadded.

Layer ``L`` is the output of decoder block ``L`` (0-based), before the final norm: Hugging Face's
``hidden_states[L + 1]`` for every block but the last (whose ``hidden_states`` entry has the final
norm applied). Blocks after the last requested one are never computed, nor is the LM head.

Each batch shape (rows, bucket length) is compiled once, explicitly, so that a runner can watch
compiles and batches through a ``ForwardObserver`` (health reporting, profiling).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, ContextManager, Iterable, Iterator, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from common.cli import UserError
from model.buckets import Batch, Bucketer, bucket_lengths
from model.checkpoint import resolve_model_dir
from model.config import Qwen2Config, load_config
from model.loading import LoadedModel, load_model
from model.qwen2 import Qwen2, causal_mask, chunk_tokens_for
from model.sharding import batch_sharding

T = TypeVar("T")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ACTIVATION_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


def validate_layers(layers: Sequence[int], config: Qwen2Config) -> tuple[int, ...]:
    """Sorted unique layer indices, each a block of this model; ``UserError`` otherwise."""
    n = config.num_hidden_layers
    bad = [layer for layer in layers if not 0 <= layer < n]
    if bad:
        raise UserError(f"layer {bad[0]} does not exist: the model has {n} layers (0..{n - 1})")
    if not layers:
        raise UserError("no layers to extract")
    return tuple(sorted(set(layers)))


def resolve_dtype(name: str) -> Any:
    """``auto`` is bfloat16 on TPU/GPU and float32 on CPU."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r} (choose from auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def padded_rows(num_sequences: int, batch_size: int, data_axis: int) -> int:
    """Rows of a batch: the next power of two (at least the data axis, at most ``batch_size``).

    Full batches use ``batch_size`` rows; a partial one (the tail of a stream) computes few
    empty rows, at the cost of at most log2(batch_size) extra compiles per length bucket.
    """
    rows = max(data_axis, 1 << max(0, num_sequences - 1).bit_length())
    return min(batch_size, -(-rows // data_axis) * data_axis)


class ForwardObserver:
    """What a runner may watch of an ``Extractor``; this base class watches nothing."""

    def compiling(self, rows: int, length: int) -> ContextManager[None]:
        """Wraps the compile of the batch shape [rows, length] (a persistent-cache load too)."""
        return contextlib.nullcontext()

    def batch(self, rows: int, length: int) -> ContextManager[None]:
        """Wraps one batch: inputs to the devices, forward, activations back on the host."""
        return contextlib.nullcontext()


def make_forward(config: Qwen2Config, dtype: Any, layers: tuple[int, ...], mesh: Mesh,
                 out_dtype: Any = None):
    """jit(params, input_ids [B, S], lengths [B]) -> activations [len(layers), B, S, H].

    ``out_dtype`` casts on the device, so a narrower storage dtype also halves the transfer."""
    model = Qwen2(config, dtype, mesh, chunk_tokens_for(mesh))
    num_layers = max(layers) + 1

    def forward(params, input_ids, lengths):
        seq = input_ids.shape[1]
        positions = jnp.broadcast_to(jnp.arange(seq), input_ids.shape)
        outputs, _ = model.apply({"params": params}, input_ids, positions,
                                 causal_mask(lengths, seq), num_layers)
        stacked = jnp.stack([outputs[layer] for layer in layers])  # [len(layers), B, S, H]
        return stacked if out_dtype is None else stacked.astype(out_dtype)

    return jax.jit(forward, out_shardings=NamedSharding(mesh, P(None, "data")))


@dataclasses.dataclass
class Extractor:
    """A loaded model ready to extract; build it with ``Extractor.load``."""
    config: Qwen2Config
    params: dict
    mesh: Mesh
    layers: tuple[int, ...]
    dtype: Any
    batch_size: int               # global: per-device batch size x data axis
    buckets: tuple[int, ...]
    activation_dtype: Any = None  # dtype of the returned arrays (default: the compute dtype)
    observer: ForwardObserver = dataclasses.field(default_factory=ForwardObserver)
    _executables: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict, init=False,
                                                                 repr=False)

    @classmethod
    def load(cls, model_path: str, layers: Sequence[int] | None = None, mesh_type: str = "1d",
             dtype: str = "auto", batch_size_per_device: int = 1, max_seq_length: int = 2048,
             model_axis_size: int | None = None, min_bucket: int = 32,
             devices: list | None = None, activation_dtype: str | None = None) -> "Extractor":
        """Loads only the blocks up to the last requested layer, straight onto the mesh."""
        model_dir = resolve_model_dir(model_path)
        config = load_config(model_dir)
        layers = validate_layers(range(config.num_hidden_layers) if layers is None else layers, config)
        loaded = load_model(model_dir, resolve_dtype(dtype), mesh_type, model_axis_size,
                            num_layers=max(layers) + 1, devices=devices)
        return cls.from_loaded(loaded, layers, batch_size_per_device, max_seq_length, min_bucket,
                               activation_dtype)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, layers: Sequence[int], batch_size_per_device: int = 1,
                    max_seq_length: int = 2048, min_bucket: int = 32,
                    activation_dtype: str | None = None) -> "Extractor":
        if activation_dtype is not None and activation_dtype not in ACTIVATION_DTYPES:
            raise UserError(f"unknown activation dtype {activation_dtype!r} "
                            f"(choose from {', '.join(ACTIVATION_DTYPES)})")
        return cls(loaded.config, loaded.params, loaded.mesh, validate_layers(layers, loaded.config),
                   loaded.dtype, batch_size_per_device * loaded.mesh.shape["data"],
                   bucket_lengths(max_seq_length, min(min_bucket, max_seq_length)),
                   ACTIVATION_DTYPES.get(activation_dtype))

    @functools.cached_property
    def _forward(self):
        return make_forward(self.config, self.dtype, self.layers, self.mesh, self.activation_dtype)

    def executable(self, rows: int, length: int):
        """The forward compiled for inputs [rows, length] (compiled on first use)."""
        key = (rows, length)
        if key not in self._executables:
            sharding = batch_sharding(self.mesh)
            ids = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=sharding)
            lengths = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sharding)
            with self.observer.compiling(rows, length):
                self._executables[key] = self._forward.lower(self.params, ids, lengths).compile()
        return self._executables[key]

    def run_batch(self, sequences: Sequence[Sequence[int]], length: int) -> list[dict[int, np.ndarray]]:
        """Activations of up to ``batch_size`` sequences padded to ``length``: per sequence,
        ``{layer: array [num_tokens, H]}`` with padding removed."""
        rows = padded_rows(len(sequences), self.batch_size, self.mesh.shape["data"])
        ids = np.zeros((rows, length), np.int32)  # [B, S]; padding rows stay 0
        lengths = np.zeros((rows,), np.int32)
        for row, seq in enumerate(sequences):
            ids[row, :len(seq)] = seq
            lengths[row] = len(seq)
        forward = self.executable(rows, length)
        sharding = batch_sharding(self.mesh)
        with self.observer.batch(rows, length):
            out = forward(self.params, jax.device_put(ids, sharding), jax.device_put(lengths, sharding))
            acts = np.asarray(out)  # [len(layers), B, S, H]
        return [{layer: acts[i, row, :lengths[row]] for i, layer in enumerate(self.layers)}
                for row in range(len(sequences))]

    def extract(self, items: Iterable[tuple[T, Sequence[int]]]) -> Iterator[tuple[T, dict[int, np.ndarray]]]:
        """(key, input_ids) pairs -> (key, {layer: [num_tokens, H]}), batched by length bucket.

        Results come out in batch order (grouped by bucket), not input order. A sequence longer
        than ``max_seq_length`` raises ``ValueError``.
        """
        for batch in self.batches(items):
            yield from self._run(batch)

    def batches(self, items: Iterable[tuple[T, Sequence[int]]]) -> Iterator[Batch]:
        """The batches ``extract`` computes, in order: each full one as soon as it fills, then the
        partial ones (``run_batch`` pads their rows, see ``padded_rows``)."""
        bucketer: Bucketer[tuple[T, Sequence[int]]] = Bucketer(self.buckets, self.batch_size)
        for key, ids in items:
            yield from bucketer.add((key, ids), len(ids))
        yield from bucketer.flush()

    def _run(self, batch: Batch) -> Iterator[tuple[T, dict[int, np.ndarray]]]:
        keys = [key for key, _ in batch.items]
        yield from zip(keys, self.run_batch([ids for _, ids in batch.items], batch.length))
