"""Checks Neuronpedia batch files against SAEDashboard 0.8.0's own code.

Runs inside the SAEDashboard environment (``tests/saedashboard.py``), so it imports nothing from
the project::

    python tests/saedashboard_check.py INPUT.npz BATCH_DIR

``INPUT.npz`` holds ``tokens`` (int64 [B, S], the prompts), ``feature_acts`` (float32 [F, B, S],
each feature's activation at every token), ``feature_indices`` (int64 [F], their indices in the
batch files), ``logits`` (float32 [F, V], each feature's direction through the unembedding) and
``vocab_json`` (a 0-d str array: a JSON list of the V raw token strings by id; ``null`` entries at
the end stand for ids the tokenizer lacks, which SAEDashboard pads with ``<|outofrange|>``).

For each feature, SAEDashboard's own result is computed from those arrays as its runner computes
it (the histograms, the logits table, the sequence groups of ``SequenceDataGenerator``, converted by
``NeuronpediaConverter``) and compared with the feature in ``BATCH_DIR/batch-*.json``:

* every file must load with ``NeuronpediaDashboardBatch(**data)`` and be exactly what its
  ``to_dict`` gives back (the same keys, in the same order, and the same text), every feature
  must appear once, in ascending order through batch-0, batch-1, ..., and each feature and example
  must have the keys SAEDashboard writes;
* SAEDashboard's ``NeuronpediaDashboardFeature.__eq__`` (its tolerances) compares everything with the
  examples restricted to the top group. Where values tie, which of the tied tokens SAEDashboard
  lists, and in which order, is up to torch.topk (not by prompt and position), so ours may differ
  there only: if the comparison fails on the examples alone, ours must show positions (each found
  in the prompts) with exactly the activations of SAEDashboard's; ``pos_str``/``neg_str`` may list
  tokens with tied logits in another order;
* interval ("quantile") examples are random samples, so for those: the same groups in the same
  order (bounds and share within its tolerances), as many examples in each, each example a
  distinct position of some prompt whose tokens it shows, with its value inside its group.

Not computable from the inputs, so copied from ours before comparing: the neuron alignment and
correlation tables and ``dataset``. Prints a JSON report on stdout; exits 0 when every feature
agrees, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import random
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch
from sae_dashboard.components import ActsHistogramData, LogitsHistogramData
from sae_dashboard.components_config import (ActsHistogramConfig, Column, FeatureTablesConfig,
                                             LogitsHistogramConfig, LogitsTableConfig, SequencesConfig)
from sae_dashboard.data_parsing_fns import get_logits_table_data
from sae_dashboard.feature_data import FeatureData
from sae_dashboard.layout import SaeVisLayoutConfig
from sae_dashboard.neuronpedia.neuronpedia_converter import FeatureProcessor, NeuronpediaConverter
from sae_dashboard.neuronpedia.neuronpedia_dashboard import NeuronpediaDashboardBatch, NeuronpediaDashboardFeature
from sae_dashboard.neuronpedia.neuronpedia_runner import NeuronpediaRunner
from sae_dashboard.neuronpedia.neuronpedia_runner_config import NeuronpediaRunnerConfig
from sae_dashboard.sae_vis_data import SaeVisConfig, SaeVisData
from sae_dashboard.sequence_data_generator import SequenceDataGenerator

# eindex (SAEDashboard's indexing) warns on every call that torch will one day read its list index
# differently; on torch 2.13 it still indexes correctly (the examples' tokens are checked against
# the prompts), so the warning is noise.
warnings.filterwarnings("ignore", message="Using a non-tuple sequence for multidimensional indexing")

TOP = -1  # bin_min of the top activations' group
BIN_TOLERANCE = 0.1        # SAEDashboard's, for bin_min and bin_max (EQUAL_VALUE_TOLERANCE)
CONTAINS_TOLERANCE = 0.001  # its, for bin_contains
VALUES_RTOL = 0.5          # its, for an example's values (np.allclose(a, b, 0.5))
# A written value and a written bound are each rounded to 3 places (the value to 4 first).
ROUNDING_SLACK = 0.0005 + 0.00005 + 0.0005 + 1e-9
# Not computable from the inputs (they need the decoder, the encoder or the dataset's name).
NOT_CHECKED = ("neuron_alignment_indices", "neuron_alignment_values", "neuron_alignment_l1",
               "correlated_neurons_indices", "correlated_neurons_l1", "correlated_neurons_pearson",
               "correlated_features_indices", "correlated_features_l1", "correlated_features_pearson", "dataset")


@dataclasses.dataclass
class Inputs:
    tokens: np.ndarray        # int64 [B, S]
    feature_acts: np.ndarray  # float32 [F, B, S]
    feature_indices: list[int]
    logits: np.ndarray        # float32 [F, V]
    vocab: dict[int, str]     # token id -> string, as SAEDashboard's runner builds it
    strings: list[list[str]]  # each prompt's tokens 1..S-1 as SAEDashboard writes them


@dataclasses.dataclass
class Theirs:
    feature: dict[str, Any]               # SAEDashboard's feature, as its converter writes it
    top_positions: list[tuple[int, int]]  # (prompt, position) of each of its top examples
    logit_ids: dict[str, list[int]]       # the token ids of its pos_str and neg_str


def load_inputs(path: Path) -> Inputs:
    data = np.load(path)
    tokens, logits = data["tokens"].astype(np.int64), data["logits"].astype(np.float32)
    vocab = vocab_dict(json.loads(str(data["vocab_json"])), logits.shape[1])
    return Inputs(tokens=tokens, feature_acts=data["feature_acts"].astype(np.float32),
                  feature_indices=[int(i) for i in data["feature_indices"]], logits=logits, vocab=vocab,
                  strings=[[vocab[int(t)] for t in row[1:]] for row in tokens])


def vocab_dict(raw_vocab: list[str | None], d_vocab: int) -> dict[int, str]:
    """SAEDashboard's runner's own ``get_vocab_dict`` (its HTML_ANOMALIES replacements, then
    ``<|outofrange|>`` up to d_vocab), run on a stand-in for its model's tokenizer."""
    tokenizer = SimpleNamespace(vocab={text: i for i, text in enumerate(raw_vocab) if text is not None})
    runner = SimpleNamespace(model=SimpleNamespace(tokenizer=tokenizer, cfg=SimpleNamespace(d_vocab=d_vocab)))
    return NeuronpediaRunner.get_vocab_dict(runner)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# SAEDashboard's result


def their_feature(inputs: Inputs, f: int, ours_batch: dict[str, Any]) -> Theirs:
    """Feature ``f`` as SAEDashboard's runner and converter make it from the same arrays."""
    seed_everything(0)  # as SaeVisRunner.set_seeds; only the interval samples depend on it
    acts = torch.from_numpy(inputs.feature_acts[f])
    logits = torch.from_numpy(inputs.logits[f])
    index = inputs.feature_indices[f]
    data = FeatureData()
    data.logits_histogram_data = LogitsHistogramData.from_data(data=logits, n_bins=50, tickmode="5 ticks",
                                                               title=None)
    nonzero = acts[acts > 0]
    density = nonzero.numel() / acts.numel()
    data.acts_histogram_data = ActsHistogramData.from_data(data=nonzero, n_bins=50, tickmode="5 ticks",
                                                           title=f"ACTIVATIONS<br>DENSITY = {density:.3%}")
    data.logits_table_data = get_logits_table_data(logit_vector=logits, n_rows=10)
    cfg = sae_vis_config(index)
    # W_U only serves ablation experiments, which the runner leaves off.
    generator = SequenceDataGenerator(cfg=cfg, tokens=torch.from_numpy(inputs.tokens),
                                      W_U=torch.zeros(1, logits.numel()))
    data.sequence_data = generator.get_sequences_data(feat_acts=acts, feat_logits=logits, resid_post=torch.tensor([]),
                                                      feature_resid_dir=torch.zeros(1))
    top_group = data.sequence_data.seq_group_data[0]
    top_positions = [(s.original_index, s.qualifying_token_index) for s in top_group.seq_data]
    text = NeuronpediaConverter.convert_to_np_json(
        SimpleNamespace(cfg=SimpleNamespace(d_vocab=logits.numel())),  # type: ignore[arg-type]
        SaeVisData(cfg=cfg, feature_data_dict={index: data}), runner_config(inputs, ours_batch), inputs.vocab)
    table = data.logits_table_data
    return Theirs(feature=json.loads(text)["features"][0], top_positions=top_positions,
                  logit_ids={"pos_str": table.top_token_ids, "neg_str": table.bottom_token_ids})


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)


def sae_vis_config(index: int) -> SaeVisConfig:
    """The layout NeuronpediaRunner builds for every batch."""
    layout = SaeVisLayoutConfig(columns=[Column(
        SequencesConfig(stack_mode="stack-all", buffer=None, compute_buffer=True, n_quantiles=5,
                        top_acts_group_size=20, quantile_group_size=5),
        ActsHistogramConfig(), LogitsHistogramConfig(), LogitsTableConfig(), FeatureTablesConfig(n_rows=3))])
    return SaeVisConfig(hook_point="hook", features=[index], feature_centric_layout=layout)


def runner_config(inputs: Inputs, ours_batch: dict[str, Any]) -> NeuronpediaRunnerConfig:
    """What the converter reads of the runner's config: the batch's names come from our file (they
    are not computable), the prompt counts from the inputs."""
    _, batch, seq = inputs.feature_acts.shape
    cfg = NeuronpediaRunnerConfig(sae_set=ours_batch.get("sae_set", ""), sae_path="", outputs_dir="",
                                  np_sae_id_suffix=ours_batch.get("sae_id_suffix"),
                                  n_prompts_total=batch, n_tokens_in_prompt=seq)
    cfg.model_id, cfg.layer = ours_batch.get("model_id", ""), ours_batch.get("layer", 0)
    return cfg


# ---------------------------------------------------------------------------------------------
# Our batch files


@dataclasses.dataclass
class Batches:
    features: dict[int, dict[str, Any]]  # feature index -> our feature dict
    batch_of: dict[int, dict[str, Any]]  # feature index -> its file's batch fields
    problems: list[dict[str, Any]]
    order: list[int] = dataclasses.field(default_factory=list)  # feature indices as the files list them


def load_batches(batch_dir: Path) -> Batches:
    found = Batches({}, {}, [])
    paths = sorted(batch_dir.glob("batch-*.json"), key=lambda p: int(p.stem.split("-", 1)[1]))
    if not paths:
        found.problems.append({"file": str(batch_dir), "field": "files", "message": "no batch-*.json"})
    for path in paths:
        text = path.read_text()
        raw = json.loads(text)
        problem = file_layout_problem(text, raw)
        if problem:
            found.problems.append({"file": path.name, "field": "layout", "message": problem})
            continue
        for feature in raw["features"]:
            index = feature["feature_index"]
            if index in found.features:
                found.problems.append({"file": path.name, "feature": index, "field": "feature_index",
                                       "message": "feature appears more than once"})
            found.features[index] = feature
            found.batch_of[index] = {k: v for k, v in raw.items() if k != "features"}
            found.order.append(index)
    # The runner splits range(d_sae) into consecutive batches, each in ascending order.
    if any(a >= b for a, b in zip(found.order, found.order[1:])):
        found.problems.append({"file": str(batch_dir), "field": "feature_index",
                               "message": "features not in ascending order through batch-0, batch-1, ..."})
    return found


def file_layout_problem(text: str, raw: dict[str, Any]) -> str | None:
    """Why SAEDashboard's classes would not give this file back as it is, or None."""
    try:
        batch = NeuronpediaDashboardBatch(**raw)
    except TypeError as error:  # a key its constructors do not take
        return f"SAEDashboard cannot load it: {error}"
    again = batch.to_dict()
    if again != raw:
        return f"keys differ from SAEDashboard's: {key_difference(raw, again)}"
    if list(again) != list(raw) or json.dumps(again) != text:
        return "not the text SAEDashboard writes for it (key order, spacing, escaping or a newline)"
    return None


def key_difference(ours: Any, theirs: Any, where: str = "") -> str:
    """The first place where two JSON values' keys differ."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        if set(ours) != set(theirs):
            return (f"{where or 'batch'}: extra {sorted(set(ours) - set(theirs))}, "
                    f"missing {sorted(set(theirs) - set(ours))}")
        for key in ours:
            found = key_difference(ours[key], theirs[key], f"{where}.{key}")
            if found:
                return found
    if isinstance(ours, list) and isinstance(theirs, list):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            found = key_difference(a, b, f"{where}[{i}]")
            if found:
                return found
    return ""


# ---------------------------------------------------------------------------------------------
# The comparison


def compare(inputs: Inputs, f: int, ours: dict[str, Any], theirs: Theirs) -> tuple[list[dict[str, Any]], list[str]]:
    """(problems, notes) of our feature ``f`` against SAEDashboard's."""
    mine = dict(theirs.feature, **{key: ours.get(key) for key in NOT_CHECKED})
    problems = layout_problems(ours, mine) + strict_problems(ours, mine)
    notes: list[str] = []
    if problems:
        return problems, notes
    for key in ("pos_str", "neg_str"):
        if ours[key] != mine[key] and logit_ties_agree(inputs, f, ours[key], theirs.logit_ids[key]):
            mine[key] = ours[key]
            notes.append(f"{key} agrees up to the order of tied logits")
    ours_top, ours_rest = split_groups(ours["activations"])
    their_top, their_rest = split_groups(mine["activations"])
    if len(ours_top) != len(their_top):  # its equality would let ours have fewer
        return problems + [{"field": "top examples", "ours": len(ours_top), "theirs": len(their_top)}], notes
    problem = their_equality(dict(ours, activations=ours_top), dict(mine, activations=their_top))
    if problem and their_equality(dict(ours, activations=[]), dict(mine, activations=[])) is None:
        # Only the examples differ: fine if ours are tied alternatives to theirs.
        tie_problem = top_tie_problem(inputs, f, ours_top, their_top, theirs.top_positions)
        if tie_problem is None:
            notes.append("top examples agree up to the order of tied activations")
            problem = None
        else:
            problem["tie_check"] = tie_problem
    if problem:
        problems.append(problem)
    problems += interval_problems(inputs, f, ours_rest, their_rest)
    return problems, notes


def layout_problems(ours: dict[str, Any], theirs: dict[str, Any]) -> list[dict[str, Any]]:
    """Our feature's keys, and each example's, must be those SAEDashboard writes, in its order."""
    problems = []
    if list(ours) != list(theirs):
        problems.append({"field": "keys", "ours": list(ours), "theirs": list(theirs)})
    their_keys = list(theirs["activations"][0]) if theirs["activations"] else None
    for i, example in enumerate(ours.get("activations", [])):
        if their_keys is not None and list(example) != their_keys:
            problems.append({"field": f"activations[{i}] keys", "ours": list(example), "theirs": their_keys})
            break
    return problems


def strict_problems(ours: dict[str, Any], theirs: dict[str, Any]) -> list[dict[str, Any]]:
    """Fields SAEDashboard's equality skips but its runner always writes the same way."""
    return [{"field": key, "ours": ours.get(key), "theirs": theirs[key]}
            for key in ("vector", "decoder_weights_dist") if ours.get(key) != theirs[key]]


def split_groups(activations: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the top group's examples, the interval groups' examples)."""
    return ([a for a in activations if a["bin_min"] == TOP], [a for a in activations if a["bin_min"] != TOP])


def their_equality(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any] | None:
    """NeuronpediaDashboardFeature.__eq__ on the two; None if equal, else what it reported."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # it prints its reasons; stdout is our report's
        try:
            same = NeuronpediaDashboardFeature(**ours) == NeuronpediaDashboardFeature(**theirs)
            failure = None if same else "not equal"
        except (AssertionError, IndexError, ValueError, TypeError) as error:
            failure = f"{type(error).__name__}: {error}"
    if failure is None:
        return None
    # It prints the innermost reason first ("values does not match: a and b"), then, for an
    # example, "activation i does not match" (with an empty repr), and nothing for an exception.
    said = [line for line in printed.getvalue().splitlines() if "does not match" in line]
    if not said:
        return {"field": "?", "message": failure}
    field = said[0].split(" does not match")[0]
    if said[-1].startswith("activation "):
        field = f"activations[{said[-1].split()[1]}].{field}"
    return {"field": field, "message": said[0]}


def top_tie_problem(inputs: Inputs, f: int, ours: list[dict[str, Any]], theirs: list[dict[str, Any]],
                    their_positions: list[tuple[int, int]]) -> str | None:
    """Whether our top examples are SAEDashboard's up to ties: as many, with its group bounds, each
    a distinct position of a prompt whose tokens it shows, whose activation is exactly that of
    SAEDashboard's example in the same place."""
    if len(ours) != len(theirs):
        return f"{len(ours)} top examples, SAEDashboard has {len(theirs)}"
    acts = inputs.feature_acts[f]
    used: set[tuple[int, int]] = set()
    for i, (example, their_example, (row, pos)) in enumerate(zip(ours, theirs, their_positions)):
        bounds = bounds_problem(example, their_example)
        if bounds:
            return f"top example {i}: {bounds}"
        wanted = acts[row, pos]
        spot = locate(inputs, f, example, used, lambda r, p, wanted=wanted: acts[r, p] == wanted)
        if spot is None:
            return (f"top example {i}: no unused position of a prompt with its tokens and values has "
                    f"SAEDashboard's activation {float(wanted)!r} at index {example['qualifying_token_index']}")
        used.add(spot)
    return None


def logit_ties_agree(inputs: Inputs, f: int, ours: list[str], their_ids: list[int]) -> bool:
    """Whether our tokens are SAEDashboard's up to the order torch.topk gives tied logits: each a
    distinct token whose logit is exactly that of its token in the same place."""
    if len(ours) != len(their_ids):
        return False
    logits, used = inputs.logits[f], set()
    for text, their_id in zip(ours, their_ids):
        match = next((i for i, t in inputs.vocab.items()
                      if t == text and i not in used and i < len(logits) and logits[i] == logits[their_id]), None)
        if match is None:
            return False
        used.add(match)
    return True


def interval_problems(inputs: Inputs, f: int, ours: list[dict[str, Any]],
                      theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Interval groups: the same groups in the same order, as many examples in each, and each
    example a real position of a prompt, with its value in its group's bounds."""
    our_groups, their_groups = groups(ours), groups(theirs)
    if len(our_groups) != len(their_groups):
        return [{"field": "interval groups", "ours": [g[0] for g in our_groups],
                 "theirs": [g[0] for g in their_groups]}]
    problems = []
    used: set[tuple[int, int]] = set()
    for (our_bins, our_examples), (their_bins, their_examples) in zip(our_groups, their_groups):
        bounds = bounds_problem(dict(zip(("bin_min", "bin_max", "bin_contains"), our_bins)),
                                dict(zip(("bin_min", "bin_max", "bin_contains"), their_bins)))
        if bounds:
            problems.append({"field": "interval group bounds", "ours": our_bins, "theirs": their_bins,
                             "message": bounds})
            continue
        if len(our_examples) != len(their_examples):
            problems.append({"field": "interval group size", "group": our_bins, "ours": len(our_examples),
                             "theirs": len(their_examples)})
            continue
        for example in our_examples:
            problem = interval_example_problem(inputs, f, example, their_bins, used)
            if problem:
                problems.append({"field": "interval example", "group": our_bins, "message": problem,
                                 "ours": {"tokens": example["tokens"], "values": example["values"],
                                          "qualifying_token_index": example["qualifying_token_index"]}})
    return problems


def interval_example_problem(inputs: Inputs, f: int, example: dict[str, Any], their_bins: tuple[float, ...],
                             used: set[tuple[int, int]]) -> str | None:
    index = example["qualifying_token_index"]
    low, high = example["bin_min"], example["bin_max"]
    if index >= 0:  # index -1 is position 0, whose value the example does not carry
        value = example["values"][index] if index < len(example["values"]) else None
        if value is None or not low - ROUNDING_SLACK <= value <= high + ROUNDING_SLACK:
            return f"qualifying value {value!r} outside its group's bounds [{low}, {high}]"
    acts = inputs.feature_acts[f]

    def inside(r: int, p: int) -> bool:  # the input's activation there, against SAEDashboard's bounds
        return their_bins[0] - ROUNDING_SLACK <= float(acts[r, p]) <= their_bins[1] + ROUNDING_SLACK

    spot = locate(inputs, f, example, used, inside)
    if spot is None:
        return "no unused position of a prompt with its tokens and values lies in the group's bounds"
    used.add(spot)
    return None


def locate(inputs: Inputs, f: int, example: dict[str, Any], used: set[tuple[int, int]],
           accept: Callable[[int, int], bool]) -> tuple[int, int] | None:
    """A (prompt, position) the example may show: the prompt's tokens 1..S-1 are its tokens, its
    values match the feature's there (SAEDashboard's tolerance), and ``accept(prompt, position)``."""
    pos = example["qualifying_token_index"] + 1
    if not 0 <= pos < inputs.tokens.shape[1]:
        return None
    acts = inputs.feature_acts[f]
    for row, strings in enumerate(inputs.strings):
        if strings != example["tokens"] or (row, pos) in used or not accept(row, pos):
            continue
        expected = [float(v) for v in FeatureProcessor.round_list([round(float(a), 4) for a in acts[row, 1:]])]
        if len(expected) == len(example["values"]) and np.allclose(example["values"], expected, VALUES_RTOL):
            return row, pos
    return None


def groups(examples: list[dict[str, Any]]) -> list[tuple[tuple[float, ...], list[dict[str, Any]]]]:
    """Consecutive examples with the same (bin_min, bin_max, bin_contains), in order."""
    found: list[tuple[tuple[float, ...], list[dict[str, Any]]]] = []
    for example in examples:
        bins = (example["bin_min"], example["bin_max"], example["bin_contains"])
        if found and found[-1][0] == bins:
            found[-1][1].append(example)
        else:
            found.append((bins, [example]))
    return found


def bounds_problem(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """A group's bounds and share, within SAEDashboard's tolerances."""
    for key, tolerance in (("bin_min", BIN_TOLERANCE), ("bin_max", BIN_TOLERANCE),
                           ("bin_contains", CONTAINS_TOLERANCE)):
        if abs(float(ours[key]) - float(theirs[key])) >= tolerance:
            return f"{key}: ours {ours[key]!r}, theirs {theirs[key]!r}"
    return None


# ---------------------------------------------------------------------------------------------


def check(inputs: Inputs, batch_dir: Path) -> dict[str, Any]:
    batches = load_batches(batch_dir)
    report: dict[str, Any] = {"files": batches.problems, "features_in_files": len(batches.order), "features": []}
    for f, index in enumerate(inputs.feature_indices):
        entry: dict[str, Any] = {"feature_index": index}
        if index not in batches.features:
            entry["problems"] = [{"field": "feature_index", "message": "not in any batch file"}]
        else:
            theirs = their_feature(inputs, f, batches.batch_of[index])
            entry["problems"], entry["notes"] = compare(inputs, f, batches.features[index], theirs)
            entry["ours"] = summary(batches.features[index])
        entry["ok"] = not entry["problems"]
        report["features"].append(entry)
    report["ok"] = not batches.problems and all(e["ok"] for e in report["features"])
    return report


def summary(feature: dict[str, Any]) -> dict[str, Any]:
    """What a reader of the report wants to see of a feature: its density and its groups."""
    top, rest = split_groups(feature.get("activations", []))
    return {"frac_nonzero": feature.get("frac_nonzero"), "top_examples": len(top),
            "interval_groups": [[*bins, len(examples)] for bins, examples in groups(rest)]}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python saedashboard_check.py INPUT.npz BATCH_DIR", file=sys.stderr)
        return 2
    inputs = load_inputs(Path(argv[1]))
    with contextlib.redirect_stdout(sys.stderr):  # keep anything SAEDashboard prints out of the report
        report = check(inputs, Path(argv[2]))
    print(json.dumps(report, indent=1, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
