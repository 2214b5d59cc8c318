"""Activation patching: run a corrupted prompt with one site's value, at one block and position (or
one head at one position), put back as the clean prompt had it, and measure how much of the clean
answer returns. One grid per site, laid out as TransformerLens's ``patching`` functions lay theirs:

    get_act_patch_resid_pre / resid_mid / attn_out / mlp_out    [layers, positions]
    get_act_patch_attn_head_out_by_pos (attn.hook_z)            [layers, positions, heads]

Every cell is one row of a batched forward of the corrupted prompt (``model.interventions.add_patch``:
the patched value replaces the site's value at the cell's token, and flows on from there), scored by
the metric: the logit difference of the answer over the wrong answer at the last position
(``logit_diff``), or its normalized form, 0 at the corrupted run and 1 at the clean one.

The clean values come from the clean run (``clean_values``) or, the point of a store, from what a
run stored at the site for the pair's clean sample (``stored_values``). Attribution patching
estimates every cell from one forward and one backward of the corrupted prompt
(``attribution_metrics``). Beyond the grids, a cell is any set of ``Patch``es: the cells of an
intervention of the spec language's ``patch:`` atoms on one pair are ``cells``; an experiment over
a dataset of pairs is ``ablation.patching_run``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from activations.index import arrays_path
from activations.reader import read_activations
from common.cli import UserError
from interventions.resolve import steered_positions
from interventions.spec import Atom, Intervention
from model.config import DecoderConfig
from model.decoder import Decoder
from model.extract import sown_value
from model.interventions import PATCH_SITES, add_head_patch, add_patch, delta_key, kept_arrays, padded_heads, \
    reserve_patch_slots
from model.loading import LoadedModel
from model.scoring import causal_mask
from model.sites import (ATTN_Z, RESID_POST, RESID_PRE, array_key, describe_key, hook_name, missing_reason,
                         site_width)

ROWS_PER_FORWARD = 32  # cells patched in one batched forward


@dataclasses.dataclass(frozen=True)
class Pair:
    """A clean and a corrupted prompt, and the answer tokens the metric compares (the clean prompt's
    answer, and the corrupted one's). Of one length, unless every patch chooses its tokens by role."""
    clean: tuple[int, ...]
    corrupted: tuple[int, ...]
    answer: int   # the clean prompt's answer
    wrong: int    # the corrupted prompt's answer
    name: str = ""                       # the pair's id, for messages
    clean_sample: int | None = None      # the clean prompt's sample id: where a store holds its values
    corrupted_sample: int | None = None
    clean_roles: Any = None              # role runs (common.roles), for a patch's tokens=
    corrupted_roles: Any = None

    def equal_lengths(self) -> None:
        """``UserError`` unless the two prompts are of one length (patching position by position)."""
        if len(self.clean) != len(self.corrupted):
            raise UserError(f"pair {self.name!r}: the clean prompt has {len(self.clean)} tokens, the corrupted "
                            f"{len(self.corrupted)}: patching position by position needs equal lengths (or "
                            "tokens= choosing tokens of equal roles and counts)")


@dataclasses.dataclass(frozen=True)
class Patch:
    """One site of one block patched in a cell: the corrupted prompt's ``positions`` take the clean
    prompt's values at ``sources`` (for ``attn.hook_z``, only ``head``'s slice; None: every head's)."""
    site: str
    layer: int
    head: int | None
    positions: tuple[int, ...]
    sources: tuple[int, ...]


Cell = tuple[Patch, ...]  # the patches one row of a forward applies together


def chosen_positions(atom: Atom, pair: Pair) -> tuple[np.ndarray, np.ndarray]:
    """(the corrupted prompt's positions, the clean prompt's) a patch acts on before its pos=: every
    position of prompts of one length, or with tokens= the tokens of those roles, i-th to i-th."""
    if not atom.tokens:
        pair.equal_lengths()
        every = np.arange(len(pair.corrupted))
        return every, every
    corrupted = steered_positions(atom.tokens, pair.corrupted_roles, len(pair.corrupted), pair.corrupted_sample)
    clean = steered_positions(atom.tokens, pair.clean_roles, len(pair.clean), pair.clean_sample)
    if len(corrupted) != len(clean):
        raise UserError(f"pair {pair.name!r}: tokens={atom.tokens} chooses {len(clean)} tokens of the clean prompt "
                        f"and {len(corrupted)} of the corrupted: a patch puts the i-th in place of the i-th")
    return corrupted, clean


def cells(intervention: Intervention, pair: Pair) -> list[tuple[Intervention, Cell]]:
    """(its own intervention, the cell) of each cell an intervention of patches stands for on one
    pair: one, or one per position of its pos= grid (``pos=*``: each position chosen, the cell's
    pos= its number among them)."""
    options = []  # per atom: (the atom with its position, the patch)
    for atom in intervention.atoms:
        corrupted, clean = chosen_positions(atom, pair)
        if not atom.position:
            options.append([(atom, Patch(atom.site, atom.layer, atom.head, tuple(corrupted.tolist()),
                                         tuple(clean.tolist())))])
            continue
        numbers = atom.positions(len(corrupted))
        if numbers and numbers[-1] >= len(corrupted):
            raise UserError(f"pair {pair.name!r}: {atom} patches position {numbers[-1]} of {len(corrupted)} "
                            "(numbered from 0 among the tokens chosen)")
        options.append([(dataclasses.replace(atom, position=str(i)),
                         Patch(atom.site, atom.layer, atom.head, (int(corrupted[i]),), (int(clean[i]),)))
                        for i in numbers])
    out = []
    for chosen in itertools.product(*options):
        own, cell = Intervention(tuple(atom for atom, _ in chosen)), tuple(patch for _, patch in chosen)
        if len(cell) > 1:
            _refuse_overlap(own, cell)
        out.append((own, cell))
    return out


def _refuse_overlap(own: Intervention, cell: Cell) -> None:
    """``UserError`` for a cell whose patches put two values at one (site, block, position, head):
    exact patching would keep one, attribution would count both."""
    taken: dict[tuple[str, int, int], set] = {}
    for patch in cell:
        for position in patch.positions:
            heads = taken.setdefault((patch.site, patch.layer, position), set())
            if patch.head is None and heads or patch.head in heads or None in heads:
                raise UserError(f"intervention {own.name!r} patches block {patch.layer}'s {patch.site} at position "
                                f"{position} twice")
            heads.add(patch.head)


def grid_cells(site: str, layers: int, length: int, heads: int | None) -> list[Cell]:
    """The cells of TransformerLens's grid of one site, in its order: each (block, position), or
    for ``attn.hook_z`` each (block, position, head)."""
    return [(Patch(site, layer, head, (position,), (position,)),) for layer in range(layers)
            for position in range(length) for head in (range(heads) if heads else [None])]


@functools.lru_cache(maxsize=4)
def _forward(config: DecoderConfig, patched: bool):
    """(params, ids [B, S], arrays) -> (the last position's logits [B, V], every block's output,
    the sown sites); one jitted program per model, compiled per batch shape."""
    decoder, layers = Decoder(config, jnp.float32), config.num_hidden_layers

    def run(params, ids, arrays):
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1])[None], ids.shape)  # [B, S]
        mask = causal_mask(jnp.full(ids.shape[0], ids.shape[1]), ids.shape[1])
        (outputs, _), state = decoder.apply({"params": params}, ids, positions, mask, layers,
                                            ablation=arrays if patched else None, mutable=["sites"])
        logits = decoder.apply({"params": params}, outputs[-1][:, -1], method=Decoder.logits)  # [B, V]
        sown = state["sites"]  # only what a grid reads leaves the program, not every site the blocks sow
        blocks = {name: _patch_sites(block) for name, block in sown.items() if name.startswith("layers_")}
        return logits, outputs, {"embeddings": sown["embeddings"], **blocks}

    return jax.jit(run)


def _patch_sites(block: dict) -> dict:
    """A block's sown sites (a module's own nested under its name) trimmed to ``PATCH_SITES``."""
    return {name: {site: v for site, v in value.items() if site in PATCH_SITES} if isinstance(value, dict) else value
            for name, value in block.items() if isinstance(value, dict) or name in PATCH_SITES}


def site_values(config: DecoderConfig, outputs: list, sites: dict, site: str) -> np.ndarray:
    """[L, B, S, W]: what every block had at ``site``, from a forward's outputs and sown sites (at
    ``attn.hook_z`` each head padded to the widest, ``padded_heads``: W = N * the widest head;
    zeros at a Gated DeltaNet block, which has no heads to patch, and at a block without the site)."""
    layers = config.num_hidden_layers
    if site == RESID_POST:
        return np.stack([np.asarray(o) for o in outputs])
    if site == RESID_PRE:
        return np.stack([np.asarray(sites["embeddings"][0])] + [np.asarray(o) for o in outputs[:layers - 1]])
    if site == ATTN_Z:
        n, widest = config.num_attention_heads, config.max_head_dim
        none = np.zeros((*outputs[0].shape[:2], n * widest), np.float32)  # [B, S, N*widest]
        return np.stack([none if config.is_recurrent(i) or not config.has_mixer(i) else
                         padded_heads(np.asarray(sown_value(sites[f"layers_{i}"], site)), n, widest)
                         for i in range(layers)])
    # zeros at a block without the site (Nemotron-H's blocks of one sublayer)
    none = np.zeros((*outputs[0].shape[:2], config.hidden_size), np.float32)  # [B, S, H]
    return np.stack([none if missing_reason(site, config, i) else np.asarray(sown_value(sites[f"layers_{i}"], site))
                     for i in range(layers)])


def clean_values(loaded: LoadedModel, prompt: tuple[int, ...], site: str) -> np.ndarray:
    """[L, S, W]: a prompt's value at ``site`` in every block (``site_values``)."""
    _check_site(loaded.config, site)
    _, outputs, sites = _forward(loaded.config, False)(loaded.params, jnp.asarray([prompt]), None)
    return site_values(loaded.config, outputs, sites, site)[:, 0]


def values_by_block(values: np.ndarray | Sequence[np.ndarray], site: str) -> dict[tuple[str, int], np.ndarray]:
    """{(site, block): [S, W]} of one site's values, [L, S, W] or one [S, W] per block (at
    ``attn.hook_z``, each block's own width or padded to the widest): what the metrics below patch from."""
    return {(site, layer): value for layer, value in enumerate(values)}


def _check_site(config: DecoderConfig, site: str) -> None:
    """``UserError`` for a site some block lacks (``attn.hook_z`` of a Gated DeltaNet block): a
    grid covers every block."""
    reason = next((r for layer in range(config.num_hidden_layers) if (r := missing_reason(site, config, layer))), None)
    if reason:
        raise UserError(f"no grid of {site} over every block: {reason}")


def checked_values(config: DecoderConfig, pair: Pair, values: Mapping[tuple[str, int], np.ndarray]
                   ) -> dict[tuple[str, int], np.ndarray]:
    """``values`` ({(site, block): the clean prompt's [S, W]}) as the metrics read them (float32,
    ``attn.hook_z`` padded to the widest head); ``UserError`` in one line for values of another
    number of tokens than the pair's clean prompt (another tokenization: a BOS more or less), of
    another width than the block's, or at a block without the site."""
    out = {}
    for (site, layer), value in values.items():
        value = np.asarray(value, np.float32)
        name = hook_name(site, layer)
        if reason := missing_reason(site, config, layer):
            raise UserError(f"pair {pair.name!r}: no patch at {name}: {reason}")
        if value.ndim != 2 or value.shape[0] != len(pair.clean):
            raise UserError(f"pair {pair.name!r}: the clean values at {name} are of shape {value.shape}, the clean "
                            f"prompt has {len(pair.clean)} tokens: values of another tokenization (pipeline.prepare's "
                            "and ablation.patching.pairs_from_rows' put the same BOS in front)")
        n, head = config.num_attention_heads, config.layer_config(layer).head_dim
        widths = (n * head, n * config.max_head_dim) if site == ATTN_Z else (site_width(site, config, layer),)
        if value.shape[1] not in widths:
            raise UserError(f"pair {pair.name!r}: the clean values at {name} are {value.shape[1]} wide, the block's "
                            f"are {widths[0]}: values of another model")
        out[site, layer] = padded_heads(value, n, config.max_head_dim) if site == ATTN_Z else value
    return out


def logit_diff(logits: np.ndarray, pair: Pair) -> np.ndarray:
    """[B]: the answer's logit minus the wrong answer's, at the last position (``logits`` [B, V])."""
    logits = np.asarray(logits, np.float64)
    return logits[:, pair.answer] - logits[:, pair.wrong]


def baselines(loaded: LoadedModel, pair: Pair) -> tuple[float, float]:
    """(the clean run's logit difference, the corrupted run's), a forward each: the program of one
    row that ``clean_values`` and ``attribution_metrics`` run too (a batch of both would be one more)."""
    forward = _forward(loaded.config, False)
    logits = np.concatenate([forward(loaded.params, jnp.asarray([prompt]), None)[0]
                             for prompt in (pair.clean, pair.corrupted)])  # [2, V]
    clean, corrupted = logit_diff(logits, pair)
    return float(clean), float(corrupted)


def normalize(metric: np.ndarray, clean: float, corrupted: float) -> np.ndarray:
    """The metric as a fraction of the way from the corrupted run (0) to the clean one (1); NaN
    where the two runs agree (no way to go)."""
    metric = np.asarray(metric, np.float64)
    if clean == corrupted:
        return np.full(metric.shape, np.nan)
    return (metric - corrupted) / (clean - corrupted)


def exact_metrics(loaded: LoadedModel, pair: Pair, patched: Sequence[Cell],
                  values: Mapping[tuple[str, int], np.ndarray]) -> np.ndarray:
    """[cells]: the corrupted run's logit difference with each cell patched from ``values``
    ({(site, block): the clean prompt's [S, W]}, ``checked_values``), ``ROWS_PER_FORWARD`` cells a
    forward. Every forward of a call carries the patch arrays of every site its cells patch, with
    as many slots as the most blocks of a site one cell patches: one compiled program a call, of
    any mix of sites (per prompt length, sites and slots)."""
    values = checked_values(loaded.config, pair, values)
    slots: dict[str, int] = {}  # site -> the most blocks of it one cell patches
    for cell in patched:
        for site in {patch.site for patch in cell}:
            slots[site] = max(slots.get(site, 0), len({patch.layer for patch in cell if patch.site == site}))
    return np.concatenate([np.zeros(0)] + [_patched_forward(loaded, pair, patched[i:i + ROWS_PER_FORWARD], values,
                                                            slots)
                                           for i in range(0, len(patched), ROWS_PER_FORWARD)])


def _patched_forward(loaded: LoadedModel, pair: Pair, patched: Sequence[Cell],
                     values: Mapping[tuple[str, int], np.ndarray], slots: Mapping[str, int]) -> np.ndarray:
    """The metric of one forward whose row r patches cell r, with ``slots`` empty slots at each site
    to fill (the rows past the cells, and the slots no cell of this forward fills, patch nothing)."""
    c = loaded.config
    layers, length, rows, heads = c.num_hidden_layers, len(pair.corrupted), ROWS_PER_FORWARD, c.num_attention_heads
    arrays: dict[str, Any] = kept_arrays(c, layers)
    for site, count in slots.items():
        reserve_patch_slots(arrays, site, count, rows, length)
    batch: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}  # (site, block) -> (values, where)
    for row, cell in enumerate(patched):
        for patch in cell:
            clean = values[patch.site, patch.layer]  # [S_clean, W]
            if (patch.site, patch.layer) not in batch:
                where_shape = (rows, length, heads) if patch.site == ATTN_Z else (rows, length)
                batch[patch.site, patch.layer] = (np.zeros((rows, length, clean.shape[-1]), np.float32),  # [B, S, W]
                                                  np.zeros(where_shape, bool))
            put, where = batch[patch.site, patch.layer]
            put[row, list(patch.positions)] = clean[list(patch.sources)]
            if patch.site == ATTN_Z:
                where[row, list(patch.positions), slice(None) if patch.head is None else patch.head] = True
            else:
                where[row, list(patch.positions)] = True
    for (site, layer), (put, where) in batch.items():
        if site == ATTN_Z:
            add_head_patch(arrays, layer, put, where)
        else:
            add_patch(arrays, site, layer, put, where)
    ids = jnp.asarray(np.broadcast_to(np.asarray(pair.corrupted), (rows, length)))
    logits, _, _ = _forward(c, bool(slots))(loaded.params, ids, arrays if slots else None)
    return logit_diff(logits, pair)[:len(patched)]


def patching_grid(loaded: LoadedModel, pair: Pair, site: str, values: np.ndarray | None = None,
                  normalized: bool = False) -> np.ndarray:
    """The grid of one site: [L, S] (a stream site, each (block, position) patched alone) or, for
    ``attn.hook_z``, [L, S, N] (each head at each position), of the corrupted run's logit difference
    with the clean value put back there (``normalized``: 0 corrupted, 1 clean). ``values``
    [L, S, W] or one [S, W] per block: the clean prompt's values at ``site`` (default: from its
    run; ``checked_values`` refuses another length or width in one line)."""
    pair.equal_lengths()
    c = loaded.config
    _check_site(c, site)
    values = clean_values(loaded, pair.clean, site) if values is None else values
    heads = c.num_attention_heads if site == ATTN_Z else None
    scores = exact_metrics(loaded, pair, grid_cells(site, c.num_hidden_layers, len(pair.corrupted), heads),
                           values_by_block(values, site))
    if normalized:
        scores = normalize(scores, *baselines(loaded, pair))
    return scores.reshape(c.num_hidden_layers, len(pair.corrupted), *([heads] if heads else []))


@functools.lru_cache(maxsize=4)
def _metric_gradient(config: DecoderConfig):
    """(deltas {``delta_key(site)``: [L, 1, S, W]}, params, ids [1, S], arrays, answer, wrong) ->
    (the logit difference, its gradient with respect to each delta, added at its site of every
    block): one jitted program per model, compiled per prompt length and set of sites. Its
    attention is the one-shot kernel over the causal mask (``model.decoder.attended``'s ``dense``,
    which takes windows, soft-caps and sinks): the tiled one's loop has bounds reverse mode cannot
    differentiate."""
    decoder, layers = Decoder(config, jnp.float32, attention="dense"), config.num_hidden_layers

    def metric(deltas, params, ids, arrays, answer, wrong):
        positions = jnp.arange(ids.shape[1])[None]
        mask = causal_mask(jnp.full(1, ids.shape[1]), ids.shape[1])
        outputs, _ = decoder.apply({"params": params}, ids, positions, mask, layers, ablation={**arrays, **deltas})
        logits = decoder.apply({"params": params}, outputs[-1][:, -1], method=Decoder.logits)  # [1, V]
        return logits[0, answer] - logits[0, wrong]

    return jax.jit(jax.value_and_grad(metric))


def attribution_metrics(loaded: LoadedModel, pair: Pair, patched: Sequence[Cell],
                        values: Mapping[tuple[str, int], np.ndarray]) -> tuple[np.ndarray, int]:
    """Attribution patching's estimate of ``exact_metrics``: the corrupted run's metric plus, for
    each patch of a cell, (clean - corrupted) . d metric / d value summed over its positions (and
    for ``attn.hook_z`` one head's slice), from one forward and one backward of the corrupted
    prompt (the gradient at every site the cells patch at once); (the estimates [cells], the
    backward passes run: 1, or 0 without a patch)."""
    c = loaded.config
    layers, length = c.num_hidden_layers, len(pair.corrupted)
    values = checked_values(c, pair, values)
    sites = sorted({patch.site for cell in patched for patch in cell})
    if not sites:
        return np.zeros(len(patched)), 0
    ids = jnp.asarray([pair.corrupted])
    _, outputs, sown = _forward(c, False)(loaded.params, ids, None)
    corrupted = {site: site_values(c, outputs, sown, site)[:, 0] for site in sites}  # [L, S, W] (hook_z: padded)
    deltas = {delta_key(site): jnp.zeros((layers, 1, length, corrupted[site].shape[-1]), jnp.float32)
              for site in sites}  # [L, 1, S, W] each
    value, gradient = _metric_gradient(c)(deltas, loaded.params, ids, kept_arrays(c, layers), pair.answer, pair.wrong)
    gradients = {site: np.asarray(gradient[delta_key(site)], np.float64)[:, 0] for site in sites}  # [L, S, W]
    estimates = np.full(len(patched), float(value))
    for i, cell in enumerate(patched):
        for patch in cell:
            at, layer = list(patch.positions), patch.layer
            change = (values[patch.site, layer][list(patch.sources)].astype(np.float64)
                      - corrupted[patch.site][layer, at]) * gradients[patch.site][layer, at]  # [k, W]
            if patch.head is not None:
                change = change.reshape(len(at), c.num_attention_heads, -1)[:, patch.head]
            estimates[i] += change.sum()
    return estimates, 1


def attribution_grid(loaded: LoadedModel, pair: Pair, site: str, values: np.ndarray | None = None,
                     normalized: bool = False) -> np.ndarray:
    """Attribution patching's estimate of ``patching_grid`` (``attribution_metrics``): [L, S], or
    [L, S, N] for ``attn.hook_z``."""
    pair.equal_lengths()
    c = loaded.config
    _check_site(c, site)
    values = clean_values(loaded, pair.clean, site) if values is None else values  # [L, S, W]
    heads = c.num_attention_heads if site == ATTN_Z else None
    estimate, _ = attribution_metrics(loaded, pair, grid_cells(site, c.num_hidden_layers, len(pair.corrupted), heads),
                                      values_by_block(values, site))
    if normalized:
        estimate = normalize(estimate, *baselines(loaded, pair))
    return estimate.reshape(c.num_hidden_layers, len(pair.corrupted), *([heads] if heads else []))


def agreement(exact: np.ndarray, estimate: np.ndarray, worst: int = 5) -> dict[str, Any]:
    """How well attribution patching's grid estimates exact patching's: their correlation over
    the cells, and the ``worst`` cells where they differ most (index, exact, estimate)."""
    exact, estimate = np.asarray(exact, np.float64), np.asarray(estimate, np.float64)
    differ = np.abs(exact - estimate).ravel()
    cells = np.argsort(-differ, kind="stable")[:worst]
    constant = exact.size < 2 or np.ptp(exact) == 0 or np.ptp(estimate) == 0  # no correlation defined
    correlation = float("nan") if constant else float(np.corrcoef(exact.ravel(), estimate.ravel())[0, 1])
    return {"correlation": correlation,
            "worst": [(tuple(int(i) for i in np.unravel_index(cell, exact.shape)), float(exact.ravel()[cell]),
                       float(estimate.ravel()[cell])) for cell in cells]}


def stored_values(index: str, sample_id: int, keys: Sequence[tuple[str, int]]) -> dict[tuple[str, int], np.ndarray]:
    """{(site, block): [S, W] float32}: what a store holds at these sites and blocks for one sample
    (the pair's clean one), read through the index in one coalesced read; the clean values a grid
    patches without running the clean prompt again. ``UserError`` for one the store lacks."""
    wanted = {(site, layer): array_key(site, layer) for site, layer in keys}
    try:
        found = read_activations(arrays_path(index), [sample_id], list(dict.fromkeys(wanted.values())))
    except FileNotFoundError:
        raise UserError(f"no per-array index beside {index!r} ({arrays_path(index)}): pass the index.parquet "
                        "that pipeline.index wrote") from None
    missing = [key for key in wanted.values() if (sample_id, key) not in found]
    if missing:
        raise UserError(f"{index} holds no {describe_key(missing[0])} of sample {sample_id}: store the site at "
                        "the blocks patched (runners.tpu_host --sites, --layers_to_extract)")
    return {block: np.asarray(found[sample_id, key], np.float32) for block, key in wanted.items()}


def paired(items: Sequence[dict[str, Any]]) -> list[Pair]:
    """The pairs of a paired dataset's samples, each a dict of ``pair`` (its id), ``variant``
    (clean | corrupted), ``ids``, ``answers`` (the clean one's: its answer and wrong answer tokens)
    and optionally ``sample_id`` and ``roles``; in the order their pairs first appear. A sample
    of another variant, a missing twin, a pair given twice or a clean sample without answers
    refused in one line."""
    by_pair: dict[Any, dict[str, dict]] = {}
    for item in items:
        what = f"sample {item['sample_id']}" if item.get("sample_id") is not None else f"pair {item['pair']!r}"
        if item["variant"] not in ("clean", "corrupted"):
            raise UserError(f"{what}: variant {item['variant']!r}: a pair's samples are clean or corrupted")
        if item["variant"] in by_pair.setdefault(item["pair"], {}):
            raise UserError(f"{what}: pair {item['pair']!r} has two {item['variant']} samples")
        by_pair[item["pair"]][item["variant"]] = item
    pairs = []
    for pair_id, variants in by_pair.items():
        missing = [v for v in ("clean", "corrupted") if v not in variants]
        if missing:
            given = variants[{"clean": "corrupted", "corrupted": "clean"}[missing[0]]]
            what = f"sample {given['sample_id']}" if given.get("sample_id") is not None else f"pair {pair_id!r}"
            raise UserError(f"{what}: pair {pair_id!r} has no {missing[0]} prompt (a row pipeline.prepare rejected "
                            "is listed in its rejected/)")
        clean, corrupted = variants["clean"], variants["corrupted"]
        if not clean.get("answers") or len(clean["answers"]) != 2:
            raise UserError(f"sample {clean.get('sample_id')} (pair {pair_id!r}) has no answer tokens: prepare with "
                            "--answer_columns answer,wrong_answer")
        pairs.append(Pair(tuple(clean["ids"]), tuple(corrupted["ids"]), *map(int, clean["answers"]), str(pair_id),
                          clean.get("sample_id"), corrupted.get("sample_id"), clean.get("roles"),
                          corrupted.get("roles")))
    return pairs


def pairs_from_rows(rows: list[dict[str, Any]], tokenizer: Any) -> list[Pair]:
    """The pairs of a paired dataset's rows (``pair``, ``variant`` clean | corrupted, ``text``,
    ``answer``, ``wrong_answer``: the clean row's answer tokens), tokenized by ``tokenizer`` with
    ``pipeline.prepare``'s own tokenization of a text column with ``--answer_columns
    answer,wrong_answer`` (``transforms.tokenize.tokenize_samples``: the BOS in front where the
    tokenizer adds one), so that a store's values of the same rows fit these pairs token for
    token; a missing twin, prompts of unequal lengths or an answer that is not one token refused
    in one line."""
    from transforms.samples import Sample
    from transforms.tokenize import tokenize_samples
    samples = [Sample(i, "pairs", text=row["text"], answer_texts=(row["answer"], row["wrong_answer"]),
                      origin=f"pair {row['pair']!r}, {row['variant']}") for i, row in enumerate(rows)]
    items = [{"pair": row["pair"], "variant": row["variant"], "answers": list(sample.answers),
              "ids": list(sample.input_ids), "roles": sample.roles}
             for row, sample in zip(rows, tokenize_samples(tokenizer, samples, None))]
    pairs = paired(items)
    for pair in pairs:
        pair.equal_lengths()
    return pairs

