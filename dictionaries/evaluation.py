"""The final evaluation of a trained dictionary on held-out tokens: how well it reconstructs them,
how sparse and how alive its latents are, and what splicing it into the model costs the model's
next-token loss. It reads the saved (inference) weights (``saelens_format.inference_weights``:
the activation scales folded in) and a token loader of raw activations.

    weights = inference_weights(dictionary, params, topk_threshold, scale_in, scale_out)
    found = evaluate(held_out, dictionary, weights, 12, 12)  # an SAE of layer 12; held_out: normalize="none"
    write_sparsity(output_dir, found.density)
    ce = ce_loss(held_out, dictionary, weights, 12, 12, scoring_model(held_out))  # held_out: with_token_ids

The metrics are SAELens 6.54's evaluation's (``sae_lens/evals.py``), over every token of one pass:
- ``explained_variance``: ``1 - E|y - y'|^2 / (E|y|^2 - |E y|^2)`` (its ``ExplainedVarianceCalculator``:
  y the target, the input of an SAE or a transcoder's output site; the variance about the mean of
  every token, not of each batch); ``mse``: ``E|y - y'|^2``, each summed over dimensions;
- ``l0``, ``l1``: the mean over tokens of the latents firing (``!= 0``) and of ``sum |f|``;
- ``density``: per latent the fraction of tokens it fired on (SAELens's ``feature_density``);
  ``dead``: latents that fired on none; ``dense``: latents that fired on more than
  ``DENSE_DENSITY`` of them.

The CE loss score is SAELens's ``ce_loss_score``, ``(zero - spliced) / (zero - clean)``: the
model's mean next-token loss as it is (clean), with the dictionary's output in place of its
output site's values (spliced: an SAE's reconstruction of the site; a transcoder's output computed
from its input site, in place of its output site) and with that site zeroed (zero). Where the
loader drops tokens (its selection, ``exclude_first_positions``), only its kept tokens are
spliced and zeroed (SAELens splices around its ``ignore_tokens`` too, but zeroes every token),
and the losses are of the predictions made at them (SAELens's: at every token but those). The
dictionary reads the store's values of each held-out sample; the model (the store's,
``activations.index.store_model``: ``scoring_model``) runs under ``model.scoring``'s
interventions, the output site patched (``model.interventions.add_patch``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from activations.index import check_same_model, model_shape, store_model
from activations.token_loader import TokenLoader
from activations.token_plan import blocks
from common.cli import UserError
from common.files import write_atomically
from dictionaries.clt import decode_clt, encode_clt
from dictionaries.config import DictionaryConfig
from dictionaries.sae import Params, decode, encode
from dictionaries.saelens_format import saved_architecture
from model.config import DecoderConfig
from model.extract import resolve_dtype
from model.interventions import PATCH_SITES, add_head_patch, add_patch, kept_arrays, reserve_patch_slots
from model.loading import load_model
from model.scoring import InterventionModel
from model.sites import ATTN_Z, describe_key, key_parts, missing_reason

# A latent firing on more tokens than this is dense: the "high frequency" latents of the JumpReLU
# paper (Rajamanoharan et al. 2024, section 5), which fire on over 10% of tokens.
DENSE_DENSITY = 0.1
SPARSITY_FILE = "sparsity.safetensors"  # SAELens's SPARSITY_FILENAME
SPARSITY_EPS = 1e-10                    # SAELens's log10(density + eps)


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """A dictionary's metrics over the tokens of one pass (see the module's docstring)."""
    tokens: int
    explained_variance: float
    mse: float
    l0: float
    l1: float
    dead: int            # latents that fired on no token
    dense: int           # latents that fired on more than DENSE_DENSITY of the tokens
    density: np.ndarray  # [d_sae] float64: the fraction of tokens each latent fired on


@dataclasses.dataclass(frozen=True)
class CeLoss:
    """The model's mean next-token loss over the predictions at the spliced tokens."""
    clean: float
    spliced: float   # the dictionary's output in place of its output site's values
    zero: float      # that site zeroed
    score: float     # (zero - spliced) / (zero - clean): 1 as good as the model, 0 as bad as zeroing
    tokens: int      # predictions scored
    samples: int


def inference_config(config: DictionaryConfig, transcoder: bool) -> DictionaryConfig:
    """How the saved weights encode, as SAELens's inference class of them does: ReLU, TopK
    (the decoder norms folded: no rescaling) or JumpReLU (BatchTopK kinds saved as one)."""
    kind = saved_architecture(config, transcoder)
    architecture = "jumprelu" if kind.startswith("jumprelu") else "topk" if kind == "topk" else "standard"
    return DictionaryConfig(architecture=architecture, k=config.k, rescale_acts_by_decoder_norm=False)


@functools.partial(jax.jit, static_argnames=("config", "sae"))
def reconstructed(config: DictionaryConfig, weights: Params, x: jax.Array, sae: bool) -> tuple[jax.Array, jax.Array]:
    """(feature activations [rows, d_sae], the output [rows, d_out]) of ``x`` [rows, d_in] under
    the saved weights (``config``: ``inference_config``'s)."""
    # ReLU'd as SAELens's JumpReLU is before its threshold's mask: the same but where a threshold is negative.
    acts = jax.nn.relu(encode(config, weights, x, sae)[0])
    return acts, decode(config, weights, acts, x)


@functools.partial(jax.jit, static_argnames=("config", "sae"))
def _batch_sums(config: DictionaryConfig, weights: Params, x: jax.Array, target: jax.Array, count: jax.Array,
                sae: bool) -> dict[str, jax.Array]:
    """The sums a batch adds to the metrics, over its first ``count`` rows (the rest padding)."""
    acts, out = reconstructed(config, weights, x, sae)
    real = (jnp.arange(x.shape[0]) < count)[:, None]  # [rows, 1]
    y = jnp.where(real, target, 0)
    fired = real & (acts != 0)  # [rows, d_sae]
    return {"sum_y": y.sum(0), "sum_squares": jnp.sum(y ** 2), "sum_errors": jnp.sum(jnp.where(real, out - y, 0) ** 2),
            "l0": fired.sum(), "l1": jnp.sum(jnp.where(real, jnp.abs(acts), 0)), "fired": fired.sum(0)}


def _padded(x: np.ndarray, rows: int) -> np.ndarray:
    """``x`` [n, width] with zero rows after it to ``rows``: every batch of one compiled shape."""
    return np.concatenate([x, np.zeros((rows - len(x), x.shape[1]), x.dtype)]) if len(x) < rows else x


def _raw(loader: TokenLoader, *keys: Any) -> None:
    """``ValueError`` unless ``loader`` reads ``keys`` raw (the saved weights take raw activations)."""
    missing = [describe_key(key) for key in keys if key not in loader.config.keys]
    if missing:
        raise ValueError(f"the loader does not read {', '.join(missing)}")
    if loader.scaling:
        raise ValueError("the saved weights read raw activations: a loader with normalize='none'")


def evaluate(loader: TokenLoader, config: DictionaryConfig, weights: dict[str, np.ndarray], input_key: Any,
             target_key: Any) -> Evaluation:
    """The metrics of the saved ``weights`` (``inference_weights``') of a dictionary trained as
    ``config`` reading ``input_key`` and reconstructing ``target_key`` (an SAE: the same key; array
    keys, ``model.sites.normalized_key``), over one pass of ``loader``."""
    _raw(loader, input_key, target_key)
    transcoder = input_key != target_key
    saved, params = inference_config(config, transcoder), {k: jnp.asarray(v) for k, v in weights.items()}
    dtype, rows = params["W_enc"].dtype, loader.config.batch_tokens
    totals: dict[str, np.ndarray] = {}
    tokens = 0
    for batch in loader.batches():
        x, y = (_padded(batch.activations[k].astype(dtype), rows) for k in (input_key, target_key))
        sums = _batch_sums(saved, params, x, y, len(batch), sae=not transcoder)
        for name, value in sums.items():  # across batches in float64, as SAELens's calculator sums
            totals[name] = totals.get(name, 0) + np.asarray(value, np.float64)
        tokens += len(batch)
    return _metrics(loader, totals, tokens)


def _metrics(loader: TokenLoader, totals: dict[str, np.ndarray], tokens: int) -> Evaluation:
    """The metrics from a pass's sums (``_batch_sums``')."""
    if not tokens:
        raise UserError(f"{loader.config.index}: no held-out tokens to evaluate on")
    variance = totals["sum_squares"] / tokens - np.sum((totals["sum_y"] / tokens) ** 2)
    mse = totals["sum_errors"] / tokens
    explained = (1.0 if mse < 1e-10 else 0.0) if variance < 1e-10 else 1 - mse / variance  # SAELens's edge
    density = totals["fired"] / tokens
    return Evaluation(tokens, float(explained), float(mse), float(totals["l0"] / tokens),
                      float(totals["l1"] / tokens), int(np.sum(density == 0)), int(np.sum(density > DENSE_DENSITY)),
                      density)


@functools.partial(jax.jit, static_argnames=("config",))
def _clt_batch_sums(config: DictionaryConfig, weights: Params, xs: tuple[jax.Array, ...], ys: tuple[jax.Array, ...],
                    count: jax.Array) -> dict[str, jax.Array]:
    """``_batch_sums`` of a CLT: ``xs`` / ``ys`` its input and output rows at each layer."""
    acts = encode_clt(config, weights, list(xs))[0]
    out = jnp.concatenate(decode_clt(config, weights, acts), -1)  # [rows, layers * d_out]
    acts = jnp.concatenate(acts, -1)                                # [rows, layers * d_sae]
    real = (jnp.arange(xs[0].shape[0]) < count)[:, None]            # [rows, 1]
    y = jnp.concatenate([jnp.where(real, t, 0) for t in ys], -1)
    fired = real & (acts != 0)
    return {"sum_y": y.sum(0), "sum_squares": jnp.sum(y ** 2), "sum_errors": jnp.sum(jnp.where(real, out - y, 0) ** 2),
            "l0": fired.sum() / len(xs), "l1": jnp.sum(jnp.where(real, jnp.abs(acts), 0)) / len(xs),
            "fired": fired.sum(0)}


def evaluate_clt(loader: TokenLoader, config: DictionaryConfig, weights: dict[str, np.ndarray],
                 input_keys: Sequence[Any], output_keys: Sequence[Any]) -> Evaluation:
    """A cross-layer transcoder's metrics (``weights``: ``circuit_tracer_format.clt_inference_weights``'),
    as ``evaluate``'s with every layer's output together: the explained variance of the outputs
    concatenated (errors and variances summed over layers), L0 and L1 per token and layer, the
    density of each latent of each layer (``[layers * d_sae]``, layer by layer)."""
    _raw(loader, *input_keys, *output_keys)
    params, rows = {k: jnp.asarray(v) for k, v in weights.items()}, loader.config.batch_tokens
    dtype = params["W_enc_0"].dtype
    totals: dict[str, np.ndarray] = {}
    tokens = 0
    for batch in loader.batches():
        xs, ys = (tuple(_padded(batch.activations[k].astype(dtype), rows) for k in keys)
                  for keys in (input_keys, output_keys))
        for name, value in _clt_batch_sums(config, params, xs, ys, len(batch)).items():
            totals[name] = totals.get(name, 0) + np.asarray(value, np.float64)
        tokens += len(batch)
    return _metrics(loader, totals, tokens)


def sparsity_bytes(density: np.ndarray) -> bytes:
    """SAELens's ``sparsity.safetensors``: ``{"sparsity": log10(density + 1e-10)}``, float32 [d_sae]."""
    from safetensors.numpy import save
    return save({"sparsity": np.log10(np.asarray(density, np.float64) + SPARSITY_EPS).astype(np.float32)})


def write_sparsity(directory: str, density: np.ndarray) -> str:
    """Writes ``sparsity.safetensors`` beside a dictionary's SAELens files (as SAELens's trainer and
    SAEDashboard write it, and its hub loader reads it); returns its path."""
    path = os.path.join(directory, SPARSITY_FILE)
    write_atomically(path, sparsity_bytes(density))
    return path


# What a spliced sample carries: its token ids, the positions spliced, the dictionary's output there.
Spliced = tuple[np.ndarray, np.ndarray, np.ndarray]


def check_ce_loss(key: Any) -> None:
    """``UserError`` in one line where a dictionary's output site ``key`` cannot be spliced into the
    model (before training, so that the evaluation after it does not fail)."""
    site, _ = key_parts(key)
    if site not in PATCH_SITES:
        raise UserError(f"no CE loss score at {describe_key(key)}: the model's forward puts values in place only at "
                        f"{', '.join(PATCH_SITES)}")


def scoring_model(loader: TokenLoader, model_path: str | None = None, dtype: str = "auto",
                  batch_size: int = 8) -> InterventionModel:
    """The model the store was made from (or ``model_path``: the same model elsewhere) in ``dtype``
    (``model.extract.resolve_dtype``), ``batch_size`` sequences a forward, run by ``ce_loss``:
    loaded once for every dictionary of a store, its programs compiled once per batch shape."""
    path, revision = _store_model(loader, model_path)
    loaded = load_model(path, resolve_dtype(dtype), with_head=True, revision=revision)
    check_same_model(store_model(loader.metadata), {**model_shape(loaded.config), "model": path},
                     f"{loader.config.index} holds activations", "the model loaded")
    return InterventionModel(loaded, batch_size, int(loader.stored.sample_tokens.max()))


def ce_loss(loader: TokenLoader, config: DictionaryConfig, weights: dict[str, np.ndarray], input_key: Any,
            target_key: Any, model: InterventionModel, max_samples: int | None = None) -> CeLoss:
    """The CE loss score of the saved ``weights`` (``evaluate``'s) over the loader's samples in
    storage order (the first ``max_samples``), by ``model`` (``scoring_model``'s). The loader must
    carry its samples' token ids (``LoaderConfig(with_token_ids=True)``)."""
    _raw(loader, input_key, target_key)
    check_ce_loss(target_key)
    site, layer = key_parts(target_key)
    if reason := missing_reason(site, model.config, layer):
        raise UserError(f"no CE loss score at {describe_key(target_key)}: {reason}")
    if loader.token_ids is None:
        raise ValueError("the CE loss reads each sample's token ids: a loader with with_token_ids=True")
    if loader.pools or loader.pooled_store:
        raise UserError(f"{loader.config.index}: pooled rows (one a sample) have no token positions to splice at")
    samples = _spliced_samples(loader, config, weights, input_key, input_key != target_key, max_samples)
    sums, tokens, count = np.zeros(3), 0, 0  # summed losses: clean, spliced, zero
    for batch in model.batches((sample, sample[0]) for sample in samples):
        chosen = [sample for sample, _ in batch.items]
        losses, scored = _batch_losses(model, site, layer, chosen, batch.length)
        sums, tokens, count = sums + losses, tokens + scored, count + len(chosen)
    if not tokens:
        raise UserError(f"{loader.config.index}: no held-out prediction to score (none follows a kept token)")
    clean, spliced, zero = sums / tokens
    return CeLoss(float(clean), float(spliced), float(zero), float((zero - spliced) / (zero - clean)), tokens, count)


def _batch_losses(model: InterventionModel, site: str, layer: int, samples: list[Spliced],
                  length: int) -> tuple[np.ndarray, int]:
    """(the losses of the predictions at a batch's spliced tokens, summed: clean, spliced, zero;
    how many), the batch padded to ``length``."""
    ids, lengths = model.inputs([sample_ids for sample_ids, _, _ in samples], length)
    base = model.residuals(ids, lengths, kept_arrays(model.config, model.num_layers))
    scored = [positions[positions + 1 < len(sample_ids)] + 1 for sample_ids, positions, _ in samples]
    unablated = model.unablated(base, ids, scored)
    sums = np.zeros(3)
    for i, spliced in enumerate((None, True, False)):
        residuals = base if spliced is None else model.residuals(
            ids, lengths, _spliced_arrays(model.config, model.num_layers, site, layer, samples, ids.shape, spliced))
        result = model.scores(residuals, unablated, lengths, len(samples))
        has = result.scored_tokens > 0  # a sample kept only at its last token predicts nothing from it
        sums[i] = np.sum(result.loss[has] * result.scored_tokens[has])
    return sums, int(sum(len(s) for s in scored))


def _store_model(loader: TokenLoader, model_path: str | None) -> tuple[str, str | None]:
    """(the model to score with, its hub revision): ``model_path``, else the one the store records;
    refused where it records none, several, or values computed under an intervention."""
    machines = loader.metadata.get("machines", [])
    ablated = sorted({m["ablation"] for m in machines if m.get("ablation")})
    if ablated:
        raise UserError(f"{loader.config.index} was extracted under --ablate {ablated[0]}: its values are not the "
                        "model's own, so splicing a dictionary of them scores nothing meaningful")
    path = model_path or store_model(loader.metadata)["model"]
    if not isinstance(path, str):
        raise UserError(f"{loader.config.index} records {'no model' if not path else 'several models: ' + str(path)}: "
                        "name the model to score with (model_path)")
    revisions = {m.get("model_revision") for m in machines} - {None}
    return path, revisions.pop() if model_path is None and len(revisions) == 1 else None


def _spliced_samples(loader: TokenLoader, config: DictionaryConfig, weights: dict[str, np.ndarray], input_key: Any,
                     transcoder: bool, max_samples: int | None) -> Iterator[Spliced]:
    """Per sample in storage order with kept tokens (the first ``max_samples``): its token ids,
    the kept positions and the dictionary's output there, from the store's values of its input."""
    saved, params = inference_config(config, transcoder), {k: jnp.asarray(v) for k, v in weights.items()}
    rows, count = loader.config.batch_tokens, 0
    for bounds in blocks(loader.stored, None, loader.config.block_bytes):
        for piece in loader.read_block(bounds).pieces:
            positions = piece["positions"]
            if not len(positions):
                continue
            x = piece[input_key].astype(params["W_enc"].dtype)
            outs = [reconstructed(saved, params, _padded(x[i:i + rows], rows), sae=not transcoder)[1]
                    for i in range(0, len(x), rows)]  # one compiled shape: the loader's batches'
            out = np.concatenate([np.asarray(o) for o in outs])[:len(x)]
            yield loader.token_ids[int(piece["sample_ids"][0])], positions, out
            count += 1
            if count == max_samples:
                return


def _spliced_arrays(config: DecoderConfig, num_layers: int, site: str, layer: int, samples: list[Spliced],
                    shape: tuple[int, int], spliced: bool) -> dict[str, np.ndarray]:
    """The intervention's arrays of a batch [rows, length]: each sample's kept positions at
    ``site`` of block ``layer`` given the dictionary's output (``spliced``) or zeros."""
    arrays = kept_arrays(config, num_layers)
    reserve_patch_slots(arrays, site, 1, *shape)  # one slot whatever is patched: one compiled forward
    width = samples[0][2].shape[1]
    values, where = np.zeros((*shape, width), np.float32), np.zeros(shape, bool)  # [B, S, W], [B, S]
    for row, (_, positions, out) in enumerate(samples):
        where[row, positions] = True
        if spliced:
            values[row, positions] = out
    if site == ATTN_Z:  # every head of the block
        add_head_patch(arrays, layer, values, np.repeat(where[..., None], config.num_attention_heads, axis=-1))
    else:
        add_patch(arrays, site, layer, values, where)
    return arrays
