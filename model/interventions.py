"""The arrays by which the compiled forward removes, replaces or steers a model's components: one
set per intervention, the same shapes for every intervention of a model, so that one compiled
forward per batch shape serves a whole grid.

Per block, for each component (``COMPONENTS``: an attention head, the attention and MLP outputs,
the block itself, its norms) whether it is kept and, where it is not, whether its mean replaces it
(else zero, or for a norm a neutral weight); the means (``Means``); for a mixture of experts the
experts kept and the expert every token is sent to; what steerings add at each site they steer
(``steer_key``: the forward computes no steering at a site without one) and, per batch, the tokens
they add to (``STEER_TOKENS``); what patches put in place of a site's value (or of a head's slice
of ``attn.hook_z``), in slots of one block per batch row (``patch_key``), and a zero array added at a site
whose gradient attribution patching takes (``delta_key``). Which components a spec names, where
a steering's direction comes from and which tokens it chooses are decided above the model
(``interventions/``).
"""

from __future__ import annotations

import dataclasses
import io
import os

import numpy as np

from common.cli import UserError
from common.files import read_optional, write_bytes
from model.config import DecoderConfig
from model.sites import (ATTN_OUT, ATTN_Z, HC_ATTN_COLLAPSE, HC_MLP_COLLAPSE, MLP_OUT, RESID_MID, RESID_POST,
                         RESID_PRE, RESIDUAL, SSM_OUT)

# What a block's arrays can remove or replace: one attention head's output (its slice of the
# o_proj input), the attention output, the MLP output, the block's contribution (the residual
# passes through it unchanged), its norms' weights.
COMPONENTS = ("head", "attn", "mlp", "block", "norm")
# The per-batch entry of an intervention's arrays, beside the per-block ones: [B, S] bool, which
# tokens its steerings add to; absent, every token.
STEER_TOKENS = "steer_tokens"
# Where a steering may add its direction, in block order: the block's input, attention's addition,
# the stream between, the MLP's addition, the block's output, and with hyper-connections what each
# sublayer reads of the streams. Each is its site's width (model.sites.site_width: the residual's
# every stream with hyper-connections, else hidden) and flows on through the stream.
STEER_SITES = (RESID_PRE, HC_ATTN_COLLAPSE, ATTN_OUT, SSM_OUT, RESID_MID, HC_MLP_COLLAPSE, MLP_OUT, RESID_POST)
# (SSM_OUT: Falcon-H1's alone; the collapses: GLM-5-next's)
# Where a patch may put a clean run's value: the stream sites, and the attention heads' outputs per head.
PATCH_SITES = (*STEER_SITES, ATTN_Z)
# The names of a patch's arrays at a site (``patch_key``): its values, what they replace, each slot's block.
PATCH_VALUES, PATCH_TOKENS, PATCH_LAYERS = "patch@", "patch_tokens@", "patch_layers@"


@dataclasses.dataclass
class Means:
    """Means over a stream's real tokens under the unablated model, per block: what ``mean`` mode
    puts in place of a component."""
    head: np.ndarray    # [L, N, D] each head's output (its slice of the o_proj input)
    attn: np.ndarray    # [L, H] attention output
    mlp: np.ndarray     # [L, H] MLP output
    block: np.ndarray   # [L, H] the block's contribution: its output minus its input
    tokens: int         # tokens averaged over

    def save(self, path: str) -> None:
        """Writes ``path`` (local: atomically, so a crash never leaves half a file to reuse)."""
        out = io.BytesIO()
        np.savez(out, head=self.head, attn=self.attn, mlp=self.mlp, block=self.block, tokens=self.tokens)
        if "://" in path:
            write_bytes(path, out.getvalue())
            return
        write_bytes(path + ".tmp", out.getvalue())
        os.replace(path + ".tmp", path)

    @classmethod
    def load(cls, path: str) -> "Means":
        data = read_optional(path)
        if data is None:
            raise UserError(f"no means file at {path!r} (runners.ablate writes means.npz)")
        try:
            arrays = np.load(io.BytesIO(data))
            return cls(arrays["head"], arrays["attn"], arrays["mlp"], arrays["block"], int(arrays["tokens"]))
        except Exception as e:  # not an npz, truncated, keys missing
            raise UserError(f"{path!r} is not a means file of runners.ablate: {e}") from None

    def check(self, config: DecoderConfig, num_layers: int) -> None:
        """``UserError`` unless these are means of this model's shape."""
        c = config
        expected = {"head": (c.num_attention_heads, c.max_head_dim), "attn": (c.hidden_size,),
                    "mlp": (c.hidden_size,), "block": (c.residual_width,)}
        for name, shape in expected.items():
            array = getattr(self, name)
            if array.shape[1:] != shape or array.shape[0] < num_layers:
                raise UserError(f"the means file holds {name} means of shape {array.shape}: not of this model "
                                f"({num_layers} blocks, per block {shape})")


def kept_arrays(config: DecoderConfig, num_layers: int, means: Means | None = None) -> dict[str, np.ndarray]:
    """The arrays of blocks ``0..num_layers-1`` with every component kept (the unablated model's),
    with ``means`` (views, shared by every intervention's arrays) or zeros in their place."""
    n, d, h = config.num_attention_heads, config.max_head_dim, config.hidden_size  # heads padded to the widest
    arrays = {"head_keep": np.ones((num_layers, n), bool), "head_fill": np.zeros((num_layers, n), bool)}
    for kind in COMPONENTS[1:]:
        arrays[f"{kind}_keep"] = np.ones(num_layers, bool)
        arrays[f"{kind}_fill"] = np.zeros(num_layers, bool)
    if config.moe is not None:
        arrays["expert_keep"] = np.ones((num_layers, config.moe.num_experts), bool)  # [L, E]
        arrays["route_to"] = np.full(num_layers, -1, np.int32)  # [L]: the expert every token goes to, or -1
    if means is not None:
        means.check(config, num_layers)
        arrays.update({f"{kind}_mean": getattr(means, kind)[:num_layers] for kind in ("head", "attn", "mlp", "block")})
    else:
        arrays["head_mean"] = np.zeros((num_layers, n, d), np.float32)    # [L, N, D]
        arrays.update({f"{kind}_mean": np.zeros((num_layers, h), np.float32) for kind in ("attn", "mlp")})
        arrays["block_mean"] = np.zeros((num_layers, config.residual_width), np.float32)  # every stream's
    return arrays


def remove(arrays: dict[str, np.ndarray], kind: str, layer: int, head: int | None = None,
           by_mean: bool = False) -> None:
    """Block ``layer``'s component ``kind`` (``COMPONENTS``; a head's index ``head``) removed in
    ``arrays``: zeroed (a norm: a neutral weight), or with ``by_mean`` replaced by its mean."""
    where = (layer, head) if kind == "head" else layer
    arrays[f"{kind}_keep"][where] = False
    arrays[f"{kind}_fill"][where] = by_mean


def remove_expert(arrays: dict[str, np.ndarray], layer: int, expert: int) -> None:
    """Expert ``expert`` of block ``layer`` removed: its router logit is -inf, so the router picks
    its top k among the others."""
    arrays["expert_keep"][layer, expert] = False


def route_to(arrays: dict[str, np.ndarray], layer: int, expert: int) -> None:
    """Every token of block ``layer`` sent to expert ``expert`` alone, with weight 1."""
    arrays["route_to"][layer] = expert


def add_steering(arrays: dict[str, np.ndarray], site: str, layer: int, vector: np.ndarray) -> None:
    """``vector`` [hidden] added to what block ``layer`` has at ``site`` (``STEER_SITES``), on top of
    what other steerings add there."""
    num_layers, width = len(arrays["block_keep"]), len(vector)
    steer = arrays.setdefault(steer_key(site), np.zeros((num_layers, width), np.float32))  # [L, H]
    steer[layer] += vector.astype(np.float32)


def steer_key(site: str) -> str:
    """The name, among an intervention's arrays, of what its steerings add at ``site`` (absent
    where none adds there: the forward then computes no steering at that site)."""
    return f"steer@{site}"


def add_patch(arrays: dict[str, np.ndarray], site: str, layer: int, values: np.ndarray, tokens: np.ndarray) -> None:
    """Block ``layer``'s value at ``site`` (``STEER_SITES``: a patch of ``attn.hook_z`` is
    ``add_head_patch``'s) replaced by ``values`` [B, S, hidden] at
    the ``tokens`` [B, S] (bool) of each row of a batch: activation patching, the clean run's value
    put into the corrupted run. Patches at other blocks of the same site add to the same arrays
    (``patch_key``: slots of one block a row, not every block's)."""
    _add_to_slots(arrays, site, layer, values, tokens, tokens[..., None])


def add_head_patch(arrays: dict[str, np.ndarray], layer: int, values: np.ndarray, chosen: np.ndarray) -> None:
    """Block ``layer``'s attention heads' outputs (``attn.hook_z``, [B, S, N*D]) replaced by
    ``values`` at the (token, head)s ``chosen`` [B, S, N] (bool) of each row of a batch. ``values``
    of the block's own head size D or padded to the widest (``padded_heads``): the slots hold every
    block's padded, as the means are."""
    heads, widest = chosen.shape[-1], arrays["head_mean"].shape[-1]  # kept_arrays pads the means to the widest
    values = padded_heads(values, heads, widest)  # [B, S, N*widest]
    per_head = np.repeat(chosen, widest, axis=-1)  # [B, S, N*widest]
    _add_to_slots(arrays, ATTN_Z, layer, values, chosen, per_head)


def padded_heads(values: np.ndarray, heads: int, width: int) -> np.ndarray:
    """Per-head values [..., N*D] (``attn.hook_z`` of a block whose heads are D wide) with each
    head's slice zero-padded to ``width`` -> [..., N*width]: how a patch's values and attribution's
    delta lie over blocks of other head sizes (Gemma 4's full-attention blocks); the forward reads
    each block's first D of every head (``model.heads.heads_output``)."""
    d = values.shape[-1] // heads
    if d == width:
        return values
    split = values.reshape(*values.shape[:-1], heads, d)  # [..., N, D]
    padded = np.pad(split, [(0, 0)] * (split.ndim - 1) + [(0, width - d)])  # [..., N, width]
    return padded.reshape(*values.shape[:-1], heads * width)


def _add_to_slots(arrays: dict[str, np.ndarray], site: str, layer: int, values: np.ndarray, where: np.ndarray,
                  elementwise: np.ndarray) -> None:
    """Each row's patch at ``layer`` into the first slot of that row free or already at ``layer``
    (a new slot where none is): ``where`` [B, S(, N)] what it replaces, ``elementwise`` the same
    broadcast over ``values``' [B, S, W]."""
    key, where_key, layers_key = patch_key(site)
    rows, length, width = values.shape
    if key not in arrays:
        reserve_patch_slots(arrays, site, 0, rows, length)
    for row in np.flatnonzero(where.reshape(rows, -1).any(axis=1)):
        free = np.flatnonzero((arrays[layers_key][:, row] == layer) | (arrays[layers_key][:, row] == -1))
        if not len(free):  # every slot of this row holds another block: one more slot for all rows
            arrays[key] = np.concatenate([arrays[key], np.zeros((1, rows, length, width), np.float32)])
            arrays[where_key] = np.concatenate([arrays[where_key], np.zeros((1, *where.shape), bool)])
            arrays[layers_key] = np.concatenate([arrays[layers_key], np.full((1, rows), -1, np.int32)])
            free = [len(arrays[layers_key]) - 1]
        slot = free[0]
        arrays[key][slot, row] = np.where(elementwise[row], values[row], arrays[key][slot, row])
        arrays[where_key][slot, row] |= where[row]
        arrays[layers_key][slot, row] = layer


def reserve_patch_slots(arrays: dict[str, np.ndarray], site: str, slots: int, rows: int, length: int) -> None:
    """Empty patch arrays at ``site`` (``patch_key``) of ``slots`` slots for a batch of ``rows`` x
    ``length`` tokens, patching nothing until patches fill them: batches given the same slots are of
    one shape and structure whatever blocks (or none) they patch, so one compiled forward serves them."""
    key, where_key, layers_key = patch_key(site)
    heads = arrays["head_keep"].shape[1]
    if site == ATTN_Z:  # every head padded to the widest (kept_arrays' means are)
        width, where = heads * arrays["head_mean"].shape[-1], (slots, rows, length, heads)
    else:  # a residual site every stream wide (hyper-connections' streams: the block means' width)
        width = arrays["block_mean" if site in RESIDUAL else "attn_mean"].shape[-1]
        where = (slots, rows, length)
    arrays[key] = np.zeros((slots, rows, length, width), np.float32)  # [K, B, S, W]
    arrays[where_key] = np.zeros(where, bool)                           # [K, B, S(, N)]
    arrays[layers_key] = np.full((slots, rows), -1, np.int32)           # [K, B]: each slot's block, -1 none


def patch_key(site: str) -> tuple[str, str, str]:
    """The names, among an intervention's arrays, of a patch's values at ``site`` [K, B, S, W], the
    tokens (for ``attn.hook_z``, the token and head) it replaces [K, B, S(, N)] and the block each
    slot patches [K, B] (-1: none), absent where nothing is patched there (the forward then
    computes no patch at that site). A row patching K blocks of a site holds K slots, so the arrays
    grow with the blocks a row patches, not with the model's depth."""
    return PATCH_VALUES + site, PATCH_TOKENS + site, PATCH_LAYERS + site


def block_arrays(arrays: dict[str, np.ndarray], layer: int) -> dict:
    """Block ``layer``'s slice of an intervention's arrays (the forward's per-block input): each
    per-block array's row ``layer``; the per-batch ones whole; a patch's values whole, with the
    tokens of only the slots that patch this block."""
    out = {}
    for name, array in arrays.items():
        if name == STEER_TOKENS or name.startswith(PATCH_VALUES):
            out[name] = array
        elif name.startswith(PATCH_TOKENS):
            at_block = arrays[PATCH_LAYERS + name[len(PATCH_TOKENS):]] == layer  # [K, B]
            out[name] = array & at_block.reshape(at_block.shape + (1,) * (array.ndim - 2))
        elif not name.startswith(PATCH_LAYERS):
            out[name] = array[layer]
    return out


def delta_key(site: str) -> str:
    """The name of a [L, B, S, width] array added at ``site`` (zero: nothing changes), whose
    gradient is the metric's with respect to the site's value: attribution patching's (at
    ``attn.hook_z``, width N * the widest head: each block reads its heads' first D,
    ``padded_heads``)."""
    return f"delta@{site}"


def steered_token_mask(positions: list[np.ndarray | None] | tuple, rows: int, length: int) -> np.ndarray:
    """[rows, length] bool, the ``STEER_TOKENS`` input of a batch: per sequence the positions its
    steerings add to (rows past them, and padding, False)."""
    mask = np.zeros((rows, length), bool)
    for row, chosen in enumerate(positions):
        mask[row, chosen] = True
    return mask
