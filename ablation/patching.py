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
run stored at the site for the pair's clean sample.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from activations.index import arrays_path
from activations.reader import read_activations
from common.cli import UserError
from model.config import DecoderConfig
from model.decoder import Decoder
from model.extract import sown_value
from model.interventions import add_head_patch, add_patch, delta_key, kept_arrays
from model.loading import LoadedModel
from model.scoring import causal_mask
from model.sites import ATTN_OUT, ATTN_Z, MLP_OUT, RESID_MID, RESID_POST, RESID_PRE, array_key, describe_key

PATCH_SITES = (RESID_PRE, ATTN_OUT, RESID_MID, MLP_OUT, RESID_POST, ATTN_Z)
ROWS_PER_FORWARD = 32  # cells patched in one batched forward


@dataclasses.dataclass(frozen=True)
class Pair:
    """A clean and a corrupted prompt of the same length, and the answer tokens the metric compares."""
    clean: tuple[int, ...]
    corrupted: tuple[int, ...]
    answer: int   # the clean prompt's answer
    wrong: int    # the corrupted prompt's answer

    def __post_init__(self):
        if len(self.clean) != len(self.corrupted):
            raise ValueError(f"a pair's prompts differ in length ({len(self.clean)} and {len(self.corrupted)} tokens)")


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
        return logits, outputs, state["sites"]

    return jax.jit(run)


def site_values(outputs: list, sites: dict, site: str, layers: int) -> np.ndarray:
    """[L, B, S, W]: what every block had at ``site``, from a forward's outputs and sown sites."""
    if site == RESID_POST:
        return np.stack([np.asarray(o) for o in outputs])
    if site == RESID_PRE:
        return np.stack([np.asarray(sites["embeddings"][0])] + [np.asarray(o) for o in outputs[:layers - 1]])
    return np.stack([np.asarray(sown_value(sites[f"layers_{i}"], site)) for i in range(layers)])


def clean_values(loaded: LoadedModel, prompt: tuple[int, ...], site: str) -> np.ndarray:
    """[L, S, W]: the clean prompt's value at ``site`` in every block."""
    _, outputs, sites = _forward(loaded.config, False)(loaded.params, jnp.asarray([prompt]), None)
    return site_values(outputs, sites, site, loaded.config.num_hidden_layers)[:, 0]


def logit_diff(logits: np.ndarray, pair: Pair) -> np.ndarray:
    """[B]: the answer's logit minus the wrong answer's, at the last position (``logits`` [B, V])."""
    logits = np.asarray(logits, np.float64)
    return logits[:, pair.answer] - logits[:, pair.wrong]


def baselines(loaded: LoadedModel, pair: Pair) -> tuple[float, float]:
    """(the clean run's logit difference, the corrupted run's)."""
    logits, _, _ = _forward(loaded.config, False)(loaded.params, jnp.asarray([pair.clean, pair.corrupted]), None)
    clean, corrupted = logit_diff(logits, pair)
    return float(clean), float(corrupted)


def patching_grid(loaded: LoadedModel, pair: Pair, site: str, values: np.ndarray | None = None,
                  normalized: bool = False) -> np.ndarray:
    """The grid of one site: [L, S] (a stream site, each (block, position) patched alone) or, for
    ``attn.hook_z``, [L, S, N] (each head at each position), of the corrupted run's logit difference
    with the clean value put back there (``normalized``: 0 corrupted, 1 clean). ``values``
    [L, S, W]: the clean prompt's values at ``site`` (default: from its run)."""
    c = loaded.config
    layers, length = c.num_hidden_layers, len(pair.corrupted)
    values = clean_values(loaded, pair.clean, site) if values is None else values
    heads = c.num_attention_heads if site == ATTN_Z else None
    cells = [(layer, position, head) for layer in range(layers) for position in range(length)
             for head in (range(heads) if heads else [None])]
    scores = np.concatenate([_scores(loaded, pair, site, values, cells[i:i + ROWS_PER_FORWARD])
                             for i in range(0, len(cells), ROWS_PER_FORWARD)])
    if normalized:
        clean, corrupted = baselines(loaded, pair)
        scores = (scores - corrupted) / (clean - corrupted)
    return scores.reshape(layers, length, heads) if heads else scores.reshape(layers, length)


def _scores(loaded: LoadedModel, pair: Pair, site: str, values: np.ndarray, cells: list[tuple]) -> np.ndarray:
    """The metric of each cell's patched forward, ``ROWS_PER_FORWARD`` rows a batch (the last padded)."""
    c = loaded.config
    layers, length, rows = c.num_hidden_layers, len(pair.corrupted), ROWS_PER_FORWARD
    arrays: dict[str, Any] = kept_arrays(c, layers)
    for row, (layer, position, head) in enumerate(cells):
        tokens = np.zeros((rows, length), bool)
        tokens[row, position] = True
        broadcast = np.broadcast_to(values[layer], (rows, *values[layer].shape))  # [B, S, W]
        if head is None:
            add_patch(arrays, site, layer, broadcast, tokens)
        else:
            chosen = np.zeros((rows, length, c.num_attention_heads), bool)
            chosen[row, position, head] = True
            add_head_patch(arrays, layer, broadcast, chosen)
    ids = jnp.asarray(np.broadcast_to(np.asarray(pair.corrupted), (rows, length)))
    logits, _, _ = _forward(loaded.config, True)(loaded.params, ids, arrays)
    return logit_diff(logits, pair)[:len(cells)]


@functools.lru_cache(maxsize=8)
def _metric_gradient(config: DecoderConfig, site: str):
    """(delta [L, 1, S, W], params, ids [1, S], arrays, answer, wrong) -> (the logit difference, its
    gradient with respect to ``delta``, added at ``site`` of every block): one jitted program per
    site (compiled per prompt length). Its attention is the fused kernel's
    (``jax.nn.dot_product_attention``): the tiled one's loop has bounds reverse mode cannot differentiate."""
    decoder, layers = Decoder(config, jnp.float32, attention="fused"), config.num_hidden_layers

    def metric(delta, params, ids, arrays, answer, wrong):
        positions = jnp.arange(ids.shape[1])[None]
        mask = causal_mask(jnp.full(1, ids.shape[1]), ids.shape[1])
        outputs, _ = decoder.apply({"params": params}, ids, positions, mask, layers,
                                   ablation={**arrays, delta_key(site): delta})
        logits = decoder.apply({"params": params}, outputs[-1][:, -1], method=Decoder.logits)  # [1, V]
        return logits[0, answer] - logits[0, wrong]

    return jax.jit(jax.value_and_grad(metric))


def attribution_grid(loaded: LoadedModel, pair: Pair, site: str, values: np.ndarray | None = None,
                     normalized: bool = False) -> np.ndarray:
    """Attribution patching's estimate of ``patching_grid`` from one forward and one backward of the
    corrupted prompt: (clean - corrupted) . d metric / d value at each cell, summed over the site's
    width (for ``attn.hook_z``, over each head's slice): [L, S], or [L, S, N] for ``attn.hook_z``;
    the corrupted run's metric added, so that it estimates the patched metric itself."""
    c = loaded.config
    layers, length = c.num_hidden_layers, len(pair.corrupted)
    values = clean_values(loaded, pair.clean, site) if values is None else values  # [L, S, W]
    corrupted_values = clean_values(loaded, pair.corrupted, site)
    delta = jnp.zeros((layers, 1, length, values.shape[-1]), jnp.float32)
    metric, gradient = _metric_gradient(c, site)(delta, loaded.params, jnp.asarray([pair.corrupted]),
                                                 kept_arrays(c, layers), pair.answer, pair.wrong)
    change = (values - corrupted_values).astype(np.float64) * np.asarray(gradient, np.float64)[:, 0]  # [L, S, W]
    if site == ATTN_Z:
        change = change.reshape(layers, length, c.num_attention_heads, -1)
    estimate = change.sum(axis=-1) + float(metric)
    if normalized:
        clean, corrupted = baselines(loaded, pair)
        estimate = (estimate - corrupted) / (clean - corrupted)
    return estimate


def agreement(exact: np.ndarray, estimate: np.ndarray, worst: int = 5) -> dict[str, Any]:
    """How well attribution patching's grid estimates exact patching's: their correlation over
    the cells, and the ``worst`` cells where they differ most (index, exact, estimate)."""
    exact, estimate = np.asarray(exact, np.float64), np.asarray(estimate, np.float64)
    differ = np.abs(exact - estimate).ravel()
    cells = np.argsort(-differ, kind="stable")[:worst]
    correlation = float(np.corrcoef(exact.ravel(), estimate.ravel())[0, 1]) if exact.size > 1 else float("nan")
    return {"correlation": correlation,
            "worst": [(tuple(int(i) for i in np.unravel_index(cell, exact.shape)), float(exact.ravel()[cell]),
                       float(estimate.ravel()[cell])) for cell in cells]}


def stored_values(index: str, sample_id: int, site: str, layers: int) -> np.ndarray:
    """[L, S, W] float32: what a store holds at ``site`` of every block for one sample (the pair's
    clean one), read through the index with one ranged read per array; the clean values a grid
    patches without running the clean prompt again."""
    keys = [array_key(site, layer) for layer in range(layers)]
    found = read_activations(arrays_path(index), [sample_id], keys)
    missing = [key for key in keys if (sample_id, key) not in found]
    if missing:
        raise UserError(f"{index} holds no {describe_key(missing[0])} of sample {sample_id}: store the site at "
                        "every layer (--sites, --layers_to_extract)")
    return np.stack([np.asarray(found[sample_id, key], np.float32) for key in keys])


def pairs_from_rows(rows: list[dict[str, Any]], tokenizer: Any) -> list[Pair]:
    """The pairs of a paired dataset's rows (``pair``, ``variant`` clean | corrupted, ``text``,
    ``answer``, ``wrong_answer``: the clean row's answer tokens), tokenized by ``tokenizer``
    (without special tokens); a missing twin, prompts of unequal lengths or an answer that is not one
    token refused in one line."""
    by_pair: dict[Any, dict[str, dict]] = {}
    for row in rows:
        by_pair.setdefault(row["pair"], {})[row["variant"]] = row
    pairs = []
    for pair_id, variants in by_pair.items():
        missing = [v for v in ("clean", "corrupted") if v not in variants]
        if missing:
            raise UserError(f"pair {pair_id!r} has no {missing[0]} prompt")
        clean, corrupted = (tokenizer(variants[v]["text"], add_special_tokens=False)["input_ids"]
                            for v in ("clean", "corrupted"))
        if len(clean) != len(corrupted):
            raise UserError(f"pair {pair_id!r}: the clean prompt has {len(clean)} tokens, the corrupted "
                            f"{len(corrupted)}: patching position by position needs equal lengths")
        answers = []
        for column in ("answer", "wrong_answer"):
            ids = tokenizer(variants["clean"][column], add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise UserError(f"pair {pair_id!r}: {column} {variants['clean'][column]!r} is {len(ids)} tokens, "
                                "not one")
            answers.append(ids[0])
        pairs.append(Pair(tuple(clean), tuple(corrupted), *answers))
    return pairs


def write_grid_chart(grid: np.ndarray, labels: list[str], title: str, path: str) -> str:
    """A [layers, positions] grid as a heatmap (positions labelled by their tokens), PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(max(6.0, 0.5 * grid.shape[1] + 2), max(4.0, 0.22 * grid.shape[0] + 1.5)))
    limit = max(float(np.abs(grid).max()), 1e-9)
    image = axes.imshow(grid, cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
    axes.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    axes.set_ylabel("layer")
    axes.set_title(title)
    figure.colorbar(image, ax=axes)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
