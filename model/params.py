"""Hugging Face tensor names -> the Flax parameter tree, placed straight onto the mesh.

Every parameter is built with ``jax.make_array_from_callback``: each device receives only its
own slice, read from the checkpoint and cast to the requested dtype, so no device (and no host
buffer) ever holds an extra full copy of a sharded weight.

Names: a family's ``Layout`` says where each parameter is. Most keep Llama's
``model.layers.N.self_attn.q_proj`` / ``mlp.gate_proj`` names; the block's norms differ in
meaning (``post_attention_layernorm`` is the MLP's input norm in Llama-like blocks, the attention
output's norm in Gemma's and OLMo 2's), and the text model's prefix differs by checkpoint layout
(``model.``; ``model.language_model.`` or ``language_model.model.`` inside a Gemma 3 multimodal
checkpoint; none for a bare ``*Model``). GPT-2 (``transformer.h.N``, Conv1D weights stored
[in, out], q | k | v fused in ``c_attn``), GPT-NeoX (``gpt_neox.layers.N``, q, k and v fused per
head) and Phi-3 (``qkv_proj``, ``gate_up_proj``) have their own; a fused tensor is split at load
time. Tensors a checkpoint holds but the model does not read (GPT-2's ``attn.bias`` mask
buffers, rotary caches) are never looked at.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from common.cli import UserError
from model import fp8, hyper, mxfp4
from model.checkpoint import Checkpoint
from model.config import CSA, HCA, DecoderConfig
from model.row_shards import RowShards
from model.sharding import expert_slots, param_sharding

LINEAR_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
# Where the text model's tensors live, by checkpoint layout; the LM head beside each.
TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")
HEAD_NAMES = {"model.": "lm_head.weight", "model.language_model.": "lm_head.weight",
              "language_model.model.": "language_model.lm_head.weight", "": "lm_head.weight"}
# The block's norms (model.decoder.BLOCK_NORMS) by their Hugging Face names, by placement.
NORM_NAMES = {"pre_attention_norm": "input_layernorm", "pre_mlp_norm": "post_attention_layernorm"}
SANDWICH_NORM_NAMES = {"pre_attention_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                       "pre_mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
POST_NORM_NAMES = {"post_attention_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
# Gemma 4's norms around its dense MLP's output and its experts' input and output (model.decoder).
GEMMA4_MOE_NORMS = {"post_mlp_norm_1": "post_feedforward_layernorm_1", "pre_moe_norm": "pre_feedforward_layernorm_2",
                    "post_moe_norm": "post_feedforward_layernorm_2"}


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one parameter's values are in a checkpoint."""
    name: str                # the tensor's Hugging Face name
    transpose: bool = False  # a torch Linear weight [out, in], transposed into a Flax kernel [in, out]
    # A part of a fused tensor (before transposing): (axis, indices, the fused tensor's size along it).
    part: tuple[int, np.ndarray, int] | None = None
    # Experts' tensors stacked on a first axis: ``name`` has ``{e}`` for the expert, 0..experts-1.
    experts: int = 0
    # One tensor of every expert's weights [E, ...] (Gemma 4, gpt-oss): ``part`` along one of its
    # axes; with ``transpose``, torch's [E, out, in] turned into [E, in, out].
    stacked: bool = False
    # Where ``name`` is absent: the names it may be saved under instead, each a tuple of tensors
    # concatenated along axis 0 (what transformers' conversions undo on load: OLMo hybrid's).
    alternatives: tuple[tuple[str, ...], ...] = ()
    flattened: bool = False  # a vector saved with unit axes around it (Kimi's A_log [1, 1, H, 1]), read as one axis
    # Where a stacked tensor is absent: its experts' tensors one an expert (a Source with ``experts``), read
    # instead (Llama 4's FP8 experts, compressed-tensors' Linear modules: ``resolved``).
    per_expert: Source | None = None


class ExpertStack:
    """The tensors of each expert (torch Linear weights [out, in], transposed where asked) seen as
    one array [E, ...], read lazily: a slice reads only the experts it covers (each once), so the
    experts of a device (``model.sharding`` splits them over the model axis) are all it reads; a
    block-FP8 or FP4 expert (DeepSeek-V4's) dequantized as it is read (``model.fp8.read``)."""

    def __init__(self, checkpoint: Checkpoint, names: Sequence[str], transpose: bool, slots: int | None = None,
                 fp8_block: tuple[int, int] | None = None):
        """``slots``: the stack's length, past the experts all-zero ones (``model.sharding.expert_slots``);
        ``fp8_block``: block-FP8 weights' blocks (``model.fp8``)."""
        self.checkpoint, self.names, self.transpose, self.fp8_block = checkpoint, list(names), transpose, fp8_block
        first = checkpoint.shape(self.names[0])
        if any(checkpoint.shape(name) != first for name in self.names):
            raise UserError(f"checkpoint tensors {self.names[0]!r}... differ in shape from one expert to another")
        first = fp8.shape(checkpoint, self.names[0])  # as read: a packed FP4 weight's columns unpacked
        self.expert_shape = first[::-1] if transpose else first
        self.shape = (slots or len(self.names), *self.expert_shape)
        self._read: dict[int, np.ndarray] = {}

    def padded(self, slots: int) -> "ExpertStack":
        return ExpertStack(self.checkpoint, self.names, self.transpose, slots, self.fp8_block)

    def expert(self, e: int) -> np.ndarray:
        if e >= len(self.names):  # a padding slot
            return np.zeros(self.expert_shape, np.float32 if self.fp8_block else self.checkpoint.dtype(self.names[0]))
        if e not in self._read:
            tensor = fp8.read(self.checkpoint, self.names[e], self.fp8_block)
            self._read[e] = tensor.T if self.transpose else tensor
        return self._read[e]

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        experts, rest = index[0], tuple(index[1:])
        return np.stack([self.expert(e)[rest] for e in range(*experts.indices(self.shape[0]))])


class StackedTensor:
    """One checkpoint tensor of every expert's weights [E, ...] (Gemma 4's, gpt-oss's, Mistral 4's;
    or its MXFP4 blocks and scales, ``model.mxfp4``), with a ``Source``'s part taken and transpose
    applied, seen as one array [slots, ...] and read lazily: a slice reads only the experts it covers
    (one contiguous read of their rows, dequantized where they are MXFP4, or FP8 with their scales'
    rows: ``model.fp8.read``), so each process reads the experts of its own devices only; slots past
    the experts are all-zero."""

    def __init__(self, checkpoint: Checkpoint, source: Source, slots: int | None = None,
                 shared: dict | None = None, fp8_block: tuple[int, int] | None = None):
        """``shared``: the expert ranges read from the tensor, by range, kept for the other parts of
        the same fused tensor (gpt-oss's gate and up), read and dequantized once; ``fp8_block``:
        FP8 weights' blocks (``model.fp8``)."""
        self.checkpoint, self.source, self.shared = checkpoint, source, {} if shared is None else shared
        self.fp8_block = fp8_block
        self.quantized = source.name not in checkpoint and source.name + mxfp4.BLOCKS in checkpoint
        if self.quantized:  # [E, out, groups, 16] -> dequantized [E, in, out]
            e, out, groups, _ = checkpoint.shape(source.name + mxfp4.BLOCKS)
            shape = [e, groups * 32, out]
        else:
            shape = list(checkpoint.shape(source.name))
        if source.part is not None:
            axis, indices, size = source.part
            if len(shape) <= axis or shape[axis] != size:
                raise UserError(f"checkpoint tensor {source.name!r} has shape {shape}, which config.json's sizes do "
                                f"not give (its fused parts make {size} along axis {axis})")
            shape[axis] = len(indices)
        if source.transpose:
            if len(shape) != 3:
                raise UserError(f"checkpoint tensor {source.name!r} has shape {shape}: expected the experts' weights "
                                "stacked [experts, out, in]")
            shape[1], shape[2] = shape[2], shape[1]
        self.experts = shape[0]
        self.shape = (slots or self.experts, *shape[1:])
        self._read: dict[tuple[int, int], np.ndarray] = {}

    def padded(self, slots: int) -> "StackedTensor":
        return StackedTensor(self.checkpoint, self.source, slots, self.shared, self.fp8_block)

    def rows(self, first: int, last: int) -> np.ndarray:
        """Experts [first, last) (within the real ones) as loaded: [last - first, ...]."""
        if (first, last) not in self._read:
            name, span = self.source.name, (first, last)
            if span not in self.shared:
                self.shared[span] = (mxfp4.dequantized(self.checkpoint.tensor(name + mxfp4.BLOCKS, span),
                                                       self.checkpoint.tensor(name + mxfp4.SCALES, span))
                                     if self.quantized else fp8.read(self.checkpoint, name, self.fp8_block, span))
            tensor = self.shared[span]
            if self.source.part is not None:
                axis, indices, _ = self.source.part
                tensor = np.take(tensor, indices, axis=axis)
            self._read[first, last] = np.swapaxes(tensor, 1, 2) if self.source.transpose else tensor
        return self._read[first, last]

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        first, last, _ = index[0].indices(self.shape[0])
        real = self.rows(min(first, self.experts), min(last, self.experts))
        if last > self.experts:  # padding slots
            real = np.concatenate([real, np.zeros((last - max(first, self.experts), *self.shape[1:]), real.dtype)])
        return np.ascontiguousarray(real[(slice(None), *index[1:])])


@dataclasses.dataclass(frozen=True)
class Layout:
    """A family's Hugging Face names: its tensors (below the text prefix) and, for the sites and
    the reference, the modules of a block (below ``<blocks>.L``)."""
    prefixes: tuple[str, ...]           # where the text model's tensors may live (the first holding ``embed``)
    embed: str                          # the token embedding's module
    blocks: str                         # the list of blocks
    final_norm: str
    block_tensors: Callable[..., Iterator[tuple[tuple[str, ...], Source]]]  # (config, "<prefix><blocks>.L", L)
    positions: str | None = None        # the learned position embedding's module
    head: str | None = None             # an untied head's tensor, at the top level (None: HEAD_NAMES[prefix])
    attention: str = "self_attn"        # the attention module (its output: what it adds)
    o_proj: str = "self_attn.o_proj"    # its output projection (input: attn.hook_z)
    mlp: str = "mlp"                    # the MLP, or a mixture of experts' block (its router: <mlp>.gate)
    down_proj: str = "mlp.down_proj"    # the MLP's last projection (input: mlp.hook_post)
    moe_tensors: str = "mlp"            # a mixture of experts' tensors, below the block (gate, experts.E...)
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # an expert's, below <moe_tensors>.experts.E
    norms: dict[str, str] | None = None  # our block norm -> theirs (None: by the config's placement)
    deltanet_fused: bool = False        # DeltaNet projections fused per key head (in_proj_qkvz, in_proj_ba: Qwen3-Next)
    deltanet_names: dict[str, str] | None = None  # our DeltaNet tensor -> theirs where q, k and v are projected
                                        # apart (OLMo hybrid); None: Qwen3.5's in_proj_qkv, in_proj_z, ...
    router: str | None = None           # the router module, returning (logits or probabilities, weights,
                                        # indices); None: <mlp>.gate
    router_logits: str | None = None    # where its logits are when it returns probabilities (Gemma 4's)
    router_outputs: dict[str, str] | None = None  # the routing sites' sides of its output where they are not
                                        # (logits or probabilities, weights, indices): Llama 4's (scores, logits)
    expert_tensors: Callable[..., Iterator[tuple[tuple[str, ...], Source]]] | None = None  # a family's own
                                        # mixture-of-experts tensors (config, "<prefix><blocks>.L"): gpt-oss's
    shared_expert: str = "shared_expert"  # the shared expert's module below <mlp> (DeepSeek's: shared_experts)
    selection_bias: str = "gate.e_score_correction_bias"  # the router's choice bias, below <moe_tensors>
    gate_up: str | None = None          # a dense MLP's fused gate | up projection below the block (Granite's)
    shared_expert_at: str | None = None  # the shared expert's module below the block, not below <mlp> (Granite's)
    mamba: str = "mamba"                # a Mamba-2 block's mixer module (Nemotron-H's: mixer)
    deltanet: str = "linear_attn"       # a Gated DeltaNet block's mixer module (Kimi Linear's: self_attn)
    indexed_keys: tuple[str, str] | None = None  # where transformers shows the keys a sparse attention attended
                                        # to (module, side); None: its indexer's output (GLM-5's attention returns
                                        # them, its own indexer's or reused)
    renamed: dict[str, str] | None = None  # a part of a tensor name as read -> as the checkpoint may have it
                                        # instead (transformers' conversion_mapping renames one into the other)


def _linear(module: str, path: tuple[str, ...], bias: bool, part=None, transpose: bool = True):
    """A projection's kernel (and bias) from ``module``'s ``weight`` (and ``bias``)."""
    yield (*path, "kernel"), Source(f"{module}.weight", transpose, part)
    if bias:
        yield (*path, "bias"), Source(f"{module}.bias", False, part if part is None else (0, *part[1:]))


def _norm(module: str, path: tuple[str, ...], config: DecoderConfig):
    """A norm's weight (and a LayerNorm's bias)."""
    yield (*path, "weight"), Source(f"{module}.weight")
    if config.norm == "layer":
        yield (*path, "bias"), Source(f"{module}.bias")


def _split(axis: int, sizes: Sequence[int]) -> list[tuple[int, np.ndarray, int]]:
    """The parts (``Source.part``) of a tensor fused along ``axis`` from consecutive parts of
    these sizes (q | k | v, or gate | up)."""
    ends = np.cumsum(sizes)
    return [(axis, np.arange(end - size, end), int(ends[-1])) for size, end in zip(sizes, ends)]


def _moe(config: DecoderConfig, hf: str):
    """A mixture of experts' tensors below its module ``hf``: the router ``gate`` [E, H], each
    expert's projections (stacked at load time) and Qwen2-MoE's shared expert and its gate."""
    moe = config.moe
    layout = layout_of(config)
    yield ("mlp", "router", "kernel"), Source(f"{hf}.gate.weight", True)
    if moe.selection_bias:
        yield ("mlp", "selection_bias"), Source(f"{hf}.{layout.selection_bias}")
    for ours, theirs in zip(("gate_proj", "up_proj", "down_proj"), layout.experts):
        yield ("mlp", "experts", ours), Source(f"{hf}.experts.{{e}}.{theirs}.weight", True, experts=moe.num_experts)
    if moe.shared_expert_size:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield from _linear(f"{hf}.{layout.shared_expert}.{proj}", ("mlp", "shared_expert", proj), False)
        if moe.shared_expert_gate:
            yield from _linear(f"{hf}.shared_expert_gate", ("mlp", "shared_expert_gate"), False)


def _latent_attention(config: DecoderConfig, hf: str, layer: int):
    """A latent attention's tensors below ``self_attn``, but for ``o_proj`` (``model.decoder.LatentAttention``);
    where the checkpoint pairs the rotated dims as (0, 1), (2, 3), ... (``rope_interleave``), the rows
    making them reordered to evens then odds, rotate-half's layout, in q and in the shared key part alike."""
    c, m = config, config.mla
    n, dn, dr = c.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim
    pairs = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)]) if m.rope_interleave else np.arange(dr)
    head_rows = np.concatenate([np.arange(dn), dn + pairs])  # one head's q rows: not rotated, then rotated
    q_rows = (0, (np.arange(n)[:, None] * m.qk_head_dim + head_rows).reshape(-1), n * m.qk_head_dim)
    kv_rows = (0, np.concatenate([np.arange(m.kv_lora_rank), m.kv_lora_rank + pairs]), m.kv_lora_rank + dr)
    attn = f"{hf}.self_attn"
    if m.q_lora_rank:
        yield from _linear(f"{attn}.q_a_proj", ("self_attn", "q_a_proj"), c.qkv_bias)
        yield from _norm(f"{attn}.q_a_layernorm", ("self_attn", "q_a_layernorm"), c)
        yield from _linear(f"{attn}.q_b_proj", ("self_attn", "q_b_proj"), False, q_rows)
    else:
        yield from _linear(f"{attn}.q_proj", ("self_attn", "q_proj"), False, q_rows)
    yield from _linear(f"{attn}.kv_a_proj_with_mqa", ("self_attn", "kv_a_proj_with_mqa"), c.qkv_bias, kv_rows)
    yield from _norm(f"{attn}.kv_a_layernorm", ("self_attn", "kv_a_layernorm"), c)
    yield from _linear(f"{attn}.kv_b_proj", ("self_attn", "kv_b_proj"), False)
    if m.indexer is not None and m.indexer.owns(layer):  # DeepSeek sparse attention's indexer, its rotated dims
        # as rotate-half pairs them (none in a block reusing an earlier block's choice: GLM-5's shared ones)
        ix = m.indexer
        pairs = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)]) if ix.rope_interleave else np.arange(dr)
        rows = np.concatenate([pairs, np.arange(dr, ix.head_dim)])  # one index head's: rotated, then not
        head = (0, rows, ix.head_dim)  # the index key's rows, and its LayerNorm's
        yield from _linear(f"{attn}.indexer.wq_b", ("self_attn", "indexer", "wq_b"), False,
                           (0, (np.arange(ix.num_heads)[:, None] * ix.head_dim + rows).reshape(-1),
                            ix.num_heads * ix.head_dim))
        yield from _linear(f"{attn}.indexer.wk", ("self_attn", "indexer", "wk"), False, head)
        yield from _linear(f"{attn}.indexer.weights_proj", ("self_attn", "indexer", "weights_proj"), False)
        for leaf in ("weight", "bias"):
            yield ("self_attn", "indexer", "k_norm", leaf), Source(f"{attn}.indexer.k_norm.{leaf}", part=head)
        if ix.pool > 1:  # GLM-5-next's k-pool: the gate (a bare [D, H] weight, read as a kernel) and per-slot bias
            for leaf, transpose in (("index_kpool_compress_gate", True), ("index_kpool_compress_ape", False)):
                yield ("self_attn", "indexer", leaf), Source(f"{attn}.indexer.{leaf}", transpose)


def _gemma4_moe(config: DecoderConfig, hf: str):
    """Gemma 4's experts beside the dense MLP: the router (``router.proj``, its input's ``scale``
    and ``per_expert_scale``), the experts' stacked ``gate_up_proj`` [E, 2F, H] (gate rows, then
    up) and ``down_proj`` [E, H, F], and the three norms around them."""
    f = config.moe.expert_size
    yield ("moe", "router", "kernel"), Source(f"{hf}.router.proj.weight", True)
    yield ("moe", "router_scale"), Source(f"{hf}.router.scale")
    yield ("moe", "per_expert_scale"), Source(f"{hf}.router.per_expert_scale")
    for proj, part in zip(("gate_proj", "up_proj"), _split(1, [f, f])):
        yield ("moe", "experts", proj), Source(f"{hf}.experts.gate_up_proj", True, part, stacked=True)
    yield ("moe", "experts", "down_proj"), Source(f"{hf}.experts.down_proj", True, stacked=True)
    for ours, theirs in GEMMA4_MOE_NORMS.items():
        yield from _norm(f"{hf}.{theirs}", (ours,), config)


def _stacked_moe(config: DecoderConfig, hf: str):
    """A mixture of experts below ``mlp`` as transformers 5 holds it (Mistral 4's): the router
    ``gate`` [E, H], the experts' stacked ``gate_up_proj`` [E, 2F, H] (gate rows, then up) and
    ``down_proj`` [E, H, F], and DeepSeek's ungated ``shared_experts``."""
    f = config.moe.expert_size
    yield ("mlp", "router", "kernel"), Source(f"{hf}.mlp.gate.weight", True)
    for proj, part in zip(("gate_proj", "up_proj"), _split(1, [f, f])):
        yield ("mlp", "experts", proj), Source(f"{hf}.mlp.experts.gate_up_proj", True, part, stacked=True)
    yield ("mlp", "experts", "down_proj"), Source(f"{hf}.mlp.experts.down_proj", True, stacked=True)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        yield from _linear(f"{hf}.mlp.shared_experts.{proj}", ("mlp", "shared_expert", proj), False)


def _llama4_moe(config: DecoderConfig, hf: str):
    """Llama 4's mixture of experts below ``feed_forward``: the router [E, H], the experts' stacked
    tensors as transformers holds them, [E, in, out] (``gate_up_proj`` [E, H, 2F]: gate columns,
    then up; ``down_proj`` [E, F, H]), or where they are absent one Linear an expert as
    compressed-tensors saves them (Maverick's FP8: ``experts.{e}.gate_proj.weight`` [F, H], ...),
    and the ungated ``shared_expert``."""
    f, experts = config.moe.expert_size, f"{hf}.feed_forward.experts"
    one_each = {proj: Source(f"{experts}.{{e}}.{proj}.weight", True, experts=config.moe.num_experts)
                for proj in ("gate_proj", "up_proj", "down_proj")}
    yield ("mlp", "router", "kernel"), Source(f"{hf}.feed_forward.router.weight", True)
    for proj, part in zip(("gate_proj", "up_proj"), _split(2, [f, f])):
        yield ("mlp", "experts", proj), Source(f"{experts}.gate_up_proj", part=part, stacked=True,
                                               per_expert=one_each[proj])
    yield ("mlp", "experts", "down_proj"), Source(f"{experts}.down_proj", stacked=True,
                                                  per_expert=one_each["down_proj"])
    for proj in ("gate_proj", "up_proj", "down_proj"):
        yield from _linear(f"{hf}.feed_forward.shared_expert.{proj}", ("mlp", "shared_expert", proj), False)


def _gpt_oss_moe(config: DecoderConfig, hf: str):
    """gpt-oss's mixture of experts below ``mlp``: the router with its bias, and the experts'
    stacked tensors as transformers holds them, [E, in, out]: ``gate_up_proj`` [E, H, 2F] whose
    columns alternate gate and up, ``down_proj`` [E, F, H], and their biases."""
    f = config.moe.expert_size
    yield from _linear(f"{hf}.mlp.router", ("mlp", "router"), True)
    columns = {"gate_proj": np.arange(0, 2 * f, 2), "up_proj": np.arange(1, 2 * f, 2)}  # gate, up, gate, up, ...
    for proj, part in columns.items():  # one tensor's parts in turn: it is read once (StackedTensor's shared)
        yield ("mlp", "experts", proj), Source(f"{hf}.mlp.experts.gate_up_proj", part=(2, part, 2 * f), stacked=True)
    for proj, part in columns.items():
        yield ("mlp", "experts", f"{proj}_bias"), Source(f"{hf}.mlp.experts.gate_up_proj_bias",
                                                         part=(1, part, 2 * f), stacked=True)
    yield ("mlp", "experts", "down_proj"), Source(f"{hf}.mlp.experts.down_proj", stacked=True)
    yield ("mlp", "experts", "down_proj_bias"), Source(f"{hf}.mlp.experts.down_proj_bias", stacked=True)


def _mamba(config: DecoderConfig, hf: str):
    """A Mamba-2 mixer's tensors (``model.decoder.Mamba2Mixer``) as transformers names them:
    ``in_proj``'s rows (z | x B C | dt) taken apart, the convolution's weight and bias, A_log, D,
    dt_bias, the gated norm, ``out_proj``."""
    m = config.mamba
    for proj, part in zip(("in_proj_z", "in_proj_xbc", "in_proj_dt"), _split(0, [m.inner, m.conv_dim, m.num_heads])):
        yield from _linear(f"{hf}.in_proj", ("mamba", proj), m.proj_bias, part)
    yield from _linear(f"{hf}.out_proj", ("mamba", "out_proj"), m.proj_bias)
    yield ("mamba", "conv"), Source(f"{hf}.conv1d.weight")
    if m.conv_bias:
        yield ("mamba", "conv_bias"), Source(f"{hf}.conv1d.bias")
    for name in ("A_log", "D", "dt_bias"):
        yield ("mamba", name), Source(f"{hf}.{name}")
    if m.gated_norm:
        yield ("mamba", "norm"), Source(f"{hf}.norm.weight")


def _granite_moe(config: DecoderConfig, hf: str):
    """Granite's mixture of experts (``block_sparse_moe``: the router's ``layer`` [E, H], the experts'
    stacked ``input_linear`` [E, 2F, H], gate rows then up, and ``output_linear`` [E, H, F]; the
    layout's renamings read transformers' names for them) and its ``shared_mlp``, always added
    (ungated)."""
    f, fs = config.moe.expert_size, config.moe.shared_expert_size
    moe = f"{hf}.block_sparse_moe"
    yield ("mlp", "router", "kernel"), Source(f"{moe}.router.layer.weight", True)
    for proj, part in zip(("gate_proj", "up_proj"), _split(1, [f, f])):
        yield ("mlp", "experts", proj), Source(f"{moe}.input_linear.weight", True, part, stacked=True)
    yield ("mlp", "experts", "down_proj"), Source(f"{moe}.output_linear.weight", True, stacked=True)
    for proj, part in zip(("gate_proj", "up_proj"), _split(0, [fs, fs])):
        yield from _linear(f"{hf}.shared_mlp.input_linear", ("mlp", "shared_expert", proj), False, part)
    yield from _linear(f"{hf}.shared_mlp.output_linear", ("mlp", "shared_expert", "down_proj"), False)


# Our hyper-connection modules (model.decoder.DecoderLayer.collapsed, named as transformers' modules) -> the
# prefix of their tensors in the hub's checkpoints (``hc_attn_fn``; transformers renames it ``attn_hc.fn``).
HYPER_MODULES = {hyper.ATTN_MODULE: "hc_attn", hyper.MLP_MODULE: "hc_ffn"}


def _llama_block(config: DecoderConfig, hf: str, layer: int, fused: bool = False):
    """Llama's names (and Qwen, Mistral, Gemma, OLMo 2's, and the mixtures of experts'); ``fused``:
    Phi-3's qkv_proj and gate_up_proj, split at load time."""
    c = config.layer_config(layer)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    # A kv-sharing block has no keys or values of its own; a Gemma 4 full block whose keys are its values no v.
    own = ("q_proj",) if c.kv_source(layer) is not None else ("q_proj", "k_proj") if (
        c.attention_k_eq_v and c.window(layer) is None) else ("q_proj", "k_proj", "v_proj")
    if c.is_deltanet(layer):
        yield from _deltanet(c, f"{hf}.{layout_of(c).deltanet}", layout_of(c))
    elif c.is_mamba(layer):
        yield from _mamba(c, f"{hf}.mamba")
    elif c.mla is not None:
        yield from _latent_attention(c, hf, layer)
    elif fused:
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), _split(0, [q, kv, kv])):
            yield from _linear(f"{hf}.self_attn.qkv_proj", ("self_attn", proj), c.qkv_bias, part)
    else:
        for proj in own:
            yield from _linear(f"{hf}.self_attn.{proj}", ("self_attn", proj), c.qkv_bias)
    if c.has_parallel_mamba(layer):  # Falcon-H1's, beside attention
        yield from _mamba(c, f"{hf}.{layout_of(c).mamba}")
    if not c.is_recurrent(layer):
        yield from _linear(f"{hf}.self_attn.o_proj", ("self_attn", "o_proj"), c.o_bias)
    if c.attention_sinks and not c.is_recurrent(layer):
        yield ("self_attn", "sinks"), Source(f"{hf}.self_attn.sinks")
    if c.qk_norm and not c.is_recurrent(layer):
        for norm in ("q_norm", "k_norm") if "k_proj" in own else ("q_norm",):
            yield from _norm(f"{hf}.self_attn.{norm}", ("self_attn", norm), c)
    beside = c.is_sparse(layer) and c.moe.beside_dense  # Gemma 4: the experts beside the dense MLP
    if beside:
        yield from _gemma4_moe(c, hf)
    elif c.is_sparse(layer) and layout_of(c).expert_tensors is not None:
        yield from layout_of(c).expert_tensors(c, hf)
    elif c.is_sparse(layer):
        yield from _moe(c, f"{hf}.{layout_of(c).moe_tensors}")
    if beside or not c.is_sparse(layer):  # a dense MLP
        if fused or layout_of(c).gate_up:
            for proj, part in zip(("gate_proj", "up_proj"), _split(0, [c.intermediate_size] * 2)):
                yield from _linear(f"{hf}.{layout_of(c).gate_up or 'mlp.gate_up_proj'}", ("mlp", proj), c.mlp_bias,
                                   part)
        else:
            for proj in ("gate_proj", "up_proj") if c.gated_mlp else ("up_proj",):
                yield from _linear(f"{hf}.{layout_of(c).mlp}.{proj}", ("mlp", proj), c.mlp_bias)
        yield from _linear(f"{hf}.{layout_of(c).down_proj}", ("mlp", "down_proj"), c.mlp_bias)
    for ours, theirs in block_norm_names(c).items():
        yield from _norm(f"{hf}.{theirs}", (ours,), c)
    if c.per_layer_input_size:  # Gemma 4's per-layer embedding's addition
        for proj in ("per_layer_input_gate", "per_layer_projection"):
            yield from _linear(f"{hf}.{proj}", (proj,), False)
        yield from _norm(f"{hf}.post_per_layer_input_norm", ("post_per_layer_input_norm",), c)
    if c.layer_scalar:
        yield ("layer_scalar",), Source(f"{hf}.layer_scalar")
    if c.hyper is not None and c.hyper.kind == "gated":  # Qwen4-Exp's gated residual (model.hyper.GatedResidual)
        for module in hyper.modules(c.hyper):
            yield from _gated_residual(c, f"{hf}.{module}", (module,), inject=True)
    elif c.hyper is not None:  # each sublayer's hyper-connection (model.hyper)
        for ours, theirs in HYPER_MODULES.items():
            for leaf in ("fn", "base", "scale"):
                yield (ours, leaf), Source(f"{hf}.{theirs}_{leaf}")
    if c.attention_indexer is not None and not c.is_recurrent(layer):  # Qwen4-Exp's QSA (model.indexer)
        yield from _linear(f"{hf}.self_attn.indexer.index_qk_proj", ("self_attn", "indexer", "index_qk_proj"), False)
        for norm in ("q_layernorm", "k_layernorm"):
            yield from _norm(f"{hf}.self_attn.indexer.{norm}", ("self_attn", "indexer", norm), c)
    if c.ngram is not None and layer in c.ngram.layers:  # Qwen4-Exp's hashed n-gram embedding (model.ngram)
        yield from _ngram(c, f"{hf}.ple")


def _gated_residual(config: DecoderConfig, hf: str, path: tuple[str, ...], inject: bool):
    """A gated residual's tensors (``model.hyper.GatedResidual``), as transformers names them."""
    yield from _norm(f"{hf}.hc_norm", (*path, "hc_norm"), config)
    for proj in ("input_mix_weight_down", "input_mix_weight_up", *(("block_inject_weight",) if inject else ())):
        yield from _linear(f"{hf}.{proj}", (*path, proj), False)


def _ngram(config: DecoderConfig, hf: str):
    """A block's hashed n-gram embedding (``model.ngram.NGramInjection``): its table (on the hub in
    ``split_ngram_parts`` row shards, concatenated in order, as transformers' loading does), its
    projections, norms and convolution; transformers' hash buffers are not read (model.ngram computes
    them from the config)."""
    table = f"{hf}.ple_embedding.ngram_embedding"
    shards = tuple(f"{table}.shard_{k}.weight" for k in range(config.ngram.parts))
    yield ("ple", "ngram_embedding"), Source(f"{table}.weight", alternatives=(shards,))
    for proj in ("key_proj", "value_proj"):
        yield from _linear(f"{hf}.{proj}", ("ple", proj), False)
    for norm in ("norm_key", "norm_query", "norm_conv"):
        yield from _norm(f"{hf}.{norm}", ("ple", norm), config)
    yield ("ple", "conv1d"), Source(f"{hf}.conv1d.weight")


def _nemotron_h_block(config: DecoderConfig, hf: str, layer: int):
    """Nemotron-H's blocks of one sublayer: its ``norm`` and its ``mixer``: a Mamba-2 mixer,
    attention (q, k, v, o without biases), a plain MLP (``up_proj``, ``down_proj``), or a mixture of
    plain experts (the router ``gate`` and its ``e_score_correction_bias``; the experts' projections
    one tensor an expert as the hub has them, or stacked [E, out, in] as transformers saves them;
    the ``shared_experts`` MLP; the latent projections ``fc1_latent_proj``, ``fc2_latent_proj``
    where ``moe_latent_size``)."""
    c, mixer = config.layer_config(layer), f"{hf}.mixer"
    if c.is_mamba(layer):
        yield from _mamba(c, mixer)
    elif c.has_mixer(layer):
        for proj in LINEAR_ATTN:
            yield from _linear(f"{mixer}.{proj}", ("self_attn", proj), False)
    elif c.is_sparse(layer):
        yield ("mlp", "router", "kernel"), Source(f"{mixer}.gate.weight", True)
        yield ("mlp", "selection_bias"), Source(f"{mixer}.gate.e_score_correction_bias")
        for proj in ("up_proj", "down_proj"):
            yield ("mlp", "experts", proj), Source(f"{mixer}.experts.{{e}}.{proj}.weight", True,
                                                   experts=c.moe.num_experts,
                                                   alternatives=((f"{mixer}.experts.{proj}",),))
            yield from _linear(f"{mixer}.shared_experts.{proj}", ("mlp", "shared_expert", proj), c.mlp_bias)
        if c.moe.latent_size is not None:  # the experts' latent projections (Nemotron 3 Super's)
            for ours, theirs in (("latent_in", "fc1_latent_proj"), ("latent_out", "fc2_latent_proj")):
                yield from _linear(f"{mixer}.{theirs}", ("mlp", ours), c.mlp_bias)
    else:
        for proj in ("up_proj", "down_proj"):
            yield from _linear(f"{mixer}.{proj}", ("mlp", proj), c.mlp_bias)
    yield from _norm(f"{hf}.norm", ("pre_attention_norm" if c.has_mixer(layer) else "pre_mlp_norm",), c)


def _per_layer_inputs(config: DecoderConfig, prefix: str, num_layers: int):
    """Gemma 4's per-layer embedding table [V', L*P] and the embeddings' projection (torch [L*P, H]),
    the columns (rows) of the blocks computed only, and the projection's norm."""
    p = config.per_layer_input_size
    # A part of the columns only when fewer blocks are computed (no copy of the whole table otherwise).
    part = lambda axis: ((axis, np.arange(num_layers * p), config.num_hidden_layers * p)
                         if num_layers < config.num_hidden_layers else None)
    yield ("per_layer_inputs", "embed_tokens_per_layer", "embedding"), Source(
        f"{prefix}embed_tokens_per_layer.weight", part=part(1))
    yield ("per_layer_inputs", "per_layer_model_projection", "kernel"), Source(
        f"{prefix}per_layer_model_projection.weight", True, part(0))
    yield from _norm(f"{prefix}per_layer_projection_norm", ("per_layer_inputs", "per_layer_projection_norm"), config)


def _deltanet(config: DecoderConfig, hf: str, layout: Layout):
    """A Gated DeltaNet mixer's tensors (``model.decoder.GatedDeltaNet``), as transformers names
    them: ``in_proj_qkv`` and the convolution's weight [channels, 1, taps] taken apart into q, k
    and v (so that each splits by heads over a mesh). ``layout.deltanet_fused``: Qwen3-Next's
    ``in_proj_qkvz`` (per key head: its q, its k, its value heads' v, their z) and ``in_proj_ba``
    (per key head: its value heads' b, their a), taken apart into ours; ``layout.deltanet_names``:
    separate projections under those names (OLMo hybrid's)."""
    d = config.deltanet
    names = layout.deltanet_names or {}
    parts = dict(zip("qkv", _split(0, [d.key_dim, d.key_dim, d.value_dim])))  # of q | k | v
    if layout.deltanet_fused:
        for proj, part in _fused_deltanet_parts(d):
            yield from _linear(f"{hf}.{'in_proj_ba' if proj in ('in_proj_b', 'in_proj_a') else 'in_proj_qkvz'}",
                               ("linear_attn", proj), False, part)
    elif names:
        gates = () if d.gate_rank else ("in_proj_z", "in_proj_a")  # Kimi's pass through a low rank (below)
        for proj in ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_b", *gates):
            yield from _linear(f"{hf}.{names[proj]}", ("linear_attn", proj), False)
    else:
        for name, part in parts.items():
            yield from _linear(f"{hf}.in_proj_qkv", ("linear_attn", f"in_proj_{name}"), False, part)
        for proj in ("in_proj_z", "in_proj_b", "in_proj_a"):
            yield from _linear(f"{hf}.{proj}", ("linear_attn", proj), False)
    yield from _linear(f"{hf}.{names.get('out_proj', 'out_proj')}", ("linear_attn", "out_proj"), False)
    # OLMo hybrid's checkpoints hold q's, k's and v's convolutions apart, which transformers concatenates.
    apart = ((f"{hf}.q_conv1d.weight", f"{hf}.k_conv1d.weight", f"{hf}.v_conv1d.weight"),) if names else ()
    for name, part in parts.items():
        yield ("linear_attn", f"conv_{name}"), Source(f"{hf}.conv1d.weight", part=part, alternatives=apart)
    if d.gate_rank:  # Kimi's decay (f) and output gate (g), each through a low rank (a, then b)
        for proj in ("f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj"):
            yield from _linear(f"{hf}.{proj}", ("linear_attn", proj), False)
    for name in ("dt_bias", "A_log"):
        yield ("linear_attn", name), Source(f"{hf}.{name}", flattened=True)
    yield ("linear_attn", "norm"), Source(f"{hf}.{names.get('norm', 'norm')}.weight")


def _fused_deltanet_parts(d) -> list[tuple[str, tuple[int, np.ndarray, int]]]:
    """(our projection, its rows of Qwen3-Next's fused tensor) for in_proj_q, in_proj_k, in_proj_v
    (all heads' each), in_proj_z, in_proj_b and in_proj_a: the fused rows go per key head j,
    [q_j, k_j, v_j, z_j] and [b_j, a_j], where v_j, z_j, b_j, a_j belong to its
    num_value_heads / num_key_heads value heads."""
    g = d.num_value_heads // d.num_key_heads
    group = 2 * d.key_head_dim + 2 * g * d.value_head_dim            # rows per key head in in_proj_qkvz
    starts = np.arange(d.num_key_heads)[:, None] * group             # [Hk, 1]
    rows = lambda offset, width: (starts + offset + np.arange(width)[None, :]).reshape(-1)
    qkvz = group * d.num_key_heads
    q, k = rows(0, d.key_head_dim), rows(d.key_head_dim, d.key_head_dim)
    v, z = rows(2 * d.key_head_dim, g * d.value_head_dim), rows(2 * d.key_head_dim + g * d.value_head_dim,
                                                                g * d.value_head_dim)
    ba_starts = np.arange(d.num_key_heads)[:, None] * 2 * g
    b, a = ((ba_starts + offset + np.arange(g)[None, :]).reshape(-1) for offset in (0, g))
    ba = 2 * g * d.num_key_heads
    return [("in_proj_q", (0, q, qkvz)), ("in_proj_k", (0, k, qkvz)), ("in_proj_v", (0, v, qkvz)),
            ("in_proj_z", (0, z, qkvz)), ("in_proj_b", (0, b, ba)), ("in_proj_a", (0, a, ba))]


def _gpt2_block(config: DecoderConfig, hf: str, layer: int):
    """GPT-2's Conv1D weights are stored [in, out], a Flax kernel already; c_attn's output columns
    are q | k | v."""
    h = config.hidden_size
    for proj, part in zip(("q_proj", "k_proj", "v_proj"), _split(1, [h, h, h])):
        yield from _linear(f"{hf}.attn.c_attn", ("self_attn", proj), True, part, transpose=False)
    yield from _linear(f"{hf}.attn.c_proj", ("self_attn", "o_proj"), True, transpose=False)
    yield from _linear(f"{hf}.mlp.c_fc", ("mlp", "up_proj"), True, transpose=False)
    yield from _linear(f"{hf}.mlp.c_proj", ("mlp", "down_proj"), True, transpose=False)
    for ours, theirs in GPT2.norms.items():
        yield from _norm(f"{hf}.{theirs}", (ours,), config)


def _neox_block(config: DecoderConfig, hf: str, layer: int):
    """GPT-NeoX's query_key_value rows are per head: [head][q, k, v][head_dim]."""
    n, d = config.num_attention_heads, config.head_dim
    rows = np.arange(n * 3 * d).reshape(n, 3, d)  # [N, 3, D]
    for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        yield from _linear(f"{hf}.attention.query_key_value", ("self_attn", proj), config.qkv_bias,
                           (0, rows[:, i].reshape(-1), rows.size))
    yield from _linear(f"{hf}.attention.dense", ("self_attn", "o_proj"), config.o_bias)
    yield from _linear(f"{hf}.mlp.dense_h_to_4h", ("mlp", "up_proj"), config.mlp_bias)
    yield from _linear(f"{hf}.mlp.dense_4h_to_h", ("mlp", "down_proj"), config.mlp_bias)
    for ours, theirs in GPT_NEOX.norms.items():
        yield from _norm(f"{hf}.{theirs}", (ours,), config)


def _deepseek_v4_block(config: DecoderConfig, hf: str, layer: int):
    """DeepSeek-V4's tensors as save_pretrained writes them (the hub's names below ``model.``; the hub's
    files have them without it, ``DEEPSEEK_V4``'s renamings reading its embedding and final collapse): the
    attention's (``model.compressed``: ``attn.wq_a``, ``q_norm``, ``wq_b``, ``wkv``, ``norm``, ``wo_a``
    as torch holds it [groups x rank, N D / groups], ``wo_b``, ``attn_sink``), its compressor's and its
    indexer's (``wkv``, ``wgate``, ``ape``, ``norm``; the indexer's ``wq_b`` and ``weights_proj``), the
    mixture of experts (``ffn.gate`` with its choice ``bias``, or a hash router's ``tid2eid``; the experts'
    and the shared experts' ``w1`` (gate), ``w3`` (up), ``w2`` (down)), the norms and the
    hyper-connections. In the hub's files the projections (but the compressors' and ``weights_proj``)
    and the shared experts are block-FP8 and the experts FP4, each with its ``.scale``: ``model.fp8``
    dequantizes them as they are read."""
    c, ca = config, config.compressed
    attn, ffn = f"{hf}.attn", f"{hf}.ffn"
    for ours, theirs in (("q_a_proj", "wq_a"), ("q_b_proj", "wq_b"), ("kv_proj", "wkv"), ("o_b_proj", "wo_b")):
        yield from _linear(f"{attn}.{theirs}", ("self_attn", ours), False)
    yield ("self_attn", "o_a_proj"), Source(f"{attn}.wo_a.weight")
    yield ("self_attn", "sinks"), Source(f"{attn}.attn_sink")
    yield from _norm(f"{attn}.q_norm", ("self_attn", "q_a_norm"), c)
    yield from _norm(f"{attn}.norm", ("self_attn", "kv_norm"), c)
    compressors = {CSA: (("compressor",), ("indexer", "compressor")), HCA: (("compressor",),)}
    for path in compressors.get(ca.kind(layer), ()):
        theirs = ".".join((attn, *path))
        for ours, name in (("kv_proj", "wkv"), ("gate_proj", "wgate")):
            yield from _linear(f"{theirs}.{name}", ("self_attn", *path, ours), False)
        yield ("self_attn", *path, "position_bias"), Source(f"{theirs}.ape")
        yield from _norm(f"{theirs}.norm", ("self_attn", *path, "kv_norm"), c)
    if ca.kind(layer) == CSA:
        yield from _linear(f"{attn}.indexer.wq_b", ("self_attn", "indexer", "q_b_proj"), False)
        yield from _linear(f"{attn}.indexer.weights_proj", ("self_attn", "indexer", "weights_proj"), False)
    yield ("mlp", "router", "kernel"), Source(f"{ffn}.gate.weight", True)
    if layer in c.moe.hash_layers:
        yield ("mlp", "tid2eid"), Source(f"{ffn}.gate.tid2eid")
    else:
        yield ("mlp", "selection_bias"), Source(f"{ffn}.gate.bias")
    for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        yield ("mlp", "experts", ours), Source(f"{ffn}.experts.{{e}}.{theirs}.weight", True, experts=c.moe.num_experts)
        yield from _linear(f"{ffn}.shared_experts.{theirs}", ("mlp", "shared_expert", ours), False)
    yield from _norm(f"{hf}.attn_norm", ("pre_attention_norm",), c)
    yield from _norm(f"{hf}.ffn_norm", ("pre_mlp_norm",), c)
    for ours, theirs in HYPER_MODULES.items():
        for leaf in ("fn", "base", "scale"):
            yield (ours, leaf), Source(f"{hf}.{theirs}_{leaf}")


LLAMA = Layout(TEXT_PREFIXES, "embed_tokens", "layers", "norm", _llama_block)
PHI3 = dataclasses.replace(LLAMA, block_tensors=functools.partial(_llama_block, fused=True))
GPT2 = Layout(("transformer.", ""), "wte", "h", "ln_f", _gpt2_block, positions="wpe", head="lm_head.weight",
              attention="attn", o_proj="attn.c_proj", down_proj="mlp.c_proj",
              norms={"pre_attention_norm": "ln_1", "pre_mlp_norm": "ln_2"})
GPT_NEOX = Layout(("gpt_neox.", ""), "embed_in", "layers", "final_layer_norm", _neox_block, head="embed_out.weight",
                  attention="attention", o_proj="attention.dense", down_proj="mlp.dense_4h_to_h",
                  norms={"pre_attention_norm": "input_layernorm", "pre_mlp_norm": "post_attention_layernorm"})
# Mixtral's checkpoints keep its mixture of experts' tensors under ``block_sparse_moe`` (transformers 5's
# module is ``mlp``), its experts' projections named w1 (gate), w3 (up), w2 (down).
MIXTRAL = dataclasses.replace(LLAMA, moe_tensors="block_sparse_moe", experts=("w1", "w3", "w2"))
# MiniMax-M2's checkpoints: Mixtral's, with the router's choice bias beside the gate.
MINIMAX_M2 = dataclasses.replace(MIXTRAL, selection_bias="e_score_correction_bias")
QWEN3_NEXT = dataclasses.replace(LLAMA, deltanet_fused=True)
# OLMo hybrid's DeltaNet: q, k, v, the gate (our z), a and b projected apart, out_proj named o_proj.
OLMO_HYBRID = dataclasses.replace(LLAMA, deltanet_names={
    "in_proj_q": "q_proj", "in_proj_k": "k_proj", "in_proj_v": "v_proj", "in_proj_z": "g_proj", "in_proj_b": "b_proj",
    "in_proj_a": "a_proj", "out_proj": "o_proj", "norm": "o_norm"},
    renamed={"input_layernorm": "attention_layer_norm", "post_attention_layernorm": "feedforward_layer_norm"})
# Kimi Linear's: Kimi Delta Attention as OLMo hybrid's names have it, but the module is self_attn and its gates
# are low-rank (f_*, g_*: our names too); the experts under block_sparse_moe with Mixtral's names, DeepSeek's
# shared_experts; a dense MLP is mlp on the hub, block_sparse_moe as transformers' save_pretrained writes it.
KIMI_LINEAR = dataclasses.replace(MIXTRAL, shared_expert="shared_experts", deltanet="self_attn", deltanet_names={
    "in_proj_q": "q_proj", "in_proj_k": "k_proj", "in_proj_v": "v_proj", "in_proj_b": "b_proj", "out_proj": "o_proj",
    "norm": "o_norm"}, renamed={".mlp.": ".block_sparse_moe."})
GEMMA4 = dataclasses.replace(LLAMA, router="router", router_logits="router.proj")
GPT_OSS = dataclasses.replace(LLAMA, router="mlp.router", expert_tensors=_gpt_oss_moe)
DEEPSEEK = dataclasses.replace(LLAMA, shared_expert="shared_experts")  # DeepSeek-V2/V3, GLM-4.5+
# GLM-5's MoE: the keys its sparse attention attended to are its attention module's third output.
GLM5 = dataclasses.replace(DEEPSEEK, indexed_keys=("self_attn", "indexed keys 2"))
# GLM-5-next's: Kimi Delta Attention under Kimi's names (as on the hub: transformers moves the decay's tensors
# into forget_gate and renames the hyper-connections' hc_attn_fn to attn_hc.fn), DeepSeek's experts one by one.
GLM5_NEXT = dataclasses.replace(DEEPSEEK, deltanet="self_attn", deltanet_names=KIMI_LINEAR.deltanet_names, renamed={
    **{f"self_attn.{name}": f"self_attn.forget_gate.{name}" for name in ("f_a_proj", "f_b_proj", "dt_bias", "A_log")},
    **{f"{hub}_{leaf}": f"{ours}.{leaf}" for ours, hub in HYPER_MODULES.items() for leaf in ("fn", "base", "scale")}})
MISTRAL4 = dataclasses.replace(DEEPSEEK, expert_tensors=_stacked_moe)
# DeepSeek-V4's (save_pretrained's names; its head ``head.weight``): the attention's output projection is
# grouped (wo_a, then wo_b), the indexer's choice of compressed entries its output. The hub's files have the
# same names without ``model.`` but for the embedding (``embed.weight``) and the final collapse (``hc_head_fn``).
DEEPSEEK_V4 = Layout(("model.", ""), "embed_tokens", "layers", "norm", _deepseek_v4_block, head="head.weight",
                     o_proj="self_attn.o_a_proj", shared_expert="shared_experts",
                     indexed_keys=("self_attn.compressor.indexer", "chosen entries"),
                     renamed={"embed_tokens.": "embed.", "hc_head.hc_": "hc_head_"})
# Llama 4's: the MLP and the mixture of experts are ``feed_forward``, whose router returns (its scores:
# the chosen experts' sigmoids, zero elsewhere [T, E]; its logits [T, E]).
LLAMA4 = dataclasses.replace(LLAMA, mlp="feed_forward", down_proj="feed_forward.down_proj", moe_tensors="feed_forward",
                             router="feed_forward.router", expert_tensors=_llama4_moe, router_outputs={
                                 "logits": "output 1", "weights": "top k values of output 0",
                                 "indices": "top k ids of output 1"})
# Granite 4's: the dense MLP is shared_mlp (input_linear: gate | up; output_linear), beside the experts where
# there are some (its router returns (logits, weights, indices) over the tokens).
GRANITE_HYBRID = dataclasses.replace(LLAMA, mlp="shared_mlp", down_proj="shared_mlp.output_linear",
                                     gate_up="shared_mlp.input_linear", router="block_sparse_moe.router",
                                     shared_expert_at="shared_mlp", expert_tensors=_granite_moe, renamed={
                                         f"block_sparse_moe.{ours}": f"block_sparse_moe.{theirs}" for ours, theirs in (
                                             ("router.layer.weight", "router.weight"),
                                             ("input_linear.weight", "experts.gate_up_proj"),
                                             ("output_linear.weight", "experts.down_proj"))})
# Nemotron-H's: ``backbone.`` on the hub (transformers renames it ``model.``), every sublayer a ``mixer``.
NEMOTRON_H = Layout(("backbone.", "model.", ""), "embeddings", "layers", "norm_f", _nemotron_h_block,
                    head="lm_head.weight", attention="mixer", o_proj="mixer.o_proj", mlp="mixer",
                    down_proj="mixer.down_proj", moe_tensors="mixer", shared_expert="shared_experts", mamba="mixer",
                    norms={"pre_attention_norm": "norm", "pre_mlp_norm": "norm"})
# Falcon-H1's: the MLP is feed_forward, its norm pre_ff_layernorm, the final one final_layernorm.
FALCON_H1 = Layout(TEXT_PREFIXES, "embed_tokens", "layers", "final_layernorm", _llama_block, mlp="feed_forward",
                   down_proj="feed_forward.down_proj", norms={"pre_attention_norm": "input_layernorm",
                                                              "pre_mlp_norm": "pre_ff_layernorm"})
LAYOUTS = {"gpt2": GPT2, "gpt_neox": GPT_NEOX, "phi3": PHI3, "mixtral": MIXTRAL, "minimax_m2": MINIMAX_M2,  # else LLAMA
           "qwen3_next": QWEN3_NEXT, "olmo_hybrid": OLMO_HYBRID, "gemma4": GEMMA4, "gpt_oss": GPT_OSS,
           "deepseek_v2": DEEPSEEK, "deepseek_v3": DEEPSEEK, "deepseek_v32": DEEPSEEK, "glm_moe_dsa": GLM5,
           "glm4_moe": DEEPSEEK, "glm4_moe_lite": DEEPSEEK,
           "mistral4": MISTRAL4, "llama4": LLAMA4, "granitemoehybrid": GRANITE_HYBRID, "nemotron_h": NEMOTRON_H,
           "falcon_h1": FALCON_H1, "kimi_linear": KIMI_LINEAR, "glm5_next": GLM5_NEXT,
           "deepseek_v4": DEEPSEEK_V4}


def layout_of(config: DecoderConfig) -> Layout:
    return LAYOUTS.get(config.model_type, LLAMA)


def block_norm_names(config: DecoderConfig) -> dict[str, str]:
    """The block's norms (``model.decoder.BLOCK_NORMS``) that this model has, by their Hugging
    Face names (``post_attention_layernorm`` is the MLP's input norm in Llama-like blocks, the
    attention output's norm in Gemma's and OLMo 2's)."""
    layout = layout_of(config)
    if layout.norms is not None:
        return layout.norms
    if not config.pre_norms and not config.sandwich_norms:  # (Qwen4-Exp's blocks have none)
        return {}
    if not config.pre_norms:
        return POST_NORM_NAMES
    return SANDWICH_NORM_NAMES if config.sandwich_norms else NORM_NAMES


# What each activation site (``model.sites``) equals in transformers' modules of block L: (module
# below the block, "" for the block itself; which side of it). ``input`` / ``output`` are a
# forward hook's (the first positional input; the first output; ``output N``: the Nth of a tuple;
# ``sigmoid output``: the output's sigmoid); ``normalized input`` is that
# norm module's input x normalised as the norm does before its weight (x / rms(x), or
# (x - mean) / std for a LayerNorm), in float32.
def hf_site(site: str, config: DecoderConfig, layer: int | None = None) -> tuple[str, str]:
    """Where ``site`` is seen in a Hugging Face block (block ``layer``, where blocks differ: a
    Gated DeltaNet block's mixer is ``linear_attn``) of the model ``config`` describes;
    ``ValueError`` for a site the model has none of (``model.sites.missing_reason``)."""
    from model import sites
    if reason := sites.missing_reason(site, config, layer):
        raise ValueError(f"{site}: {reason}")
    if layer is not None and layer >= 0:  # its norms' placement (OLMo hybrid's blocks differ)
        config = config.layer_config(layer)
    layout, norms = layout_of(config), block_norm_names(config)
    post = config.sandwich_norms
    # The shared MLP beside the experts, not inside a module of theirs (Granite's): no module returns their sum.
    summed = layout.shared_expert_at is not None and layer is not None and config.is_sparse(layer)
    if site in (sites.MLP_OUT, sites.MLP_MODULE_OUT) and summed:
        return "", "mlp addition" if site == sites.MLP_OUT else "mlp addition unscaled"
    if site in sites.INSIDE:
        return _hf_inside_site(site, config, layout, norms, layer)
    if site in sites.HYPER_SITES:  # transformers' hyper-connection returns (post, comb, collapse); the gated
        theirs = sites.HC_ATTN if site in sites.HC_ATTN else sites.HC_MLP      # residual (collapse, streams, inj)
        module = hyper.modules(config.hyper)[theirs is sites.HC_MLP]
        order = (0, 2) if config.hyper.kind == "gated" else (2, 0, 1)
        return module, f"output {order[theirs.index(site)]}"
    if site == sites.RESID_MID and config.hyper is not None:  # the streams the MLP's hyper-connection reads
        return hyper.modules(config.hyper)[1], "input"
    if site == sites.NGRAM_OUT:
        return "ple", "output"
    if site == sites.ATTN_OUT and layer is not None and config.is_recurrent(layer) and not post:
        return mixer_module(config, layer), _times(config.residual_multiplier)
    multipliers = config.multipliers  # Falcon-H1's, on what each mixer adds
    if site in (sites.SSM_MODULE_OUT, sites.SSM_OUT):
        return layout.mamba, "output" if site == sites.SSM_MODULE_OUT else _times(multipliers.ssm_out)
    if site == sites.ATTN_OUT and multipliers.attention_out != 1:
        return layout.attention, _times(multipliers.attention_out)
    router = layout.router or f"{layout.mlp}.gate"  # returns (logits or probabilities, top-k weights, top-k
    sides = layout.router_outputs or {}                 # indices), over [B*S] tokens
    where = {
        sites.ROUTER_LOGITS: (layout.router_logits or router, sides.get("logits", "output")),
        sites.ROUTING_WEIGHTS: (router, sides.get("weights", "output 1")),
        sites.EXPERT_INDICES: (router, sides.get("indices", "output 2")),
        sites.SHARED_EXPERT_GATE: (f"{layout.mlp}.shared_expert_gate", "sigmoid output"),
        sites.SHARED_EXPERT_OUT: (layout.shared_expert_at or f"{layout.mlp}.{layout.shared_expert}", "output"),
        sites.RESID_PRE: ("", "input"),
        sites.ATTN_Z: (layout.o_proj, "input"),
        sites.ATTN_OUT: (norms["post_attention_norm"], "output") if post else (layout.attention, "output"),
        sites.RESID_MID: (norms["pre_mlp_norm"], "input") if config.pre_norms else (layout.mlp, "input"),
        sites.LN2_NORMALIZED: (norms.get("pre_mlp_norm"), "normalized input"),
        sites.MLP_IN: (layout.mlp, "input"),
        sites.MLP_POST: (layout.down_proj, "input"),
        sites.MLP_OUT: (norms["post_mlp_norm"], "output") if post else (layout.mlp, "output"),
        sites.RESID_POST: ("", "output"),
    }[site]
    if site in (sites.ATTN_OUT, sites.MLP_OUT) and config.residual_multiplier != 1:  # Granite's, on what is added
        return where[0], _times(config.residual_multiplier)
    return where


def _times(factor: float) -> str:
    """A module's output side scaled by ``factor`` (Granite's residual multiplier, Falcon-H1's):
    ``output``, or ``output times F``."""
    return "output" if factor == 1 else f"output times {factor!r}"


def mixer_module(config: DecoderConfig, layer: int) -> str:
    """A recurrent block's mixer module in transformers: ``linear_attn`` (Gated DeltaNet) or the
    layout's Mamba-2 module."""
    layout = layout_of(config)
    return layout.mamba if config.is_mamba(layer) else layout.deltanet


def _hf_inside_site(site: str, config: DecoderConfig, layout: Layout, norms: dict[str, str],
                    layer: int | None) -> tuple[str, str]:
    """``hf_site`` of the sites inside attention and the MLP (besides the rotated queries and keys,
    read where transformers' ``apply_rotary_pos_emb`` returns them, and the scores, computed from
    what its ``eager_attention_forward`` is given: ``rotated query``, ``rotated key``, ``scores``;
    ``pattern`` is that attention's probabilities, [B, N, S, T], its second output). Only for
    separate q, k, v, gate and up projections: ``ValueError`` for a fused one (GPT-2, GPT-NeoX,
    Phi-3)."""
    from model import sites
    attn, mlp = layout.attention, layout.mlp
    recurrent = layer is not None and config.is_recurrent(layer)
    module_out = (mixer_module(config, layer) if recurrent else attn, "output")
    # qkv_proj, gate_up_proj (DeepSeek-V4's grouped output projection is no fusion: its input is attn.hook_z)
    fused = layout.o_proj not in (f"{attn}.o_proj", f"{attn}.o_a_proj") or config.model_type == "phi3"
    if fused and site not in (sites.ATTN_MODULE_OUT, sites.MLP_MODULE_OUT, sites.LN1_NORMALIZED, sites.ATTN_IN):
        raise ValueError(f"{site}: {config.model_type}'s projections are fused in transformers")
    if layout.gate_up and site in sites.MLP_HIDDEN:
        raise ValueError(f"{site}: {config.model_type}'s gate and up projections are fused in transformers")
    return {
        sites.LN1_NORMALIZED: (norms.get("pre_attention_norm"), "normalized input"),
        sites.ATTN_IN: (attn, "input") if not recurrent else (mixer_module(config, layer), "input"),
        sites.ATTN_Q: (f"{attn}.q_proj", "output query half" if config.attn_output_gate else "output"),
        sites.ATTN_GATE: (f"{attn}.q_proj", "output gate half"),
        sites.ATTN_K: (f"{attn}.k_proj", "output"),
        sites.ATTN_V: (f"{attn}.v_proj", "output"),
        sites.Q_NORM_OUT: (f"{attn}.q_norm", "output"),
        sites.K_NORM_OUT: (f"{attn}.k_norm", "output"),
        sites.ROT_Q: (attn, "rotated query"),
        sites.ROT_K: (attn, "rotated key"),
        sites.ATTN_SCORES: (attn, "scores"),
        sites.ATTN_PATTERN: (attn, "pattern"),
        sites.ATTN_MODULE_OUT: module_out,
        sites.INDEXED_KEYS: layout.indexed_keys or (f"{attn}.indexer", "selected mask" if config.attention_indexer
                                                    else "indexed keys"),
        # the gated norm's input: [B*S*Hv, Dv], every value head's row
        sites.DELTA_OUT: (f"{layout.deltanet}.{(layout.deltanet_names or {}).get('norm', 'norm')}", "input per head"),
        sites.MLP_PRE: (f"{mlp}.gate_proj" if config.gated_mlp else f"{mlp}.up_proj", "output"),
        sites.MLP_PRE_LINEAR: (f"{mlp}.up_proj", "output"),
        sites.MLP_MODULE_OUT: (norms["post_mlp_norm"], "input") if config.sandwich_norms else (mlp, "output"),
    }[site]


def text_prefix(checkpoint: Checkpoint, layout: Layout = LLAMA) -> str:
    """The prefix of the text model's tensors in this checkpoint (the first of the layout's holding
    the embedding, under its name or one the layout's renamings give it)."""
    for prefix in layout.prefixes:
        embedding = f"{prefix}{layout.embed}.weight"
        if any(name in checkpoint for name in (embedding, *(embedding.replace(ours, theirs) for ours, theirs
                                                           in (layout.renamed or {}).items() if ours in embedding))):
            return prefix
    raise UserError(f"checkpoint {checkpoint.model_dir!r} has no embedding ({layout.prefixes[0]}{layout.embed}.weight "
                    f"or another layout's)")


def param_names(config: DecoderConfig, num_layers: int, with_head: bool,
                prefix: str = "model.") -> Iterator[tuple[tuple[str, ...], Source]]:
    """(Flax path, where its values are) of every parameter needed."""
    layout = layout_of(config)
    yield ("embed_tokens", "embedding"), Source(f"{prefix}{layout.embed}.weight")
    if layout.positions:
        yield ("embed_positions", "embedding"), Source(f"{prefix}{layout.positions}.weight")
    if config.per_layer_input_size:
        yield from _per_layer_inputs(config, prefix, num_layers)
    for i in range(num_layers):
        for path, source in layout.block_tensors(config, f"{prefix}{layout.blocks}.{i}", i):
            yield (f"layers_{i}", *path), source
    if with_head:
        if config.final_norm:
            yield from _norm(f"{prefix}{layout.final_norm}", ("norm",), config)
        if config.hyper is not None and config.hyper.head == "gated":  # Qwen4-Exp's final collapse
            yield from _gated_residual(config, f"{prefix}{hyper.GATED_HEAD}", ("hc_head",), inject=False)
        if not config.tie_word_embeddings:
            yield ("lm_head", "kernel"), Source(layout.head or HEAD_NAMES[prefix], True)
        if config.hyper is not None and config.hyper.head == "weighted":  # DeepSeek-V4's final collapse
            for leaf in ("hc_fn", "hc_base", "hc_scale"):
                yield ("hc_head", leaf), Source(f"{prefix}hc_head.{leaf}")


def expected_shape(path: tuple[str, ...], config: DecoderConfig, num_layers: int | None = None) -> tuple[int, ...]:
    """The shape ``config`` gives the parameter at ``path`` (kernels as Flax has them: [in, out]),
    for blocks ``0..num_layers-1`` (all by default)."""
    c = config.layer_config(int(path[0].removeprefix("layers_"))) if path[0].startswith("layers_") else config
    h, f, d = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    module, leaf = path[-2], path[-1]
    if c.moe is not None:
        e, fe, fs = c.moe.num_experts, c.moe.expert_size, c.moe.shared_expert_size
        width = c.moe.latent_size or h  # what the experts read and write
        if module == "experts":
            return {"down_proj": (e, fe, width), "gate_proj_bias": (e, fe), "up_proj_bias": (e, fe),
                    "down_proj_bias": (e, width)}.get(leaf, (e, width, fe))
        if module in ("latent_in", "latent_out"):  # Nemotron 3 Super's latent projections
            shape = (h, width) if module == "latent_in" else (width, h)
            return shape if leaf == "kernel" else shape[1:]
        if "shared_expert" in path:
            f = fs
        if module == "router" and leaf == "bias":
            return (e,)
        if module in ("router", "shared_expert_gate"):
            return (h, e) if module == "router" else (h, 1)
    gated_q = 2 * q if c.attn_output_gate else q  # each head's query and its gate
    kernels = {"q_proj": (h, gated_q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, f),
               "up_proj": (h, f), "down_proj": (f, h), "lm_head": (h, c.vocab_size), "embed_tokens": (c.vocab_size, h),
               "embed_positions": (c.max_position_embeddings, h)}
    if c.deltanet is not None:
        dn = c.deltanet
        kernels.update(in_proj_q=(h, dn.key_dim), in_proj_k=(h, dn.key_dim), in_proj_v=(h, dn.value_dim),
                       in_proj_z=(h, dn.value_dim), in_proj_b=(h, dn.num_value_heads),
                       in_proj_a=(h, dn.num_value_heads), out_proj=(dn.value_dim, h))
        if dn.gate_rank:  # Kimi's low-rank gates
            kernels.update(f_a_proj=(h, dn.gate_rank), f_b_proj=(dn.gate_rank, dn.key_dim),
                           g_a_proj=(h, dn.gate_rank), g_b_proj=(dn.gate_rank, dn.value_dim))
        if module == "linear_attn":  # the mixer's own parameters
            widths = {"conv_q": dn.key_dim, "conv_k": dn.key_dim, "conv_v": dn.value_dim}
            if leaf in widths:
                return (widths[leaf], 1, dn.conv_kernel)
            if leaf == "dt_bias" and dn.channel_decay:
                return (dn.key_dim,)
            return (dn.value_head_dim,) if leaf == "norm" else (dn.num_value_heads,)
    if c.mamba is not None:
        mb = c.mamba
        kernels.update(in_proj_z=(h, mb.inner), in_proj_xbc=(h, mb.conv_dim), in_proj_dt=(h, mb.num_heads))
        if module == "mamba":  # the mixer's own parameters
            return {"conv": (mb.conv_dim, 1, mb.conv_kernel), "conv_bias": (mb.conv_dim,), "norm": (mb.inner,),
                    "out_proj": (mb.inner, h)}.get(leaf, (mb.num_heads,))
        if module == "out_proj" and path[-3] == "mamba":
            return (mb.inner, h) if leaf == "kernel" else (h,)
    if c.mla is not None:
        m, n = c.mla, c.num_attention_heads
        kernels.update(q_proj=(h, n * m.qk_head_dim), q_a_proj=(h, m.q_lora_rank), q_b_proj=(m.q_lora_rank,
                       n * m.qk_head_dim), kv_a_proj_with_mqa=(h, m.kv_lora_rank + m.qk_rope_head_dim),
                       kv_b_proj=(m.kv_lora_rank, n * (m.qk_nope_head_dim + d)))
        if module in ("q_a_layernorm", "kv_a_layernorm"):
            return (m.q_lora_rank if module == "q_a_layernorm" else m.kv_lora_rank,)
        if "indexer" in path and m.indexer is not None:  # DeepSeek sparse attention's
            ix = m.indexer
            if leaf.startswith("index_kpool"):  # GLM-5-next's k-pool: the gate as a kernel, the per-slot bias
                return (h, ix.head_dim) if leaf == "index_kpool_compress_gate" else (ix.pool, ix.head_dim)
            return {"wq_b": (m.q_lora_rank or 0, ix.num_heads * ix.head_dim), "wk": (h, ix.head_dim),
                    "weights_proj": (h, ix.num_heads)}.get(module, (ix.head_dim,))
    if c.compressed is not None and (shape := _compressed_shape(path, c)) is not None:
        return shape
    if path[0] == "per_layer_inputs" or module.startswith("per_layer"):  # Gemma 4's per-layer embeddings
        width = (c.num_hidden_layers if num_layers is None else num_layers) * c.per_layer_input_size
        return {"embed_tokens_per_layer": (c.per_layer_vocab_size, width), "per_layer_model_projection": (h, width),
                "per_layer_projection_norm": (c.per_layer_input_size,), "per_layer_input_gate":
                (h, c.per_layer_input_size), "per_layer_projection": (c.per_layer_input_size, h)}[module]
    if leaf == "layer_scalar":
        return (1,)
    if c.hyper is not None and c.hyper.kind == "gated" and (shape := _gated_shape(path, c)) is not None:
        return shape
    if c.ngram is not None and "ple" in path:
        return _ngram_shape(path, c)
    if module in HYPER_MODULES and c.hyper is not None:  # [(2 + N) N, N H] transformers' [out, in]; its bias; 3 scales
        n = c.hyper.streams
        return {"fn": ((2 + n) * n, n * h), "base": ((2 + n) * n,)}.get(leaf, (3,))
    if leaf in ("per_expert_scale", "selection_bias"):
        return (c.moe.num_experts,)
    if leaf == "sinks":
        return (c.num_attention_heads,)
    if leaf in ("kernel", "embedding"):
        return kernels[module]
    if leaf == "bias" and module in kernels:
        return kernels[module][1:]
    if module in ("q_norm", "k_norm"):  # per head, or over the whole projection
        return (d,) if c.qk_norm_scope == "head" else ((q,) if module == "q_norm" else (kv,))
    return (h,)


def _gated_shape(path: tuple[str, ...], config: DecoderConfig) -> tuple[int, ...] | None:
    """The shape of a Qwen4-Exp gated residual's parameter (its final collapse's too) or of its QSA
    indexer's; None for the others."""
    c = config
    wide, rank, module = c.hyper.streams * c.hidden_size, c.hyper.rank, path[-2]
    if module == "hc_norm":
        return (wide,)
    shapes = {"input_mix_weight_down": (wide, rank), "input_mix_weight_up": (rank, wide),
              "block_inject_weight": (wide, c.hyper.streams)}
    if module in shapes:
        return shapes[module]
    if "indexer" in path and c.attention_indexer is not None:
        ix = c.attention_indexer
        return (c.hidden_size, (ix.num_heads + 1) * ix.head_dim) if module == "index_qk_proj" else (ix.head_dim,)
    return None


def _ngram_shape(path: tuple[str, ...], config: DecoderConfig) -> tuple[int, ...]:
    """The shape of a hashed n-gram embedding's parameter (``model.ngram.NGramInjection``)."""
    from model.ngram import ngram_constants
    c, g = config, config.ngram
    wide = c.hyper.streams * c.hidden_size
    layer = int(path[0].removeprefix("layers_"))
    leaf = path[-1] if path[-2] == "ple" else path[-2]
    return {"ngram_embedding": (ngram_constants(g, g.rank(layer), c.vocab_size).rows, g.embed_dim // g.heads),
            "key_proj": (g.embed_dim, wide), "value_proj": (g.embed_dim, c.hidden_size),
            "conv1d": (wide, 1, g.conv_kernel)}.get(leaf, (wide,))


def _compressed_shape(path: tuple[str, ...], config: DecoderConfig) -> tuple[int, ...] | None:
    """The shape of a DeepSeek-V4 attention's parameter at ``path`` (its own, its compressors' and its
    indexer's), of a hash router's table, or of the final collapse's; None for the others."""
    c, ca = config, config.compressed
    h, n, d = c.hidden_size, c.num_attention_heads, c.head_dim
    module, leaf = path[-2], path[-1]
    if path[0] == "hc_head":
        streams = c.hyper.streams
        return {"hc_fn": (streams, streams * h), "hc_base": (streams,), "hc_scale": (1,)}[leaf]
    if leaf == "tid2eid":
        return (c.vocab_size, c.moe.top_k)
    if "self_attn" not in path:
        return None
    ix = ca.indexer
    if "compressor" in path:  # [H, W]: W = 2 D where windows overlap (a CSA block's, its indexer's)
        width = ix.head_dim if "indexer" in path else d
        series = 2 if "indexer" in path or ca.kind(int(path[0].removeprefix("layers_"))) == CSA else 1
        return {"position_bias": (ca.csa_rate if series == 2 else ca.hca_rate, series * width),
                "kv_norm": (width,)}.get(module if leaf != "position_bias" else leaf, (h, series * width))
    if "indexer" in path:
        return {"q_b_proj": (ca.q_lora_rank, ix.num_heads * ix.head_dim), "weights_proj": (h, ix.num_heads)}[module]
    return {"q_a_proj": (h, ca.q_lora_rank), "q_b_proj": (ca.q_lora_rank, n * d), "kv_proj": (h, d),
            "o_b_proj": (ca.output_groups * ca.output_rank, h), "q_a_norm": (ca.q_lora_rank,), "kv_norm": (d,),
            "self_attn": {"sinks": (n,), "o_a_proj": (ca.output_groups * ca.output_rank, n * d // ca.output_groups)
                          }.get(leaf)}.get(module)


def read_source(checkpoint: Checkpoint, source: Source, fp8_block: tuple[int, int] | None = None,
                shared: dict | None = None) -> np.ndarray:
    """The values of ``source`` (its part of a fused tensor, copied); ``UserError`` for a fused
    tensor whose size the config's sizes do not give (its parts would be cut in the wrong place)."""
    if source.experts:
        names = [source.name.format(e=e) for e in range(source.experts)]
        if names[0] not in checkpoint:
            fused = source.name.split("{e}")[0] + "gate_up_proj"
            hint = (f" (it holds {fused!r}: transformers 5's fused layout, save_pretrained(..., save_original_format="
                    "False); save it in the per-expert layout)" if fused in checkpoint else "")
            raise UserError(f"checkpoint {checkpoint.model_dir!r} has no tensor {names[0]!r}{hint}")
        return ExpertStack(checkpoint, names, source.transpose, fp8_block=fp8_block)
    if source.stacked:
        return StackedTensor(checkpoint, source, shared=shared, fp8_block=fp8_block)
    if (shards := _row_shards(checkpoint, source)) is not None:
        return RowShards(checkpoint, shards)
    tensor = _saved_tensor(checkpoint, source, fp8_block)
    if source.flattened and tensor.size == max(tensor.shape, default=1):
        tensor = tensor.reshape(-1)
    if source.part is not None:
        axis, indices, size = source.part
        if tensor.ndim <= axis or tensor.shape[axis] != size:
            raise UserError(f"checkpoint tensor {source.name!r} has shape {list(tensor.shape)}, which config.json's "
                            f"sizes do not give (its fused parts make {size} along axis {axis})")
        tensor = np.take(tensor, indices, axis=axis)
    return tensor


def _row_shards(checkpoint: Checkpoint, source: Source) -> list[str] | None:
    """The tensors ``source`` is saved as where they are its row shards, to be read lazily by row
    (``model.row_shards``: Qwen4-Exp's n-gram tables, split by row over a mesh): its name absent and
    its first alternative there several tensors, taken whole (no part, no flattening), none FP8."""
    if source.part is not None or source.flattened:
        return None
    names = _saved_alternative(checkpoint, source)
    if names is None or len(names) < 2 or any(checkpoint.dtype(name) in fp8.QUANTIZED for name in names):
        return None
    return list(names)


def _saved_alternative(checkpoint: Checkpoint, source: Source) -> tuple[str, ...] | None:
    """Where ``source.name`` is absent, the first of its alternatives the checkpoint holds whole."""
    if source.name in checkpoint:
        return None
    return next((names for names in source.alternatives if all(name in checkpoint for name in names)), None)


def _saved_tensor(checkpoint: Checkpoint, source: Source, fp8_block: tuple[int, int] | None) -> np.ndarray:
    """Tensor ``source.name``, or where it is absent the first of its alternatives the checkpoint
    holds, concatenated; ``UserError`` naming ``source.name`` where none is there."""
    if (names := _saved_alternative(checkpoint, source)) is not None:
        return np.concatenate([fp8.read(checkpoint, name, fp8_block) for name in names], axis=0)
    return fp8.read(checkpoint, source.name, fp8_block)


def resolved(checkpoint: Checkpoint, source: Source, layout: Layout) -> Source:
    """``source`` with the names the layout's renamings give it as alternatives, and, where its name
    is absent and one of its one-tensor alternatives is there, named as that one (the experts' tensors
    one an expert: read as that alternative's stack of them all, ``Source.stacked``); a stacked tensor
    absent with its experts' tensors one an expert there, as those (``Source.per_expert``)."""
    if source.per_expert is not None and source.name not in checkpoint \
            and source.per_expert.name.format(e=0) in checkpoint:
        return source.per_expert
    renamed = [source.name.replace(ours, theirs) for ours, theirs in (layout.renamed or {}).items()
               if ours in source.name]
    source = dataclasses.replace(source, alternatives=source.alternatives + tuple((name,) for name in renamed))
    present = next((names[0] for names in source.alternatives if len(names) == 1 and names[0] in checkpoint), None)
    if present is None or (source.name.format(e=0) if source.experts else source.name) in checkpoint:
        return source
    if source.experts:  # one tensor an expert absent: their alternative stacked [E, ...]
        return dataclasses.replace(source, name=present, experts=0, stacked=True, alternatives=())
    return dataclasses.replace(source, name=present, alternatives=())


def _placed(source: np.ndarray, transpose: bool, path: tuple[str, ...], mesh: Mesh,
            dtype: jnp.dtype, config: DecoderConfig) -> jax.Array:
    shape = source.shape[::-1] if transpose else source.shape
    sharding = param_sharding(path, shape, mesh, config)

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        part = source[index[::-1]].T if transpose else source[index]
        return np.ascontiguousarray(part, dtype=dtype)

    return jax.make_array_from_callback(shape, sharding, shard)


V4_FLOAT32_NORMS = tuple((norm, "weight") for norm in ("q_a_norm", "kv_norm", "pre_attention_norm", "pre_mlp_norm",
                                                         "norm"))


def param_dtype(path: tuple[str, ...], config: DecoderConfig, dtype: Any) -> Any:
    """The dtype the parameter at ``path`` is held in: ``dtype``, but float32 for a router that
    computes in it (DeepSeek's, ``MoE.router_in_float32``: transformers keeps it so) and its bias,
    a DeltaNet mixer's ``float32_params`` and a hyper-connection's bias and scales."""
    router = config.moe is not None and config.moe.router_in_float32 and (
        path[-2:] == ("router", "kernel") or path[-1] == "selection_bias")
    # A DeltaNet mixer's that transformers keeps in float32 (Kimi's dt_bias; GLM-5-next's convolutions and A_log too).
    mixer = config.deltanet is not None and path[-2:-1] == ("linear_attn",) and \
        path[-1] in config.deltanet.float32_params
    # A hyper-connection's bias and scales (float32 in transformers; its projection fn is the model's dtype).
    connection = len(path) > 1 and path[-2] in HYPER_MODULES and path[-1] in ("base", "scale")
    if path[-1] == "tid2eid":  # a hash router's table of expert ids
        return jnp.dtype(jnp.int32)
    # DeepSeek-V4's that transformers keeps in float32: the sinks, the compressors' position biases, the
    # choice bias, the hyper-connections whole (fn too) and the final collapse, every RMSNorm's weight.
    compressed = config.compressed is not None and (path[-1] in ("sinks", "position_bias", "selection_bias")
                                                    or path[0] == "hc_head" or path[-2:] in V4_FLOAT32_NORMS
                                                    or len(path) > 1 and path[-2] in HYPER_MODULES)
    return jnp.dtype(jnp.float32) if router or mixer or connection or compressed else dtype


def load_params(checkpoint: Checkpoint, config: DecoderConfig, mesh: Mesh, dtype: Any,
                num_layers: int | None = None, with_head: bool = False) -> dict:
    """The parameter tree for blocks ``0..num_layers-1`` (all by default), sharded over ``mesh``.

    ``with_head`` also loads the final norm and LM head (needed for generation only).
    """
    num_layers = config.num_hidden_layers if num_layers is None else num_layers
    dtype = jnp.dtype(dtype)
    tree: dict = {}
    prefix = text_prefix(checkpoint, layout_of(config))
    shared: tuple[str, dict] = ("", {})  # a stacked tensor's ranges read, while its parts are loaded
    for path, source in param_names(config, num_layers, with_head, prefix):
        source = resolved(checkpoint, source, layout_of(config))
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        if source.name != shared[0]:
            shared = (source.name, {})
        values = read_source(checkpoint, source, config.weight_block_size, shared[1])
        transpose = source.transpose and not (source.experts or source.stacked)  # in their final layout already
        shape = values.shape[::-1] if transpose else values.shape
        expected = expected_shape(path, config, num_layers)
        if tuple(shape) != expected:
            what = f"checkpoint tensor {source.name!r}" if not source.experts else f"the {source.name!r} stack"
            raise UserError(f"{what} has shape {list(values.shape)}, which config.json's "
                            f"sizes do not give ({list(expected[::-1 if transpose else 1])})")
        if source.experts or source.stacked:  # all-zero experts past the real ones
            values = values.padded(expert_slots(config, mesh))
        node[path[-1]] = _placed(values, transpose, path, mesh, param_dtype(path, config, dtype), config)
    return tree
