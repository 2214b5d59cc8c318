"""The extraction forward: activation sites at chosen layers, bucketed, sharded, unpadded.

Layer ``L`` is the output of decoder block ``L`` (0-based), before the final norm: Hugging Face's
``hidden_states[L + 1]`` for every block but the last (whose ``hidden_states`` entry has the final
norm applied). Other sites of a block (``model.sites``: the MLP's input and output, attention's z,
...) come from what the decoder sows; each sequence's arrays are keyed by ``model.sites.array_keys``.
Blocks after the last one a requested site needs are never computed, nor is the LM head, and only
the requested arrays leave the devices; with ``statistics``, beside them the per-sample statistics
the same compiled step measures of them (``model.statistics``), a few vectors a sample.

Each batch shape (rows, bucket length) is compiled once, explicitly, so that a runner can watch
compiles and batches through a ``ForwardObserver`` (health reporting, profiling).

Batches are pipelined: batch k+1 is placed on the devices and dispatched before batch k's
activations are copied back (at most ``batches_in_flight`` at once), so transfers overlap compute.
On GPUs the copy lands in page-locked host memory (``Extractor.host_memory_kind``), which the
device writes at its own speed.
Over several processes (a multi-host slice, ``jax.distributed``) every process runs the same
batches; each feeds only the rows that live on its own devices and reads back only those rows'
activations: the other rows come back as ``None``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from typing import Any, Callable, ContextManager, Iterable, Iterator, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from common.cli import UserError
from model.buckets import Batch, Bucketer, bucket_lengths
from model.hub import resolve_model_dir
from model.attention import attention_for, causal_mask
from model.config import COMPUTE_DTYPES, FLOAT8, QUANTIZED_DTYPES, RESIDUAL_DTYPES, STORED_DTYPES, DecoderConfig
from model.families import load_config
from model.loading import LoadedModel, load_model
from model.quantize import dequantize, dequantized_rows, quantize_rows
from model.decoder import Decoder, chunk_tokens_for, steered
from model.interventions import STEER_TOKENS, steer_key, steered_token_mask
from model.sharding import batch_sharding
from model.statistics import STAT_FIELDS, KeyStatistics, StatisticsSpec, row_statistics, split_statistics
from model.sites import (AFTER_BLOCKS, ATTN_SCORES, DEFAULT_SITES, EMBED, FINAL_NORM, FINAL_NORMALIZED, HEAD_OUTPUTS,
                         LOSS, MLP_HIDDEN, MLP_POST, PATTERNS, RESID_POST, RESID_PRE, ROUTING, SHARED_EXPERT, SITES,
                         ArrayKey, array_key, array_keys, blocks_needed, check_sites, describe_key, integers_held,
                         key_parts, parse_sites, site_layers, site_width, with_top_k)
from model.token_scores import next_tokens, token_scores

T = TypeVar("T")
DTYPES = {name: getattr(jnp, name) for name in COMPUTE_DTYPES}
ACTIVATION_DTYPES = {name: getattr(jnp, name) for name in STORED_DTYPES + QUANTIZED_DTYPES}
HOST_MEMORIES = ("auto", "pinned", "pageable")  # Extractor.host_memory
PINNED = "pinned_host"  # JAX's memory kind of page-locked host memory
def measured_statistics(spec: StatisticsSpec | None, config: DecoderConfig) -> StatisticsSpec | None:
    """``spec`` as a forward of this model measures it: with its expert count (None: none)."""
    return spec and dataclasses.replace(spec, experts=config.num_experts)


# The intervention ``Extractor.load`` extracts under: (the model's config, the blocks its forward
# acts on) -> (its arrays over them, ``model.interventions``; the token selection its steerings
# share, None for every token). The spec is read above the model: ``interventions.resolve.ablation_source``.
AblationSource = Callable[[DecoderConfig, int], tuple[dict[str, np.ndarray] | None, str | None]]


def validate_layers(layers: Sequence[int], config: DecoderConfig) -> tuple[int, ...]:
    """Sorted unique layer indices, each a block of this model; ``UserError`` otherwise."""
    n = config.num_hidden_layers
    bad = [layer for layer in layers if not 0 <= layer < n]
    if bad:
        raise UserError(f"layer {bad[0]} does not exist: the model has {n} layers (0..{n - 1})")
    if not layers:
        raise UserError("no layers to extract")
    return tuple(sorted(set(layers)))


def check_model_fits(config: DecoderConfig, sites: Sequence[str], max_seq_length: int,
                     layers: Sequence[int] = ()) -> None:
    """``UserError`` in one line for a site this model does not have (at one of ``layers``), or
    sequences longer than its learned position table."""
    check_sites(sites, config, layers)
    if config.positions == "learned" and max_seq_length > config.max_position_embeddings:
        raise UserError(f"--max_seq_length {max_seq_length}: {config.model_type} has learned positions for "
                        f"{config.max_position_embeddings} tokens (n_positions); pass "
                        f"--max_seq_length {config.max_position_embeddings} or less")


def resolve_dtype(name: str) -> Any:
    """``auto`` is bfloat16 on TPU/GPU and float32 on CPU."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r} (choose from auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def resolve_residual_dtype(name: str) -> Any:
    """The residual stream's dtype for ``Decoder``: ``float32`` (with bfloat16 compute, matmul
    operands stay bfloat16 and accumulate in float32), or None for ``compute`` (the compute dtype,
    every sum rounded to it, as Hugging Face's bfloat16 forward does)."""
    if name not in RESIDUAL_DTYPES:
        raise UserError(f"unknown residual dtype {name!r} (choose from {', '.join(RESIDUAL_DTYPES)})")
    return jnp.float32 if name == "float32" else None


def residual_dtype_name(dtype: Any, residual_dtype: Any) -> str:
    """The dtype the residual stream is actually kept in, by name (``bfloat16``, ``float32``)."""
    return jnp.dtype(residual_dtype if residual_dtype is not None else dtype).name


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
        """Wraps the dispatch of one batch: inputs to the devices, forward started (with
        pipelining its activations come back while the next batch is dispatched)."""
        return contextlib.nullcontext()

    def host_side(self, stage: str) -> ContextManager[None]:
        """Wraps a host-side step of a computed batch: ``device_to_host`` (its activations copied
        off the devices, the forward already finished) and ``split`` (cut per sequence)."""
        return contextlib.nullcontext()

    def computed(self, count: int) -> None:
        """A batch of ``count`` sequences is back on the host (its window may still be filling)."""


# One jitted forward per setting in a process: an Extractor or InterventionModel built again on the
# same model (a runner's next run in the same process, a test's) reuses JAX's traces and compiled
# programs instead of tracing and lowering each shape anew.
@functools.lru_cache(maxsize=64)
def make_forward(config: DecoderConfig, dtype: Any, layers: tuple[int, ...], mesh: Mesh,
                 out_dtype: Any = None, attention: str = "auto", residual_dtype: Any = None,
                 moe_dispatch: str = "auto"):
    """jit(params, input_ids [B, S], lengths [B], ablation) -> block outputs [len(layers), B, S, H].

    ``out_dtype`` casts on the device, so a narrower storage dtype also halves the transfer.
    ``attention``: auto | tiled | fused (``model.attention.attention_for``). ``ablation``: None, or the
    arrays of an intervention (``model.interventions.ablation_arrays``). ``residual_dtype``: see
    ``resolve_residual_dtype`` (None: the compute dtype). ``moe_dispatch``: ``model.moe``'s."""
    forward = site_forward(config, dtype, layers, (RESID_POST,), mesh, out_dtype, attention, residual_dtype,
                           moe_dispatch)
    return jax.jit(lambda *args: forward(*args)[RESID_POST], out_shardings=NamedSharding(mesh, P(None, "data")))


@functools.lru_cache(maxsize=64)  # as make_forward
def make_sites_forward(config: DecoderConfig, dtype: Any, layers: tuple[int, ...], sites: tuple[str, ...],
                       mesh: Mesh, out_dtype: Any = None, attention: str = "auto", residual_dtype: Any = None,
                       moe_dispatch: str = "auto", pool: str | None = None,
                       statistics: StatisticsSpec | None = None, logits_top_k: int | None = None):
    """jit(params, input_ids, lengths, ablation[, select[, row_roles]]) -> {site: [len(layers), B, S,
    width]} for each of ``sites`` (``model.sites``); otherwise as ``make_forward``. With ``select``
    (positions [B, K], counts [B]: each row's first ``counts`` positions are its selected tokens),
    only those rows: [len(layers), B, K, width], or with ``pool`` ("mean") their mean:
    [len(layers), B, 1, width]. With ``statistics``: (those arrays, ``{key: row_statistics}`` of
    each), grouped by ``row_roles`` [B, S or K] (the stored rows' role codes) where it says so."""
    forward = site_forward(config, dtype, layers, sites, mesh, out_dtype, attention, residual_dtype, moe_dispatch,
                           pool, statistics, logits_top_k)
    return jax.jit(forward, out_shardings=NamedSharding(mesh, P(None, "data")))


def selected_rows(values: jax.Array, positions: jax.Array, counts: jax.Array, pool: str | None) -> jax.Array:
    """The selected rows of ``values`` [L, B, S, W]: [L, B, K, W] gathered at ``positions`` [B, K]
    (exact), or with ``pool`` their mean over each row's first ``counts`` [B], in float32: [L, B, 1, W]."""
    picked = jnp.take_along_axis(values, positions[None, :, :, None], axis=2)  # [L, B, K, W]
    if pool is None:
        return picked
    valid = jnp.arange(positions.shape[1])[None, :] < counts[:, None]  # [B, K]
    total = jnp.sum(jnp.where(valid[None, :, :, None], picked.astype(jnp.float32), 0.0), axis=2, keepdims=True)
    return total / jnp.maximum(counts, 1).astype(jnp.float32)[None, :, None, None]  # [L, B, 1, W]


def site_forward(config: DecoderConfig, dtype: Any, layers: tuple[int, ...], sites: tuple[str, ...], mesh: Mesh,
                 out_dtype: Any = None, attention: str = "auto", residual_dtype: Any = None,
                 moe_dispatch: str = "auto", pool: str | None = None, statistics: StatisticsSpec | None = None,
                 logits_top_k: int | None = None):
    """The un-jitted forward of ``make_sites_forward``. Blocks past the last one a site needs are
    not computed; of the sites the blocks sow, only those asked for are returned (XLA drops the
    rest), so block outputs alone compile to the graph they always did. A selection picks its rows
    on the device, before the cast to ``out_dtype``: only they leave it. With ``out_dtype``
    float8_e4m3fn, a site's output is (its float8 rows, their scales: [len(layers), B, rows]),
    quantized there (``model.quantize``). The statistics are of the stored rows as a reader gets
    them (``model.statistics``; float8 rows dequantized)."""
    model = Decoder(config, dtype, mesh, chunk_tokens_for(mesh), attention_for(mesh, attention, config, dtype),
                    residual_dtype, mlp_sites=tuple(site for site in (*MLP_HIDDEN, MLP_POST) if site in sites),
                    moe_dispatch=moe_dispatch, routing_sites=any(site in ROUTING + SHARED_EXPERT for site in sites),
                    pattern_layers=layers if any(site in PATTERNS for site in sites) else ())
    num_layers = blocks_needed(sites, layers, config.num_hidden_layers)

    def forward(params, input_ids, lengths, ablation, select=None, row_roles=None):
        seq = input_ids.shape[1]
        positions = jnp.broadcast_to(jnp.arange(seq), input_ids.shape)
        apply = functools.partial(model.apply, {"params": params}, input_ids, positions,
                                  causal_mask(lengths, seq), num_layers, ablation=ablation)
        if sites == (RESID_POST,):  # the graph block outputs always had
            (outputs, _), state = apply(), {}
        else:
            (outputs, _), state = apply(mutable=["sites"])
        values, measured = {}, {}
        model_level = model_site_values(model, params, state, outputs, input_ids, lengths, select, pool, sites,
                                        logits_top_k)  # {site: [B, S or K or 1, width]}
        for site in sites:
            for key, group in width_groups(config, site, layers, logits_top_k).items():
                if site in model_level:
                    per_layer = [model_level[site]]
                elif site == RESID_POST:
                    per_layer = [outputs[layer] for layer in group]
                elif site == RESID_PRE:  # the block's input as the block sees it: after a steering there
                    steer = (ablation or {}).get(steer_key(RESID_PRE))  # [computed blocks, H]
                    per_layer = [steered(outputs[layer - 1] if layer else state["sites"]["embeddings"][0],
                                         steer[layer] if steer is not None and layer < len(steer) else None,
                                         (ablation or {}).get(STEER_TOKENS)) for layer in group]
                else:
                    per_layer = [sown_value(state["sites"][f"layers_{layer}"], site) for layer in group]
                stacked = jnp.stack(per_layer)  # [len(group), B, S, width]
                if select is not None and site not in HEAD_OUTPUTS:  # the head's rows are selected already
                    stacked = selected_rows(stacked, *select, pool)  # [len(group), B, K or 1, width]
                if out_dtype == jnp.dtype(FLOAT8) and not SITES[site].integer:
                    values[key] = quantize_rows(stacked)  # (float8 [len(group), B, rows, width], scale [.., rows])
                    stored = dequantized_rows(*values[key])  # what a reader gets back
                else:
                    stored = values[key] = (stacked if out_dtype is None or SITES[site].integer
                                            else stacked.astype(out_dtype))
                if statistics is not None and SITES[site].measured:  # fixed widths, no NaN, no token ids
                    valid = stored_rows(lengths, select, pool, stacked.shape[2])  # [B, S or K]
                    measured[key] = row_statistics(stored, valid, row_roles, statistics, SITES[site].integer)
        return values if statistics is None else (values, measured)

    return forward


def model_site_values(model: Decoder, params: dict, state: dict, outputs: list, input_ids: jax.Array,
                      lengths: jax.Array, select, pool: str | None, sites: tuple[str, ...],
                      top_k: int | None) -> dict[str, jax.Array]:
    """The model-level sites among ``sites`` (``model.sites.MODEL_SITES``) -> {site: [B, S, width]}:
    the embeddings, the final norm of the last block's output (``outputs[-1]``: every block was
    computed), and the unembedding's (``model.token_scores``) of the selected rows only (``select``:
    [B, K, width], or pooled [B, 1, width]), so that a selection never forms every token's logits."""
    found = {}
    if EMBED in sites:  # GPT-2's tokens without the positions; else the stream's start
        found[EMBED] = state["sites"].get(EMBED, state["sites"]["embeddings"])[0]
    if not any(site in AFTER_BLOCKS for site in sites):
        return found
    normed, norm_state = model.apply({"params": params}, outputs[-1], method=Decoder.final_norm, mutable=["sites"])
    found[FINAL_NORM] = normed
    if model.config.final_norm:  # (Qwen4-Exp has none: missing_reason refuses the site)
        found[FINAL_NORMALIZED] = norm_state["sites"]["norm"][FINAL_NORMALIZED][0]
    head = tuple(site for site in HEAD_OUTPUTS if site in sites)
    if head:
        following, has_next = next_tokens(input_ids, lengths)  # [B, S] each
        if select is not None:  # [B, K] rows of each
            positions = select[0]
            normed = jnp.take_along_axis(normed, positions[..., None], axis=1)  # [B, K, H]
            following, has_next = (jnp.take_along_axis(y, positions, axis=1) for y in (following, has_next))
        logits = model.apply({"params": params}, normed, method=Decoder.unembed)  # [B, S or K, V]
        for site, value in token_scores(logits, following, has_next, head, top_k).items():
            if pool is not None:  # the selected rows' mean, as selected_rows pools
                rows = jnp.broadcast_to(jnp.arange(value.shape[1]), value.shape[:2])
                value = selected_rows(value[None], rows, select[1], pool)[0]
            found[site] = value
    return {site: value for site, value in found.items() if site in sites}


def stored_rows(lengths: jax.Array, select: tuple[jax.Array, jax.Array] | None, pool: str | None,
                rows: int) -> jax.Array:
    """[B, rows] bool: which of the forward's output rows are a sample's stored ones (its tokens;
    with a selection its first ``counts`` rows, pooled its one row where it selects any)."""
    kept = lengths if select is None else select[1]
    if pool is not None:
        kept = jnp.minimum(kept, 1)
    return jnp.arange(rows)[None, :] < kept[:, None]


def width_groups(config: DecoderConfig, site: str, layers: Sequence[int],
                 top_k: int | None = None) -> dict[str, tuple[int, ...]]:
    """The forward's output arrays for ``site`` over ``layers``: {key: the layers stacked in it}.
    One array keyed by the site where every block gives it the same width; else one per width,
    keyed ``site@width`` (Gemma 4's heads and MLPs: no block's values padded to another's). A
    model-level site is one array at ``MODEL_LAYER``."""
    groups: dict[int, list[int]] = {}
    for layer in site_layers(site, layers):  # a pattern's width is the sample's; each block's is its heads' times it
        groups.setdefault(site_width(site, config, layer, 1, top_k), []).append(layer)
    if len(groups) == 1:
        return {site: tuple(*groups.values())}
    return {f"{site}@{width}": tuple(group) for width, group in groups.items()}


def sown_value(block_sites: dict, site: str) -> jax.Array:
    """The value a block sowed as ``site``, wherever in the block (a norm or attention sows its
    own): [B, S, width]."""
    for name, value in block_sites.items():
        if name == site:
            return value[0]
        if isinstance(value, dict) and site in value:
            return value[site][0]
    raise KeyError(f"the decoder block sowed no {site!r}")


def check_pool(pool: str | None, sites: Sequence[str]) -> None:
    """``UserError`` for pooling a site of integers (expert ids, token ids, ranks), or the loss
    (NaN at a sample's last token)."""
    integer = [site for site in sites if SITES[site].integer or site == LOSS]
    if pool is not None and integer:
        what = "NaN at a sample's last token" if integer[0] == LOSS else integers_held(integer[0])
        raise UserError(f"--tokens {pool}: {integer[0]} holds {what}, which have no mean; store it without "
                        "pooling, or leave it out of --sites")


def check_quantized(activation_dtype: str | None, sites: Sequence[str]) -> None:
    """``UserError`` for float8 storage of a site of integers (a mixture of experts' expert ids):
    ids are not scaled and rounded; nor are scores, whose masked keys are -inf."""
    integer = [site for site in sites if SITES[site].integer]
    if activation_dtype in QUANTIZED_DTYPES and integer:
        raise UserError(f"--activation_dtype {activation_dtype}: {integer[0]} holds {integers_held(integer[0])}, "
                        "which are never quantized; store them with another --activation_dtype, or leave them out of "
                        "--sites")
    if activation_dtype in QUANTIZED_DTYPES and ATTN_SCORES in sites:
        raise UserError(f"--activation_dtype {activation_dtype}: {ATTN_SCORES} holds -inf at masked keys, which "
                        f"has no float8 scale; store attn.hook_pattern, or the scores with another --activation_dtype")


def check_float16_range(activations: dict[ArrayKey, np.ndarray]) -> None:
    """``UserError`` if a sequence's float16 activations (padding removed) hold an infinity: a
    value past float16's range (+-65504) that the cast turned into inf. Gemma's residual stream
    reaches such values (benchmarks/shard_compression.py); nothing of it may be stored."""
    overflowed = [key for key, values in activations.items()  # the scores' -inf is a masked key's
                  if key_parts(key)[0] != ATTN_SCORES and np.isinf(values).any()]
    if overflowed:
        raise UserError(f"--activation_dtype float16: {describe_key(overflowed[0])} holds values past float16's range "
                        f"(+-65504), which would be stored as inf; store this model's activations as bfloat16 "
                        f"(float32's range, the same bytes) or float32")


def placed(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``host`` as a global array: each device receives its slice, and a process only ever
    touches the slices of its own devices (on a multi-host slice every process holds the same
    ``host`` batch, and feeds its rows)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def local_blocks(out: jax.Array) -> list[tuple[slice, jax.Array]]:
    """The rows of ``out`` [L, B, ...] (sharded over B) that this process stores: (row slice,
    device data), each slice once. A ``model`` axis holds copies of the same rows; where it spans
    processes, only the process holding a row's first copy (replica 0) stores it."""
    blocks: dict[tuple[int, int], tuple[slice, jax.Array]] = {}
    for shard in out.addressable_shards:
        if shard.replica_id:
            continue
        rows = shard.index[1]
        blocks.setdefault(rows.indices(out.shape[1])[:2], (rows, shard.data))
    return [blocks[key] for key in sorted(blocks)]


@dataclasses.dataclass
class InFlight:
    """A dispatched batch whose activations are still on the devices."""
    # output key (width_groups) -> [its layers, rows, length (or the selection's K), width]; stored as
    # float8, (those rows, their scales [its layers, rows, length or K])
    out: dict[str, jax.Array | tuple[jax.Array, jax.Array]]
    lengths: np.ndarray     # [rows]: the rows each sequence keeps (its tokens, or its selected rows)
    count: int              # real sequences (the first rows)
    tokens: np.ndarray | None = None  # [rows]: each sequence's tokens (a pattern row's keys)
    statistics: dict[str, dict[str, jax.Array]] | None = None  # output key -> model.statistics.row_statistics


def selection_width(counts: Sequence[int], length: int) -> int:
    """K of a batch's selection: the next power of two over its largest count (at least 1, at most
    the bucket's length), so that a few shapes compile per bucket."""
    return min(length, 1 << max(0, max(counts, default=1) - 1).bit_length())


@dataclasses.dataclass
class Extractor:
    """A loaded model ready to extract; build it with ``Extractor.load``."""
    config: DecoderConfig
    params: dict
    mesh: Mesh
    layers: tuple[int, ...]
    dtype: Any
    batch_size: int               # global: per-device batch size x data axis
    buckets: tuple[int, ...]
    activation_dtype: Any = None  # dtype of the returned arrays (default: the residual dtype)
    attention: str = "auto"       # auto | tiled | fused (model.attention.attention_for)
    batches_in_flight: int = 2    # dispatched and not yet copied back (1: synchronous)
    ablation: dict[str, np.ndarray] | None = None  # an intervention's arrays (model.interventions)
    residual_dtype: Any = None    # resolve_residual_dtype: float32, or None for the compute dtype
    sites: tuple[str, ...] = DEFAULT_SITES  # model.sites, in block order
    moe_dispatch: str = "auto"    # a mixture of experts' (model.config.MOE_DISPATCHES)
    pool: str | None = None       # with a selection: mean pools each sequence's selected rows
    steer_tokens: str | None = None  # the ablation's steerings add to these tokens only (extract's items say which)
    statistics: StatisticsSpec | None = None  # per-sample statistics measured on the device (model.statistics)
    logits_top_k: int | None = None  # the top k of the logits stored (model.sites.TOP_K)
    host_memory: str = "auto"     # what activations are copied into: pinned | pageable | auto (host_memory_kind)
    observer: ForwardObserver = dataclasses.field(default_factory=ForwardObserver)
    _executables: dict[tuple[int, int, int | None], Any] = dataclasses.field(default_factory=dict, init=False,
                                                                             repr=False)

    @classmethod
    def load(cls, model_path: str, layers: Sequence[int] | None = None, mesh_type: str = "1d",
             dtype: str = "auto", batch_size_per_device: int = 1, max_seq_length: int = 2048,
             model_axis_size: int | None = None, min_bucket: int = 32,
             devices: list | None = None, activation_dtype: str | None = None,
             attention: str = "auto", batches_in_flight: int = 2, ablation: AblationSource | None = None,
             residual_dtype: str = "float32",
             sites: Sequence[str] = DEFAULT_SITES, revision: str | None = None,
             moe_dispatch: str = "auto", pool: str | None = None, whole_model: bool = False,
             statistics: StatisticsSpec | None = None, logits_top_k: int | None = None) -> "Extractor":
        """Loads only the blocks the requested sites and layers need (``whole_model``: every block
        and the head, for ``model.generate`` on the same weights), straight onto the mesh.
        ``ablation``: the intervention to extract under (``AblationSource``).
        ``residual_dtype``: float32 | compute (``resolve_residual_dtype``). ``sites``: names
        from ``model.sites`` (each stored at every layer). ``revision``: of a hub id. ``pool``:
        ``mean`` pools each selection (``extract``'s positions) into one row. ``statistics``: what
        the forward measures of the stored rows (``extract_measured``). ``logits_top_k``: store the
        logits' top k too (``model.sites.TOP_K``)."""
        sites = with_top_k(parse_sites(sites), logits_top_k)
        check_pool(pool, sites)
        check_quantized(activation_dtype, sites)
        resolve_residual_dtype(residual_dtype)  # a bad name fails before the model loads
        model_dir = resolve_model_dir(model_path, revision)
        config = load_config(model_dir)
        layers = validate_layers(range(config.num_hidden_layers) if layers is None else layers, config)
        # A kernel the model cannot use fails before it loads.
        attention_for(None, attention, config, resolve_dtype(dtype))
        check_model_fits(config, sites, max_seq_length, layers)
        # Generating (whole_model), an intervention acts on every block; the extraction's forward
        # takes the blocks it computes.
        computed = blocks_needed(sites, layers, config.num_hidden_layers)
        arrays, steer_tokens = ablation(config, config.num_hidden_layers if whole_model else computed) if ablation \
            else (None, None)
        arrays = arrays and {name: array[:computed] for name, array in arrays.items()}
        loaded = load_model(model_dir, resolve_dtype(dtype), mesh_type, model_axis_size,
                            num_layers=None if whole_model else computed,
                            with_head=whole_model or any(site in AFTER_BLOCKS for site in sites), devices=devices)
        extractor = cls.from_loaded(loaded, layers, batch_size_per_device, max_seq_length, min_bucket,
                                    activation_dtype, attention, batches_in_flight, residual_dtype, sites,
                                    moe_dispatch, pool, statistics, logits_top_k)
        extractor.ablation = arrays
        extractor.steer_tokens = steer_tokens
        return extractor

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, layers: Sequence[int], batch_size_per_device: int = 1,
                    max_seq_length: int = 2048, min_bucket: int = 32,
                    activation_dtype: str | None = None, attention: str = "auto",
                    batches_in_flight: int = 2, residual_dtype: str = "float32",
                    sites: Sequence[str] = DEFAULT_SITES, moe_dispatch: str = "auto",
                    pool: str | None = None, statistics: StatisticsSpec | None = None,
                    logits_top_k: int | None = None) -> "Extractor":
        sites = with_top_k(parse_sites(sites), logits_top_k)
        check_pool(pool, sites)
        if activation_dtype is not None and activation_dtype not in ACTIVATION_DTYPES:
            raise UserError(f"unknown activation dtype {activation_dtype!r} "
                            f"(choose from {', '.join(ACTIVATION_DTYPES)})")
        check_quantized(activation_dtype, sites)
        attention_for(loaded.mesh, attention, loaded.config, loaded.dtype)
        check_model_fits(loaded.config, sites, max_seq_length, layers)
        return cls(loaded.config, loaded.params, loaded.mesh, validate_layers(layers, loaded.config),
                   loaded.dtype, batch_size_per_device * loaded.mesh.shape["data"],
                   bucket_lengths(max_seq_length, min(min_bucket, max_seq_length)),
                   ACTIVATION_DTYPES.get(activation_dtype), attention, batches_in_flight,
                   residual_dtype=resolve_residual_dtype(residual_dtype), sites=sites,
                   moe_dispatch=moe_dispatch, pool=pool,
                   # A mixture's expert ids are counted per expert of this model.
                   statistics=measured_statistics(statistics, loaded.config), logits_top_k=logits_top_k)

    @property
    def keys(self) -> list[ArrayKey]:
        """The keys of each sequence's arrays, in storage order (``model.sites.array_keys``)."""
        return array_keys(self.sites, self.layers)

    @property
    def residual_dtype_name(self) -> str:
        """The dtype the residual stream is kept in (``float32``, ``bfloat16``)."""
        return residual_dtype_name(self.dtype, self.residual_dtype)

    @property
    def moe_dispatch_kind(self) -> str | None:
        """The dispatch ``moe_dispatch`` resolves to (dense | grouped; None for a dense model)."""
        from model.moe import dispatch_for
        return dispatch_for(self.config, self.moe_dispatch) if self.config.moe is not None else None

    @property
    def attention_kind(self) -> str:
        """The attention kernel ``attention`` resolves to on this mesh (tiled | fused)."""
        return attention_for(self.mesh, self.attention, self.config, self.dtype)

    @functools.cached_property
    def _forward(self):
        return make_sites_forward(self.config, self.dtype, self.layers, self.sites, self.mesh,
                                  self.activation_dtype, self.attention, self.residual_dtype, self.moe_dispatch,
                                  self.pool, self.statistics, self.logits_top_k)

    def _extra_args(self, select: Any, row_roles: Any) -> tuple:
        """The forward's arguments after the ablation: a selection (None for none) where there is
        one or where role codes follow it, the stored rows' role codes where grouped by role."""
        if self.statistics is not None and self.statistics.by_role:
            return select, row_roles
        return () if select is None else (select,)

    def executable(self, rows: int, length: int, selected: int | None = None):
        """The forward compiled for inputs [rows, length] (compiled on first use); with
        ``selected``, for a selection of that many positions a row (``selection_width``)."""
        key = (rows, length, selected)
        if key not in self._executables:
            sharding = batch_sharding(self.mesh)
            ids = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=sharding)
            lengths = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sharding)
            select = None if selected is None else (jax.ShapeDtypeStruct((rows, selected), jnp.int32,
                                                                         sharding=sharding), lengths)
            row_roles = jax.ShapeDtypeStruct((rows, length if selected is None else selected), jnp.int32,
                                             sharding=sharding)  # [B, S or K]
            ablation = self.ablation
            if self.steer_tokens:
                mask = jax.ShapeDtypeStruct((rows, length), jnp.bool_, sharding=sharding)  # [B, S]
                ablation = {**ablation, STEER_TOKENS: mask}
            with self.observer.compiling(rows, length):
                self._executables[key] = self._forward.lower(self.params, ids, lengths, ablation,
                                                             *self._extra_args(select, row_roles)).compile()
        return self._executables[key]

    def padded(self, sequences: Sequence[Sequence[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
        """input_ids [rows, length] and lengths [rows] of a batch: each sequence padded to
        ``length``, rows padded (``padded_rows``) with empty ones."""
        rows = padded_rows(len(sequences), self.batch_size, self.mesh.shape["data"])
        ids = np.zeros((rows, length), np.int32)  # [B, S]; padding rows stay 0
        lengths = np.zeros((rows,), np.int32)
        for row, seq in enumerate(sequences):
            ids[row, :len(seq)] = seq
            lengths[row] = len(seq)
        return ids, lengths

    def selection_arrays(self, selected: Sequence[np.ndarray], rows: int, length: int
                         ) -> tuple[np.ndarray, np.ndarray]:
        """positions [rows, K] (each row's selected positions, then zeros) and counts [rows] of a
        batch's selections (``selected``: per sequence, the positions it keeps)."""
        counts = np.zeros((rows,), np.int32)
        counts[:len(selected)] = [len(p) for p in selected]
        positions = np.zeros((rows, selection_width(counts.tolist(), length)), np.int32)  # [B, K]
        for row, kept in enumerate(selected):
            positions[row, :len(kept)] = kept
        return positions, counts

    def dispatch(self, sequences: Sequence[Sequence[int]], length: int,
                 selected: Sequence[np.ndarray] | None = None,
                 steered: Sequence[np.ndarray] | None = None,
                 roles: Sequence[np.ndarray] | None = None) -> InFlight:
        """Places up to ``batch_size`` sequences, padded to ``length``, on the devices and starts
        their forward, without waiting for it. ``selected``: per sequence, the positions of the
        rows to keep (only those come back; with ``pool``, their mean). ``steered``: per
        sequence, the positions its steering adds to (with ``steer_tokens``). ``roles``: per
        sequence, its tokens' role codes (with ``statistics`` grouped by role)."""
        ids, lengths = self.padded(sequences, length)
        rows = ids.shape[0]
        sharding = batch_sharding(self.mesh)
        select, kept, row_roles = None, lengths, None
        if selected is not None:
            positions, counts = self.selection_arrays(selected, rows, length)
            select = (placed(positions, sharding), placed(counts, sharding))
            kept = np.minimum(counts, 1) if self.pool else counts
        if self.statistics is not None and self.statistics.by_role:
            if roles is None:
                raise ValueError("statistics by role: each sequence's role codes are needed")
            codes = np.zeros((rows, length if selected is None else positions.shape[1]), np.int32)  # [B, S or K]
            for row, token_roles in enumerate(roles):
                stored = token_roles if selected is None else token_roles[selected[row]]
                codes[row, :len(stored)] = stored
            row_roles = placed(codes, sharding)
        ablation = self.ablation
        if self.steer_tokens:
            if steered is None:
                raise ValueError(f"the intervention steers tokens={self.steer_tokens}: each sequence's are needed")
            ablation = {**ablation, STEER_TOKENS: placed(steered_token_mask(steered, rows, length), sharding)}
        forward = self.executable(rows, length, None if selected is None else positions.shape[1])
        with self.observer.batch(rows, length):
            out = forward(self.params, placed(ids, sharding), placed(lengths, sharding), ablation,
                          *self._extra_args(select, row_roles))
        out, measured = out if self.statistics is not None else (out, None)
        copied = (out, measured)
        if self.host_memory_kind == PINNED:
            # Enqueued behind the forward: the device writes straight into page-locked host memory,
            # which numpy then reads in place (a copy_to_host_async would copy it once more).
            out = jax.tree.map(lambda array: jax.device_put(array, array.sharding.with_memory_kind(PINNED)), out)
            copied = measured
        for array in jax.tree_util.tree_leaves(copied):
            for _, data in local_blocks(array):
                data.copy_to_host_async()  # starts the transfer as soon as the forward ends
        return InFlight(out, kept, len(sequences), lengths, measured)

    @functools.cached_property
    def host_memory_kind(self) -> str | None:
        """``pinned_host`` where the activations are copied into page-locked host memory, else None
        (numpy's own, pageable). ``auto`` pins on GPUs: a copy into pageable memory goes through the
        driver's staging buffer and first touches every page, 1.8 GB/s on an H200 host against 53
        GB/s pinned and read in place (``benchmarks/accelerator.py --host_copy_gb 1``), less than a
        7B forward's four float32 layers (2.5 GB/s). The arrays read back are the same either way.
        Pinned, the activations the store path holds (``--store_memory_gb``) live in XLA's pool of
        page-locked memory, which reuses what is freed and stops at 64 GiB by default
        (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``)."""
        if self.host_memory not in HOST_MEMORIES:
            raise ValueError(f"host_memory must be one of {', '.join(HOST_MEMORIES)}, got {self.host_memory!r}")
        device = self.mesh.devices.flat[0]
        pinned = self.host_memory == "pinned" or (self.host_memory == "auto" and device.platform == "gpu")
        if pinned and PINNED not in {memory.kind for memory in device.addressable_memories()}:
            if self.host_memory == "pinned":
                raise ValueError(f"{device.platform} devices have no {PINNED} memory")
            pinned = False
        return PINNED if pinned else None

    @functools.cached_property
    def _output_groups(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The forward's output keys -> (their site, the layers stacked in them): ``width_groups``."""
        return {key: (site, group) for site in self.sites
                for key, group in width_groups(self.config, site, self.layers, self.logits_top_k).items()}

    def collect(self, batch: InFlight) -> list[tuple[dict[ArrayKey, np.ndarray], dict | None, dict | None] | None]:
        """Waits for a dispatched batch and copies this process's rows back to the host: per
        sequence, ``{key: array [num_tokens, width]}`` (``keys``) with padding removed; with
        ``statistics`` ``{key: KeyStatistics}`` of each array, else None; stored as float8,
        ``{key: scale [num_tokens]}`` (``model.quantize``), else None (``None`` for a sequence
        whose row lives on another process's devices)."""
        results: list[dict[ArrayKey, np.ndarray] | None] = [None] * batch.count
        scales: list[dict[ArrayKey, np.ndarray] | None] = [None] * batch.count
        keys = self.keys
        measured = self._collected_statistics(batch)
        for key, out in batch.out.items():
            site, group = self._output_groups[key]
            out, scale = out if isinstance(out, tuple) else (out, None)
            scale_blocks = None if scale is None else local_blocks(scale)  # the same rows as out's
            for b, (rows, data) in enumerate(local_blocks(out)):
                data.block_until_ready()  # the forward's time, not the copy's
                with self.observer.host_side("device_to_host"):
                    acts = np.asarray(data)  # [len(group), rows here, S, width]
                    if scale is not None:  # both outputs are sharded alike: the same rows, block by block
                        assert scale_blocks[b][0] == rows, (scale_blocks[b][0], rows)
                    row_scales = None if scale is None else np.asarray(scale_blocks[b][1])  # [len(group), rows here, S]
                with self.observer.host_side("split"):
                    for i, row in enumerate(range(*rows.indices(out.shape[1]))):
                        if row < batch.count:  # views of ``acts``: each [num_tokens, width], contiguous
                            n = batch.lengths[row]
                            # Keyed in storage order from the start, whichever site comes first.
                            arrays = results[row] = results[row] or dict.fromkeys(keys)
                            arrays.update({array_key(site, layer): self._unpadded(site, acts[j, i, :n],
                                                                                  batch.tokens[row])
                                           for j, layer in enumerate(group)})
                            if row_scales is not None:
                                kept = scales[row] = scales[row] or {}
                                kept.update({array_key(site, layer): row_scales[j, i, :n]
                                             for j, layer in enumerate(group)})
        if self.activation_dtype == jnp.float16:
            for arrays in results:
                if arrays is not None:
                    check_float16_range(arrays)
        self.observer.computed(batch.count)
        return [None if arrays is None else (arrays, measured and measured[row], scales[row])
                for row, arrays in enumerate(results)]

    def _unpadded(self, site: str, rows: np.ndarray, tokens: int) -> np.ndarray:
        """A sequence's stored ``rows`` [n, width] of ``site``; a pattern's [n, heads * bucket]
        narrowed to its own ``tokens`` keys: [n, heads * tokens]."""
        if site not in PATTERNS:
            return rows
        heads = self.config.num_attention_heads
        return rows.reshape(len(rows), heads, -1)[:, :, :tokens].reshape(len(rows), heads * tokens)

    def _collected_statistics(self, batch: InFlight) -> list[dict[ArrayKey, KeyStatistics]] | None:
        """Per sequence of ``batch`` (this process's rows), ``{key: KeyStatistics}``: the small
        arrays the forward measured, copied back."""
        if batch.statistics is None:
            return None
        out: list[dict[ArrayKey, KeyStatistics]] = [{} for _ in range(batch.count)]
        for key, fields in batch.statistics.items():
            site, group = self._output_groups[key]
            # Every field's blocks hold the same rows: [len(group), rows here, G, ...] each.
            blocks = {name: local_blocks(fields[name]) for name in STAT_FIELDS if name in fields}
            with self.observer.host_side("device_to_host"):
                host = {name: [(rows, np.asarray(data)) for rows, data in parts] for name, parts in blocks.items()}
            for k, (rows, _) in enumerate(host["count"]):
                part = {name: parts[k][1] for name, parts in host.items()}
                for i, row in enumerate(range(*rows.indices(fields["count"].shape[1]))):
                    if row < batch.count:
                        out[row].update({array_key(site, layer): split_statistics(part, j, i)
                                         for j, layer in enumerate(group)})
        return out

    def extract(self, items: Iterable[tuple]) -> Iterator[tuple[T, dict[ArrayKey, np.ndarray]]]:
        """(key, input_ids) pairs -> (key, {array key: [num_tokens, width]}), batched by length bucket.
        Items (key, input_ids, positions) keep only the rows at ``positions`` ([selected, width]),
        or with ``pool`` their mean ([1, width], or [0, width] where none is selected); None keeps
        every row. A fourth element, with ``steer_tokens``: the positions the steering adds to
        (None without); a fifth, with ``statistics`` by role: the tokens' role codes.

        Results come out in batch order (grouped by bucket), not input order. A sequence longer
        than ``max_seq_length`` raises ``ValueError``. Up to ``batches_in_flight`` batches are
        dispatched before the oldest is copied back. Rows stored as float8 come back dequantized
        (float32, ``model.quantize.dequantize``); ``extract_measured`` gives them as stored.
        """
        for key, arrays, _, scales in self.extract_measured(items):
            yield key, arrays if not scales else {k: dequantize(a, scales[k]) for k, a in arrays.items()}

    def extract_measured(self, items: Iterable[tuple]) -> Iterator[tuple[T, dict | None, dict | None, dict | None]]:
        """``extract``'s results as stored, with each sequence's statistics, ``{key: KeyStatistics}``
        (``model.statistics``; None without ``statistics``), and its rows' scales where stored as
        float8 (``{key: [rows] float32}``, else None): (key, arrays, statistics, scales)."""
        in_flight: collections.deque[tuple[list[T], InFlight]] = collections.deque()
        for batch in self.batches(items):
            first = batch.items[0]
            selected = [item[2] for item in batch.items] if len(first) > 2 and first[2] is not None else None
            steered = [item[3] for item in batch.items] if len(first) > 3 and first[3] is not None else None
            roles = [item[4] for item in batch.items] if len(first) > 4 else None
            in_flight.append(([item[0] for item in batch.items],
                              self.dispatch([item[1] for item in batch.items], batch.length, selected, steered,
                                            roles)))
            if len(in_flight) >= self.batches_in_flight:
                yield from self._collected(*in_flight.popleft())
        while in_flight:
            yield from self._collected(*in_flight.popleft())

    def batches(self, items: Iterable[tuple[T, Sequence[int]]]) -> Iterator[Batch]:
        """The batches ``extract`` computes, in order: each full one as soon as it fills, then the
        partial ones (``dispatch`` pads their rows, see ``padded_rows``)."""
        bucketer: Bucketer[tuple] = Bucketer(self.buckets, self.batch_size)
        for item in items:
            yield from bucketer.add(item, len(item[1]))
        yield from bucketer.flush()

    def _collected(self, keys: list[T], batch: InFlight) -> Iterator[tuple[T, dict | None, dict | None, dict | None]]:
        for key, result in zip(keys, self.collect(batch)):
            yield (key, None, None, None) if result is None else (key, *result)
