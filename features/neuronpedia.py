"""Feature dashboards as Neuronpedia batch files, byte for byte as SAEDashboard 0.8 writes them.

SAEDashboard's ``NeuronpediaRunner`` writes ``batch-N.json`` per batch of features: one JSON object
``{model_id, layer, sae_set, sae_id_suffix, features}``, each feature the fields of its
``NeuronpediaDashboardFeature`` in that class's ``to_dict`` order, each activation example those of
``NeuronpediaDashboardActivation`` (with the three DFA keys its SAE runner always writes: ``[]``,
``0``, ``-1``). Numbers are rounded as its converter rounds them (``np.round(x, 3)``; an example's
values to 4 places first, as its ``SequenceData`` does), and the text is ``json.dumps`` with its
defaults: no indent, ASCII only, no newline at the end. A group's bounds come from the titles the
converter parses back: the top group is ``bin_min = -1, bin_max = max (3 places), bin_contains = -1``,
an interval group its bounds and its share of the tokens (a percentage to 3 places, over 100), and
``frac_nonzero`` the density the same way (``0`` for a feature that never fires).

The data are plain dataclasses (``DashboardFeature``, ``ActivationExample``); this module only
lays them out.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

import numpy as np

TOP_GROUP = -1  # bin_min and bin_contains of the top activations' group
OUT_OF_RANGE = "<|outofrange|>"  # an id past the tokenizer's vocabulary (the model's is larger)
# Byte-level BPE's spellings of some characters, replaced in token strings, in this order (SAEDashboard's
# HTML_ANOMALIES; SentencePiece's "▁" is left as it is).
TOKEN_SPELLINGS = (("âĢĶ", "—"), ("âĢĵ", "–"), ("âĢľ", "“"),
                   ("âĢĿ", "”"), ("âĢĺ", "‘"), ("âĢĻ", "’"),
                   ("âĢĭ", " "), ("Ġ", " "), ("Ċ", "\n"), ("ĉ", "\t"))


@dataclasses.dataclass(frozen=True)
class ActivationExample:
    """One example of a feature's activations: a run of tokens with its value at each."""
    bin_min: float          # the group's lower bound (TOP_GROUP for the top activations)
    bin_max: float          # its upper bound (the feature's maximum for the top activations)
    bin_contains: float     # the share of tokens in the group (TOP_GROUP for the top activations)
    tokens: list[str]       # the run's tokens as text
    values: list[float]     # the feature's activation at each
    qualifying_token_index: int  # the token the example was chosen for, an index into tokens


@dataclasses.dataclass(frozen=True)
class DashboardFeature:
    """What a dashboard shows of one feature."""
    feature_index: int
    neg_str: list[str]              # the tokens its direction suppresses most, most suppressed first
    neg_values: list[float]
    pos_str: list[str]              # the tokens it promotes most, most promoted first
    pos_values: list[float]
    density: float                  # the share of tokens it fires on (> 0)
    histogram_values: list[float]   # the activation histogram's bin centres (of its values > 0)
    histogram_heights: list[int]    # and counts
    logits_histogram_heights: list[int]  # the histogram of its direction's effect on every logit
    logits_histogram_values: list[float]
    activations: list[ActivationExample]
    n_prompts_total: int = 0
    n_tokens_in_prompt: int = 0
    dataset: str = ""
    neuron_alignment_indices: list[int] = dataclasses.field(default_factory=list)
    neuron_alignment_values: list[float] = dataclasses.field(default_factory=list)
    neuron_alignment_l1: list[float] = dataclasses.field(default_factory=list)
    correlated_neurons_indices: list[int] = dataclasses.field(default_factory=list)
    correlated_neurons_l1: list[float] = dataclasses.field(default_factory=list)
    correlated_neurons_pearson: list[float] = dataclasses.field(default_factory=list)
    correlated_features_indices: list[int] = dataclasses.field(default_factory=list)
    correlated_features_l1: list[float] = dataclasses.field(default_factory=list)
    correlated_features_pearson: list[float] = dataclasses.field(default_factory=list)


def token_strings(vocab: Mapping[str, int], size: int) -> list[str]:
    """Each id's text as SAEDashboard shows it: the tokenizer's vocabulary (``tokenizer.vocab``,
    string -> id) with ``TOKEN_SPELLINGS`` replaced, ids up to the model's ``size`` past it out of range."""
    strings: dict[int, str] = {}
    for text, i in vocab.items():
        for spelled, shown in TOKEN_SPELLINGS:
            text = text.replace(spelled, shown)
        strings[i] = text
    return [strings.get(i, OUT_OF_RANGE) for i in range(max(size, max(strings, default=-1) + 1))]


def rounded(values: Sequence[float], places: int = 3) -> list[float]:
    """``values`` rounded as SAEDashboard's converter rounds them (numpy's, in float64)."""
    return np.round(np.asarray(values, np.float64), places).tolist()


def percent_share(share: float) -> float:
    """A share as SAEDashboard carries it through a title: a percentage to 3 places, over 100."""
    return float(f"{share:.3%}"[:-1]) / 100


def top_group_bounds(maximum: float) -> tuple[int, float, int]:
    """(bin_min, bin_max, bin_contains) of the top activations' group."""
    return TOP_GROUP, float(f"{maximum:.3f}"), TOP_GROUP


def interval_bounds(low: float, high: float, share: float) -> tuple[float, float, float]:
    """(bin_min, bin_max, bin_contains) of an interval group: its bounds to 3 places, its share."""
    return float(f"{low:.3f}"), float(f"{high:.3f}"), percent_share(share)


def activation_dict(example: ActivationExample) -> dict[str, Any]:
    return {"bin_min": example.bin_min, "bin_max": example.bin_max, "bin_contains": example.bin_contains,
            "tokens": list(example.tokens), "values": rounded(rounded(example.values, 4)),
            "qualifying_token_index": example.qualifying_token_index,
            "dfa_values": [], "dfa_maxValue": 0, "dfa_targetIndex": -1}


def feature_dict(feature: DashboardFeature) -> dict[str, Any]:
    """A feature in ``NeuronpediaDashboardFeature.to_dict``'s order."""
    f = feature
    return {
        "feature_index": f.feature_index,
        "neuron_alignment_indices": list(f.neuron_alignment_indices),
        "neuron_alignment_values": rounded(f.neuron_alignment_values),
        "neuron_alignment_l1": rounded(f.neuron_alignment_l1),
        "correlated_neurons_indices": list(f.correlated_neurons_indices),
        "correlated_neurons_l1": rounded(f.correlated_neurons_l1),
        "correlated_neurons_pearson": rounded(f.correlated_neurons_pearson),
        "correlated_features_indices": list(f.correlated_features_indices),
        "correlated_features_l1": rounded(f.correlated_features_l1),
        "correlated_features_pearson": rounded(f.correlated_features_pearson),
        "neg_str": list(f.neg_str), "neg_values": rounded(f.neg_values),
        "pos_str": list(f.pos_str), "pos_values": rounded(f.pos_values),
        "frac_nonzero": percent_share(f.density) if f.density > 0 else 0,
        "freq_hist_data_bar_values": rounded(f.histogram_values),
        "freq_hist_data_bar_heights": [int(h) for h in f.histogram_heights],
        "logits_hist_data_bar_heights": [int(h) for h in f.logits_histogram_heights],
        "logits_hist_data_bar_values": rounded(f.logits_histogram_values),
        "n_prompts_total": f.n_prompts_total, "n_tokens_in_prompt": f.n_tokens_in_prompt, "dataset": f.dataset,
        "decoder_weights_dist": [],
        "activations": [activation_dict(a) for a in f.activations],
        "vector": [],
    }


def batch_json(model_id: str, layer: int, sae_set: str, features: Sequence[DashboardFeature],
               sae_id_suffix: str | None = None) -> str:
    """The text of one ``batch-N.json``."""
    return json.dumps({"model_id": model_id, "layer": layer, "sae_set": sae_set, "sae_id_suffix": sae_id_suffix,
                       "features": [feature_dict(f) for f in features]})


def batch_sizes(features: int, per_batch: int) -> list[int]:
    """How SAEDashboard splits ``features`` into batches of about ``per_batch``: near-equal parts
    (``np.array_split`` into ceil(features / per_batch)), not fixed-size ones."""
    return [len(part) for part in np.array_split(np.arange(features), -(-features // per_batch))]
