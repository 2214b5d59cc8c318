"""The mixture-of-experts MLP: the router, its top-k, and the dispatch of tokens to the experts.

A block whose config has ``moe`` (``model.config.MoE``) replaces its MLP by

    logits  = x @ router                        # [T, E], no bias, in the compute dtype
    probs   = softmax(float32(logits))          # over all experts (a removed expert's logit: -inf)
    w, idx  = top_k(probs, k)                   # [T, k]; w / sum(w) where normalize_top_k
    out     = sum_j w_j * expert_{idx_j}(x)     # each expert a gated MLP of expert_size
                                                # (Llama 4's: sum_j expert_{idx_j}(w_j * x))
            + sigmoid(x @ shared_gate) * shared_expert(x)   # Qwen2-MoE only

as transformers computes it for Mixtral, OLMoE, Qwen2-MoE and Qwen3-MoE (gpt-oss's router has a
bias and softmaxes its top k logits instead, ``route_top_k_first``; its experts have biases and the
clamped SwiGLU, ``gated_unit``; Gemma 4's router normalises its input and scales each expert's
weight; DeepSeek's computes in float32, chooses by sigmoid (or softmax) scores plus a selection bias
within its best groups and scales the chosen scores, ``route_grouped``, and its shared experts are
added ungated; ``model.config.MoE``'s switches) (w rounded to the
compute dtype before it scales an expert's output, except Mixtral's, kept in float32; the k
products are summed in the wider of the two dtypes and rounded once, where transformers rounds
each and adds them in the compute dtype: the same in float32, a bfloat16 step apart at most with
``--residual_dtype compute``).

Two dispatches compute ``sum_j w_j * expert_{idx_j}(x)``, both exact (no capacity, no token
dropped) and of static shapes (equal to float32 rounding; in pure bfloat16 the dense one sums the
k products in one einsum, the grouped one adds them one by one, a bfloat16 step apart):
  * ``dense``: every expert on every token, combined by a [T, E] matrix of the routing weights
    (zero for the experts not chosen). E / k times the FLOPs of the routed experts alone, but
    plain batched matmuls: the cheaper one where E / k is small (``DENSE_MAX_RATIO``).
  * ``grouped``: the T * k (token, expert) pairs sorted by expert, each expert's rows multiplied
    by its weights only (a grouped matmul), the results scattered back to their tokens. On TPU
    and GPU the grouped matmul is ``jax.lax.ragged_dot`` (a grouped-matmul kernel); on CPU, whose
    ``ragged_dot`` computes every group for every row, it is a loop over tiles of rows (``tile_rows``),
    each expert's rows padded to whole tiles: the FLOPs of the routed experts plus at most
    E * (tile - 1) padding rows. The grouped dispatch takes a batch's tokens at once (its tiles
    keep the intermediates in cache); the dense one is chunked like the MLP (``model.decoder``).
Over a mesh the experts are split over the ``model`` axis where it divides their number (their
stacked weights [E, ...] are sharded on E, ``model.sharding``): each device computes, for the
tokens of its ``data`` shard, the pairs routed to its own experts (``shard_map``), and the partial
outputs are summed over ``model``. The router is computed before, replicated over ``model``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from model.config import MOE_DISPATCHES, DecoderConfig
from model.layers import ACTIVATIONS, MLP, accumulation, dense, precision_for, rms_normalized
from model.sites import EXPERT_INDICES, ROUTER_LOGITS, ROUTING_WEIGHTS, SHARED_EXPERT_GATE, SHARED_EXPERT_OUT

DENSE_MAX_RATIO = 2   # auto: dense where E / k is at most this (benchmarks/extraction_throughput.py)
MAX_TILE = 128        # rows per tile of the CPU grouped matmul, at most (see tile_rows)


# DeepSeek's routers' scores from float32 logits [..., E] (``MoE.scoring``).
SCORES = {"softmax": lambda logits: jax.nn.softmax(logits, axis=-1), "sigmoid": jax.nn.sigmoid,
          "sqrtsoftplus": lambda logits: jnp.sqrt(jax.nn.softplus(logits))}


def dispatch_for(config: DecoderConfig, dispatch: str = "auto") -> str:
    """The dispatch ``auto`` stands for on this model (see the module docstring)."""
    if dispatch not in MOE_DISPATCHES:
        raise ValueError(f"unknown dispatch {dispatch!r} (choose from {', '.join(MOE_DISPATCHES)})")
    if dispatch != "auto":
        return dispatch
    moe = config.moe
    return "dense" if moe.num_experts <= DENSE_MAX_RATIO * moe.top_k else "grouped"


def route(logits: jax.Array, config: DecoderConfig, dtype, keep: jax.Array | None = None,
          expert_scale: jax.Array | None = None):
    """The router's choice from its logits [..., E]: (indices [..., k] int32, weights [..., k]).

    ``keep`` [E] (an expert ablation): the experts removed have their logit set to -inf before
    the softmax, so the others' probabilities renormalise as the family's router would without
    them. ``expert_scale`` [E]: each chosen expert's weight times its own (Gemma 4). Weights are
    float32 for Mixtral and Gemma 4 (``weights_in_float32``), else rounded to ``dtype``."""
    moe = config.moe
    logits = logits.astype(jnp.float32)
    if keep is not None:
        logits = jnp.where(keep, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)  # [..., E] float32
    weights, indices = jax.lax.top_k(probs, moe.top_k)  # [..., k]
    if moe.normalize_top_k:
        weights = weights / weights.sum(-1, keepdims=True)
    if expert_scale is not None:
        weights = weights * expert_scale.astype(jnp.float32)[indices]
    return indices.astype(jnp.int32), weights if moe.weights_in_float32 else weights.astype(dtype)


def route_top_k_first(logits: jax.Array, config: DecoderConfig, dtype, keep: jax.Array | None = None):
    """gpt-oss's router: the k largest logits [..., E] chosen first, their softmax the weights
    (Llama 4's: each one's sigmoid) (indices [..., k] int32, weights [..., k] rounded to ``dtype``);
    ``keep`` as ``route``'s."""
    logits = logits.astype(jnp.float32)
    if keep is not None:
        logits = jnp.where(keep, logits, -jnp.inf)
    top, indices = jax.lax.top_k(logits, config.moe.top_k)  # [..., k]
    weights = jax.nn.sigmoid(top) if config.moe.scoring == "sigmoid" else jax.nn.softmax(top, axis=-1)
    return indices.astype(jnp.int32), weights if config.moe.weights_in_float32 else weights.astype(dtype)


def route_grouped(logits: jax.Array, config: DecoderConfig, keep: jax.Array | None = None,
                  selection_bias: jax.Array | None = None, chosen: jax.Array | None = None):
    """DeepSeek's routers (V3's, GLM-4.5's: sigmoid scores; V2's: softmax; V4's: sqrt(softplus)) from
    float32 logits [..., E]: the scores plus ``selection_bias`` [E] (V3's ``e_score_correction_bias``)
    choose the experts, within the ``top_groups`` groups of best group score (or ``chosen`` [..., k]
    are the experts: V4's hash router), and the chosen scores themselves (renormalised where
    ``normalize_top_k``) times ``routed_scaling`` are the weights (indices [..., k] int32, weights
    [..., k] float32). ``keep`` [E]: a removed expert's logit is -inf (a softmax renormalises without
    it, its score is 0) and the router never chooses it."""
    moe = config.moe
    logits = logits.astype(jnp.float32)
    if keep is not None:
        logits = jnp.where(keep, logits, -jnp.inf)
    scores = SCORES[moe.scoring](logits)  # [..., E]
    if chosen is not None:
        return _weighted(scores, chosen.astype(jnp.int32), moe)
    choice = scores if selection_bias is None else scores + selection_bias.astype(jnp.float32)
    if keep is not None:
        choice = jnp.where(keep, choice, -jnp.inf)
    if moe.groups > 1:
        grouped = choice.reshape(*choice.shape[:-1], moe.groups, -1)  # [..., G, E/G]
        best = jax.lax.top_k(grouped, 2)[0].sum(-1) if moe.group_score == "top2" else grouped.max(-1)  # [..., G]
        chosen_groups = jax.lax.top_k(best, moe.top_groups)[1]  # [..., g]
        allowed = (chosen_groups[..., None] == jnp.arange(moe.groups)).any(-2)  # [..., G]
        choice = jnp.where(allowed[..., None], grouped, -jnp.inf).reshape(choice.shape)
    return _weighted(scores, jax.lax.top_k(choice, moe.top_k)[1].astype(jnp.int32), moe)


def _weighted(scores: jax.Array, indices: jax.Array, moe) -> tuple[jax.Array, jax.Array]:
    """(indices, their scores renormalised where ``normalize_top_k``, times ``routed_scaling``)."""
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if moe.normalize_top_k:
        weights = weights / (weights.sum(-1, keepdims=True) + moe.normalize_epsilon)
    return indices, weights * moe.routed_scaling


def forced(indices: jax.Array, weights: jax.Array, expert: jax.Array):
    """The routing with every token sent to ``expert`` alone (weight 1), where ``expert`` >= 0."""
    on = expert >= 0
    first = jnp.arange(indices.shape[-1]) == 0  # [k]: slot 0 takes the whole weight
    return (jnp.where(on, jnp.broadcast_to(expert, indices.shape), indices),
            jnp.where(on, jnp.where(first, 1, 0).astype(weights.dtype), weights))


class HiddenUnit(NamedTuple):
    """The experts' hidden activation of their input projections' outputs: ``join(gate, up)``
    over two (a gated MLP's), or ``join(up)`` over one (a plain MLP's: Nemotron-H's experts)."""
    inputs: int
    join: Callable


def gated_unit(config: DecoderConfig, act) -> HiddenUnit:
    """The experts' hidden activation (``DecoderConfig.gated_mlp``, as the dense MLP's): act(gate) *
    up, or a clamped SwiGLU (gate at most the limit, up within it; then gpt-oss's (up + 1) * gate *
    sigmoid(alpha * gate), or act(gate) * up without alpha); act(up) for plain experts."""
    moe = config.moe
    if not config.gated_mlp:
        return HiddenUnit(1, act)
    if moe.swiglu_limit is None:
        return HiddenUnit(2, lambda gate, up: act(gate) * up)
    limit, alpha = moe.swiglu_limit, moe.swiglu_alpha

    def clamped(gate, up):
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        if alpha is None:  # GLM-5-next's: the plain gated unit of the clamped inputs
            return act(gate) * up
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))
    return HiddenUnit(2, clamped)


def split_experts(experts: tuple, unit: HiddenUnit) -> tuple[tuple, jax.Array, tuple, tuple]:
    """The experts' stacked weights (``Experts``) as (input projections, down, their biases, down's
    bias): one or two inputs by ``unit``; biases () where the experts have none."""
    n = unit.inputs
    inputs, down, biases = experts[:n], experts[n], experts[n + 1:]
    return inputs, down, biases[:n], biases[n:]


def expert_mlp(x: jax.Array, inputs: tuple, down: jax.Array, unit: HiddenUnit, precision, accumulate,
               biases: tuple = (), down_bias: tuple = ()) -> jax.Array:
    """The MLP of one expert's weights (``inputs``: gate and up, or up alone, [H, F] each; down
    [F, H]; ``biases`` none or theirs [F] each, ``down_bias`` none or (its [H],)) on rows x [R, H]
    -> [R, H]; ``unit`` (``gated_unit``) joins the inputs."""
    dot = lambda a, b: jnp.matmul(a, b, precision=precision, preferred_element_type=accumulate)
    projected = [dot(x, w) for w in inputs]  # [R, F] each
    if biases:
        projected = [p + b for p, b in zip(projected, biases)]
    out = dot(unit.join(*projected).astype(x.dtype), down)
    return out + down_bias[0] if down_bias else out


def dense_dispatch(x, indices, weights, experts, first: int, unit: HiddenUnit, precision, accumulate,
                   input_scaled: bool = False) -> jax.Array:
    """Every local expert (``experts``: gate and up, or up alone, [E', H, F], down [E', F, H], and
    where they have them their biases [E', F] each and [E', H]; global ids from ``first``) on every
    token x [T, H], combined by the routing weights -> [T, H]; ``input_scaled``: each expert on x
    times its weight (zero where it was not chosen), the outputs summed (Llama 4's)."""
    inputs, down, biases, down_bias = split_experts(experts, unit)
    local = jnp.arange(down.shape[0]) + first  # [E']
    combine = jnp.sum(jnp.where(indices[..., None] == local, weights[..., None], 0), axis=1)  # [T, E']
    dot = lambda spec, a, b: jnp.einsum(spec, a, b, precision=precision, preferred_element_type=accumulate)
    if input_scaled:
        scaled = (x[:, None, :] * combine[..., None]).astype(x.dtype)  # [T, E', H]
        projected = [dot("teh,ehf->tef", scaled, w) for w in inputs]  # [T, E', F] each
        return dot("tef,efh->teh", unit.join(*projected).astype(x.dtype), down).sum(axis=1).astype(x.dtype)
    projected = [dot("th,ehf->tef", x, w) for w in inputs]  # [T, E', F] each
    if biases:
        projected = [p + b[None] for p, b in zip(projected, biases)]
    out = dot("tef,efh->teh", unit.join(*projected).astype(x.dtype), down)  # [T, E', H]
    if down_bias:
        out = out + down_bias[0][None]
    wide = jnp.promote_types(out.dtype, weights.dtype)  # Mixtral's float32 weights scale in float32
    return jnp.einsum("te,teh->th", combine.astype(wide), out.astype(wide), precision=precision).astype(out.dtype)


def grouped_dispatch(x, indices, weights, experts, first: int, unit: HiddenUnit, precision, accumulate,
                     ragged: bool, input_scaled: bool = False) -> jax.Array:
    """The (token, expert) pairs of x [T, H] routed to the local experts (global ids from
    ``first``), sorted by expert and computed by a grouped matmul -> [T, H]; ``input_scaled``: each
    pair's row times its weight before the expert, not its output after."""
    inputs, down, biases, down_bias = split_experts(experts, unit)
    count, (t, k) = down.shape[0], indices.shape
    expert = indices.reshape(-1) - first  # [T*k]
    expert = jnp.where((expert >= 0) & (expert < count), expert, count)  # elsewhere: a last, dropped group
    order = jnp.argsort(expert, stable=True)  # [T*k]
    token = order // k
    sizes = jnp.bincount(expert, length=count + 1)[:count]  # [E'] rows per local expert
    rows = x[token]  # [T*k, H] sorted by expert
    local = (expert[order] < count)[:, None]  # [T*k, 1]: rows of the local experts
    if input_scaled:
        rows = (rows * weights.reshape(-1)[order][:, None]).astype(x.dtype)
    if ragged:
        dot = lambda a, b: jax.lax.ragged_dot(a, b, sizes, precision=precision, preferred_element_type=accumulate)
        row_bias = lambda b: b[jnp.minimum(expert[order], count - 1)]  # [T*k, ...]: each row's expert's
        projected = [dot(rows, w) for w in inputs]  # [T*k, F] each
        if biases:
            projected = [p + row_bias(b) for p, b in zip(projected, biases)]
        out = dot(unit.join(*projected).astype(x.dtype), down)  # [T*k, H]
        if down_bias:
            out = out + row_bias(down_bias[0])
        # The dropped group's rows are none of ragged_dot's groups: whatever it leaves there goes.
        out = jnp.where(local, out, 0)
    else:
        out = tiled_grouped_mlp(rows, sizes, experts, unit, precision, accumulate)
    wide = jnp.promote_types(out.dtype, weights.dtype)  # Mixtral's float32 weights scale in float32
    scale = jnp.where(local[:, 0], 1 if input_scaled else weights.reshape(-1)[order], 0).astype(wide)  # [T*k]
    return jnp.zeros((t, out.shape[-1]), wide).at[token].add(out.astype(wide) * scale[:, None]).astype(out.dtype)


def tile_rows(rows: int, experts: int) -> int:
    """Rows per tile: a power of two near half an expert's mean share of the rows (so padding
    stays under a third of them on a balanced routing), from 8 to ``MAX_TILE``."""
    tile = 8
    while tile * 2 <= min(MAX_TILE, rows // (2 * experts)):
        tile *= 2
    return tile


def tiled_grouped_mlp(rows, sizes, experts, unit: HiddenUnit, precision, accumulate) -> jax.Array:
    """The grouped MLP of rows [R, H] sorted by expert (``sizes`` [E'] rows each, the rest not
    computed: 0), as a loop over tiles (``tile_rows``), each expert's rows padded to whole tiles."""
    inputs, down, biases, down_bias = split_experts(experts, unit)
    r, count = rows.shape[0], sizes.shape[0]
    tile = tile_rows(r, count)
    tiles = -(-r // tile) + count  # a static bound: each expert pads fewer than tile rows
    per_expert = -(-sizes // tile)  # [E'] tiles
    ends = jnp.cumsum(per_expert)  # [E']
    starts = jnp.cumsum(sizes) - sizes  # [E'] each expert's first row
    tile_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(tiles), side="right"), count - 1)  # [tiles]
    # Row i of expert e (its rank within e) goes to padded row (ends[e] - per_expert[e]) * tile + rank.
    sorted_expert = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(r), side="right")  # [R]
    valid = sorted_expert < count
    e = jnp.minimum(sorted_expert, count - 1)
    slot = jnp.where(valid, (ends[e] - per_expert[e]) * tile + jnp.arange(r) - starts[e], tiles * tile)
    padded = jnp.zeros((tiles * tile, rows.shape[1]), rows.dtype).at[slot].set(rows, mode="drop")

    def one_tile(args):
        block, expert = args  # [tile, H], the tile's expert
        return expert_mlp(block, tuple(w[expert] for w in inputs), down[expert], unit, precision, accumulate,
                          tuple(b[expert] for b in biases), tuple(b[expert] for b in down_bias))

    out = jax.lax.map(one_tile, (padded.reshape(tiles, tile, -1), tile_expert))  # [tiles, tile, H]
    out = out.reshape(tiles * tile, -1)
    return jnp.where(valid[:, None], out[jnp.minimum(slot, tiles * tile - 1)], 0)  # [R, H]


def experts_output(x, indices, weights, experts, config: DecoderConfig, dispatch: str, mesh: Mesh | None,
                   unit: HiddenUnit, precision, accumulate) -> jax.Array:
    """``sum_j w_j * expert_{idx_j}(x)`` for x [B, S, H], indices / weights [B, S, k] -> [B, S, H];
    ``experts``: the stacked weights (and biases), each [E', ...]; over a mesh, each device its own
    experts and rows (see the module docstring)."""
    kind = dispatch_for(config, dispatch)
    ragged = jax.default_backend() != "cpu"

    def local(x, indices, weights, *experts, first=0):
        b, s, h = x.shape
        flat = x.reshape(b * s, h), indices.reshape(b * s, -1), weights.reshape(b * s, -1)
        scaled = config.moe.input_scaled
        if kind == "dense":
            out = dense_dispatch(*flat, experts, first, unit, precision, accumulate, scaled)
        else:
            out = grouped_dispatch(*flat, experts, first, unit, precision, accumulate, ragged, scaled)
        return out.reshape(b, s, -1)

    if mesh is None or x.shape[0] % mesh.shape["data"]:
        return local(x, indices, weights, *experts)
    model = mesh.shape["model"]
    split = model > 1 and experts[0].shape[0] % model == 0  # slots: padded to a multiple of it when loaded
    weight_specs = tuple(P("model" if split else None, *(None,) * (e.ndim - 1)) for e in experts)
    per_device = experts[0].shape[0] // model if split else 0

    def sharded(x, indices, weights, *experts):
        first = jax.lax.axis_index("model") * per_device if split else 0
        out = local(x, indices, weights, *experts, first=first)
        return jax.lax.psum(out, "model") if split else out

    rows = P("data", None, None)
    return jax.shard_map(sharded, mesh=mesh, in_specs=(rows, rows, rows, *weight_specs),
                         out_specs=rows, check_vma=False)(x, indices, weights, *experts)


class Experts(nn.Module):
    """The experts' stacked weights: ``gate_proj`` (gated experts only), ``up_proj`` [E', H, F] and
    ``down_proj`` [E', F, H] (H: the latent width where ``MoE.latent_size``), where E' >= E: loaded onto
    a mesh, the experts padded with all-zero ones that no token is routed to
    (``model.sharding.expert_slots``), whatever the mesh is."""
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> tuple[jax.Array, ...]:
        moe = self.config.moe
        h, e, f = moe.latent_size or self.config.hidden_size, moe.num_experts, moe.expert_size
        # An existing (loaded) value as it is: its slot count is the mesh's, not the config's.
        stacked = lambda name, shape: (self.get_variable("params", name) if self.has_variable("params", name)
                                       else self.param(name, nn.initializers.zeros, shape, self.dtype))
        shapes = [("gate_proj", (e, h, f))] if self.config.gated_mlp else []  # plain experts: up and down
        shapes += [("up_proj", (e, h, f)), ("down_proj", (e, f, h))]
        if moe.expert_bias:  # gpt-oss's
            shapes += [("gate_proj_bias", (e, f)), ("up_proj_bias", (e, f)), ("down_proj_bias", (e, h))]
        return tuple(stacked(name, shape) for name, shape in shapes)


class MoEMLP(nn.Module):
    """The mixture-of-experts MLP of one block (parameters: ``router`` [H, E]; ``experts``'s
    ``gate_proj``, ``up_proj`` [E, H, F] and ``down_proj`` [E, F, H]; Qwen2-MoE's
    ``shared_expert`` and ``shared_expert_gate`` [H, 1]; Gemma 4's ``router_scale`` [H] and
    ``per_expert_scale`` [E])."""
    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32
    residual_dtype: Any = None   # wider than dtype: matmuls accumulate in it
    mesh: Mesh | None = None
    dispatch: str = "auto"       # auto | dense | grouped
    with_sites: bool = False     # also return the routing (and shared expert) sites
    hashed: bool = False         # a hash router: each token's id chooses its experts (``MoE.hash_layers``)

    @nn.compact
    def __call__(self, x, keep: jax.Array | None = None, force: jax.Array | None = None,
                 router_input: jax.Array | None = None, token_ids: jax.Array | None = None):
        """x [B, S, H] in dtype; ``keep`` [E] bool: experts not removed; ``force`` (int32 scalar):
        the expert every token goes to, or -1; ``router_input`` [B, S, H]: what the router reads
        where it is not x (Gemma 4's: the stream); ``token_ids`` [B, S]: what a hash router's table
        [V, k] (``tid2eid``) reads. Returns the output [B, S, H] (and with
        ``with_sites`` a dict of its sites' arrays [B, S, width] by ``model.sites`` name)."""
        c, moe = self.config, self.config.moe
        accumulate = accumulation(self.dtype, self.residual_dtype)
        precision = precision_for(self.dtype)
        router_input = x if router_input is None else router_input
        if moe.router_norm:
            router_input = self.normed_router_input(router_input, accumulate is not None)
        # With a wider stream the router accumulates in it and its weights stay in it, as every
        # matmul and sum does (model.decoder): fewer tokens routed otherwise than in float64.
        if moe.router_in_float32:  # DeepSeek's: kept in float32 whatever the dtype, x cast to it
            logits = dense(moe.num_experts, moe.router_bias, "router", jnp.float32)(
                router_input.astype(jnp.float32))  # [B, S, E]
        else:
            logits = dense(moe.num_experts, moe.router_bias, "router", self.dtype, accumulate)(router_input)
        scale = (self.param("per_expert_scale", nn.initializers.ones, (moe.num_experts,), self.dtype)
                 if moe.per_expert_scale else None)
        weights_dtype = self.dtype if accumulate is None else accumulate
        if self.hashed:  # the experts a token's id gives, weighted as the router scores them
            table = self.param("tid2eid", nn.initializers.zeros, (c.vocab_size, moe.top_k), jnp.int32)
            indices, weights = route_grouped(logits, c, keep, chosen=table[token_ids])  # [B, S, k]
        elif moe.groups:
            bias = (self.param("selection_bias", nn.initializers.zeros, (moe.num_experts,), jnp.float32)
                    if moe.selection_bias else None)
            indices, weights = route_grouped(logits, c, keep, bias)  # [B, S, k]
        elif moe.top_k_before_softmax:
            indices, weights = route_top_k_first(logits, c, weights_dtype, keep)  # [B, S, k]
        else:
            indices, weights = route(logits, c, weights_dtype, keep, scale)  # [B, S, k]
        routed = (indices, weights) if force is None else forced(indices, weights, force)
        experts = Experts(c, self.dtype, name="experts")()
        latent = lambda width, name, y: dense(width, c.mlp_bias, name, self.dtype, accumulate)(y)
        # (the latent rounded to the compute dtype, as transformers' fc1_latent_proj returns it: matmul operands)
        expert_in = x if moe.latent_size is None else latent(moe.latent_size, "latent_in", x).astype(self.dtype)
        out = experts_output(expert_in, *routed, experts, c, self.dispatch, self.mesh,
                             gated_unit(c, ACTIVATIONS[c.hidden_act]), precision, accumulate)
        if moe.latent_size is not None:
            out = latent(c.hidden_size, "latent_out", out)                                # [B, S, H]
        sites = {ROUTER_LOGITS: logits, EXPERT_INDICES: indices, ROUTING_WEIGHTS: weights}
        if moe.shared_expert_size:
            shared = MLP(c, self.dtype, self.residual_dtype, intermediate_size=moe.shared_expert_size,
                         name="shared_expert")(x)  # [B, S, H]
            sites[SHARED_EXPERT_OUT] = shared
            if moe.shared_expert_gate:
                gate = jax.nn.sigmoid(dense(1, False, "shared_expert_gate", self.dtype, accumulate)(x))  # [B, S, 1]
                shared = gate.astype(shared.dtype) * shared
                sites[SHARED_EXPERT_GATE] = gate
            out = out + shared
        return (out, sites) if self.with_sites else out

    def normed_router_input(self, x: jax.Array, wide: bool) -> jax.Array:
        """Gemma 4's router input: x / rms(x) (no weight), times its learned ``router_scale`` [H]
        and 1 / sqrt(H), rounded as transformers rounds it (to the dtype after the norm and after
        each product) unless the stream is wider -> [B, S, H] in the compute dtype."""
        c = self.config
        scale = self.param("router_scale", nn.initializers.ones, (c.hidden_size,), self.dtype)
        normed = rms_normalized(x, c.norm_eps)
        step = jnp.float32 if wide else self.dtype
        scaled = normed.astype(step) * scale.astype(step)
        return (scaled.astype(jnp.float32) * c.hidden_size ** -0.5).astype(self.dtype)
