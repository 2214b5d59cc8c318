"""The model verification report: greedy continuations of a few prompts, a NaN/Inf check and
per-layer activation statistics, for a person to review before a deployment."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class PromptResult:
    source: str
    prompt_ids: list[int]
    prompt_text: str
    generated_ids: list[int]
    generated_text: str
    stopped: bool                     # ended on a stop token (else hit max_new_tokens)
    activations: dict[Any, np.ndarray]  # array key (model.sites) -> [num_tokens, width]


def first_token_ratio(activations: np.ndarray) -> float:
    """The first token's norm over the median token norm of one sequence's activations [S, H].

    Trained decoders park outsized activations on the first token (an attention sink), tens of
    times the typical norm in the middle blocks; random weights give about 1. A real checkpoint
    loaded with the wrong weights loses it."""
    norms = np.linalg.norm(np.asarray(activations, np.float64), axis=-1)  # [S]
    return float(norms[0] / np.median(norms))


def layer_statistics(results: Sequence[PromptResult]) -> dict[Any, dict[str, float]]:
    """Per array key (a layer's block output, or a site's hook name: ``model.sites``), in storage
    order, over every prompt token: mean, std, max |x|, the count of non-finite values, and the
    median over prompts of ``first_token_ratio``."""
    stats = {}
    for layer in results[0].activations:
        values = np.concatenate([r.activations[layer].astype(np.float64).ravel() for r in results])
        finite = values[np.isfinite(values)]
        stats[layer] = {"mean": float(finite.mean()), "std": float(finite.std()),
                        "max_abs": float(np.abs(finite).max()),
                        "non_finite": int(values.size - finite.size),
                        "first_token_ratio": float(np.median([first_token_ratio(r.activations[layer])
                                                              for r in results]))}
    return stats


def numerics(dtype: str, residual_dtype: str) -> list[tuple[str, str]]:
    """Which dtype each part of the forward uses, for a compute dtype and a residual stream dtype
    (names such as ``bfloat16``), as ``model.decoder`` computes it."""
    wide = residual_dtype != dtype
    return [("weights, matmul operands", dtype),
            ("matmul accumulation and outputs", residual_dtype if wide else f"{dtype} (rounded to it)"),
            ("residual stream: embedding output, every residual add, block outputs", residual_dtype),
            ("RMSNorm statistics", "float32"),
            ("RMSNorm weight applied", "float32, then one rounding to the operand" if wide
             else f"{dtype} (normalised values rounded first)"),
            ("rotary embedding", "float32, then one rounding to the operand" if wide else dtype),
            ("softmax statistics (max, sum)", "float32")]


def report_text(model_path: str, dtype: str, results: Sequence[PromptResult],
                residual_dtype: str | None = None, intervention: str | None = None) -> str:
    """The report; ``intervention``: the spec everything was computed under (``--ablate``), if any."""
    stats = layer_statistics(results)
    bad = {layer: s["non_finite"] for layer, s in stats.items() if s["non_finite"]}
    residual_dtype = residual_dtype or dtype
    lines = ["Model generation verification: review before deployment.",
             f"Model: {model_path}   dtype: {dtype}   residual stream: {residual_dtype}   prompts: {len(results)}",
             *([f"Under the intervention: {intervention}"] if intervention else []),
             "NaN/Inf in activations: " + (f"YES {bad}" if bad else "none"), "",
             "--- dtypes used where ---"]
    lines += [f"{part:<70} {used}" for part, used in numerics(dtype, residual_dtype)]
    lines.append("")
    for r in results:
        lines += [f"=== {r.source}  prompt tokens {len(r.prompt_ids)}",
                  "--- prompt (last 300 characters) ---", r.prompt_text[-300:],
                  f"--- greedy continuation ({len(r.generated_ids)} tokens, "
                  f"{'stopped at a stop token' if r.stopped else 'hit max_new_tokens'}) ---",
                  r.generated_text, f"ids: {r.generated_ids}", ""]
    lines.append("--- activation statistics per layer (all prompt tokens) ---")
    lines.append("(first/median: the first token's norm over the median token norm; tens in a trained model's "
                 "middle blocks, about 1 with random weights)")
    width = max(5, *(len(str(key)) for key in stats))  # a layer, or a site's hook name
    lines.append(f"{'layer':>{width}} {'mean':>12} {'std':>12} {'max |x|':>12} {'non-finite':>10} {'first/median':>12}")
    lines += [f"{str(layer):>{width}} {s['mean']:>12.5g} {s['std']:>12.5g} {s['max_abs']:>12.5g} {s['non_finite']:>10} "
              f"{s['first_token_ratio']:>12.1f}" for layer, s in stats.items()]
    return "\n".join(lines) + "\n"
