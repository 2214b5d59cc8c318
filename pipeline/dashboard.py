"""Feature dashboards from a store: every feature's top activating tokens in context, activation
intervals, histogram, density and logit effects, as one Beam job (``transforms.dashboard``; the
local FnApiRunner, or any Beam runner's options after the flags).

Plans the job on the launcher: the features and the stored key they read (checked against the
store), the model's folded unembedding and the logit effects of every feature's direction, the
tokenizer's token strings; then runs it. Output (docs/dashboards.md): ``batch-N.json`` as
SAEDashboard 0.8 writes them for Neuronpedia, ``sparsity.safetensors`` (SAELens's),
``top_activations.parquet``, ``viewer/index.html`` (offline), and ``dashboard.json`` last.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re

import numpy as np

from activations.directions import read_directions
from activations.flat_layout import check_output_dir
from activations.index import check_same_model, store_model
from activations.selection import selection_flag
from activations.token_ids import machine_streams
from activations.token_loader import TokenLoader
from common.beam_pipeline import is_dry_run, make_pipeline, worker_user_errors
from common.cli import UserError, flag
from common.files import delete_tree, file_size
from features.dashboard import TOP_EXAMPLES, LogitEffects, folded, logit_effects
from features.encoders import FeatureSet, load_features, parse_neurons, spans
from features.neuronpedia import token_strings
from model.sites import SITES, ArrayKey, describe_key, hook_name, key_parts, normalized_key
from transforms.dashboard import (MANIFEST, SPARSITY, TOP_TABLE, VIEWER_DIR, WORK_DIR, DashboardJob,
                                  FeatureDashboards, write_work_files)
from transforms.tokenizers import load_tokenizer

log = logging.getLogger("runners.dashboard")
WRITTEN = re.compile(rf"batch-\d+\.json|{re.escape(SPARSITY)}|{re.escape(TOP_TABLE)}|{VIEWER_DIR}|{WORK_DIR}|"
                     rf"{re.escape(MANIFEST)}")


def context_flag(text: str) -> int | None:
    """``--context``: tokens each side (>= 0), or ``all``: the whole sample but its first token."""
    if text == "all":
        return None
    if not text.isdigit():
        raise UserError(f"--context takes a number of tokens (>= 0) or all, got {text!r}")
    return int(text)


def key_flag(text: str) -> ArrayKey:
    """``--key``: a layer number (its block output) or a stored site's hook name."""
    return normalized_key(int(text) if text.isdigit() else text)


def indices_flag(text: str) -> tuple[int, ...]:
    try:
        return tuple(spans(text))
    except ValueError:
        raise UserError(f"--feature_indices takes indices and ranges (0-99,120), got {text!r}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DashboardConfig:
    index: str = flag(help="merged index.parquet of the store (local or gs://); index_arrays.parquet beside it")
    features: str = flag(help="the features: a SAELens SAE or transcoder directory (cfg.json + "
                         "sae_weights.safetensors: standard, jumprelu, topk), a directions file (.npz, "
                         "runners.probe's: each direction a feature) or neurons:SITE:LAYER[:DIMS] (a stored site's "
                         "raw dimensions)")
    key: ArrayKey | None = flag(None, "the stored layer or hook name the features read, where the SAE's cfg.json "
                                "names none (runners.train_sae's) or the directions file holds several",
                                parse=key_flag)
    output_dir: str = flag(help="directory to create, local or gs://; dashboard.json, written last, marks it complete")
    feature_indices: tuple[int, ...] | None = flag(None, "only these features (e.g. 0-99,120; default: all)",
                                                   parse=indices_flag)
    most_active: int | None = flag(None, "show only the N features firing on the most tokens (every feature is "
                                   "still measured)")
    top_k: int = flag(TOP_EXAMPLES, f"top tokens kept per feature in top_activations.parquet (dashboards show "
                      f"{TOP_EXAMPLES})")
    context: int | None = flag(8, "tokens each side of an example's token, or all: the whole sample but its first "
                               "token, as SAEDashboard's Neuronpedia runner shows its prompts", parse=context_flag)
    tokens: str | None = flag(None, "read only the tokens of a selection, e.g. assistant,-special (default: every "
                              "stored token)", parse=selection_flag)
    exclude_first_positions: int = flag(0, "leave out each sample's first K tokens (attention sinks, whose "
                                        "outsized activations would top every feature; SAEDashboard leaves out BOS)")
    model_path: str | None = flag(None, "checkpoint whose unembedding gives the logit effects (default: the one the "
                                  "store's runs recorded)")
    tokenizer: str | None = flag(None, "tokenizer of the token strings (default: --model_path's)")
    streams_dir: str | None = flag(None, "streams of pipeline.prepare holding the token ids (default: the stream each "
                                   "runner recorded)")
    model_id: str | None = flag(None, "batch files' model_id (Neuronpedia's name of the model; default: the "
                                "checkpoint's folder name)")
    sae_set: str | None = flag(None, "batch files' sae_set (default: the features' name)")
    features_per_batch: int = flag(128, "features per batch-N.json, about (SAEDashboard's n_features_at_a_time)")
    block_rows: int = flag(1024, "tokens encoded at once on the device")
    overwrite: bool = flag(False, "replace earlier dashboards in --output_dir (nothing else)")

    def validate(self) -> None:
        for name in ("top_k", "features_per_batch", "block_rows"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.top_k < TOP_EXAMPLES:
            raise UserError(f"--top_k must be at least {TOP_EXAMPLES} (the dashboards' top group), got {self.top_k}")
        if self.exclude_first_positions < 0:
            raise UserError(f"--exclude_first_positions must be >= 0, got {self.exclude_first_positions}")
        if self.most_active is not None and self.most_active < 1:
            raise UserError(f"--most_active must be at least 1, got {self.most_active}")


def run_dashboards(config: DashboardConfig, options) -> str:
    """Plans and runs the job; returns the output directory."""
    config.validate()
    dry_run = is_dry_run(options)
    if not dry_run:
        check_output_dir(config.output_dir, config.overwrite, WRITTEN, "dashboard")
    features, summarized, job, loader = plan(config)
    store = store_model(loader.metadata)
    model_path = config.model_path or store["model"]
    decoder = summarized.decoder if job.columns is None else summarized.decoder[list(job.columns)]
    logits, vocab = feature_logits(summarized, decoder, job.key, model_path)
    strings = token_strings(load_tokenizer(config.tokenizer or model_path).vocab, vocab or 0)
    log.info("dashboards of %d of %d feature(s) of %s at %s over %d stored samples in %d shard(s) -> %s",
             min(job.most_active or len(job.numbers), len(job.numbers)), features.size, features.name,
             describe_key(job.key), len(loader.stored), len(loader.stored.shard_paths), config.output_dir)
    if dry_run:
        return config.output_dir
    if config.overwrite:
        delete_tree(config.output_dir)
    write_work_files(job, summarized, logits, strings)
    manifest = {"features": config.features, "feature_set": features.name, "size": features.size,
                "key": hook_name(*key_parts(job.key)), "index": config.index, "model": model_path,
                "context": "all" if config.context is None else config.context, "selection": config.tokens,
                "exclude_first_positions": config.exclude_first_positions, "logit_effects": logits is not None}
    if features.names is not None:  # a directions file's: which direction each feature number is
        manifest["feature_names"] = dict(zip(map(str, features.numbers.tolist()), features.names))
    with worker_user_errors(f" (in the dashboard job; it did not finish: {config.output_dir} is incomplete)"), \
            make_pipeline(options) as pipeline:
        _ = pipeline | "Dashboards" >> FeatureDashboards(job, len(loader.stored.shard_paths),
                                                          config.feature_indices is None, manifest)
    return config.output_dir


def plan(config: DashboardConfig) -> tuple[FeatureSet, FeatureSet, DashboardJob, TokenLoader]:
    """(the features as loaded; those the job encodes, folded; the job; the store's loader),
    checked against the store."""
    key = config.key
    if config.features.startswith("neurons:"):
        key = parse_neurons(config.features)[0]
        features = None
    else:
        features = load_features(config.features, key)
        key = features.key
    probe = DashboardJob(index=config.index, key=key, numbers=(), columns=None, top_k=config.top_k,
                         context=config.context, tokens=config.tokens, streams_dir=config.streams_dir,
                         exclude_first_positions=config.exclude_first_positions,
                         output_dir=config.output_dir, most_active=config.most_active,
                         per_batch=config.features_per_batch, model_id="", layer=0, sae_set="",
                         block_rows=config.block_rows)
    loader = probe.loader()  # refuses a key the store does not hold
    if loader.pooled_store or (loader.selection is not None and loader.selection.pooled):
        raise UserError("dashboards read tokens: the store or --tokens pools one row a sample")
    width = loader.stored.width[key]
    features = features if features is not None else load_features(config.features, key, width)
    if features.encoder.shape[0] != width:
        raise UserError(f"{config.features!r} reads {features.encoder.shape[0]} dimensions, but the store holds "
                        f"{describe_key(key)} {width} wide")
    if config.features.endswith(".npz"):  # a directions file: of the store's model
        check_same_model(read_directions(config.features)[1], store_model(loader.metadata),
                         f"{config.features!r} holds directions", "the store's model")
    check_token_ids(loader, config.streams_dir)
    columns = selected_columns(features, config.feature_indices)
    summarized = folded(features).subset(columns)
    model = store_model(loader.metadata)["model"]
    model_id = config.model_id or os.path.basename(os.path.normpath(str(config.model_path or model or "model")))
    prompts = (len(loader.stored), int(loader.stored.sample_tokens.max(initial=0)))
    keeps_all = summarized.size != len(columns)  # a TopK SAE: it encodes every feature, the job keeps some
    job = dataclasses.replace(probe, numbers=tuple(features.numbers[columns].tolist()),
                              columns=tuple(columns) if keeps_all else None, model_id=model_id,
                              layer=key_parts(key)[1], sae_set=config.sae_set or features.name, prompts=prompts)
    return features, summarized, job, loader


def selected_columns(features: FeatureSet, indices: tuple[int, ...] | None) -> list[int]:
    """The positions in ``features`` of the features numbered ``indices`` (None: all), ascending."""
    if indices is None:
        return list(range(features.size))
    position = {number: i for i, number in enumerate(features.numbers.tolist())}
    missing = [i for i in indices if i not in position]
    if missing:
        raise UserError(f"--feature_indices {missing[0]}: {features.name} has no feature {missing[0]} (its features: "
                        f"{_spans_text(features.numbers)})")
    return sorted({position[i] for i in indices})


def _spans_text(numbers: np.ndarray) -> str:
    return f"{numbers.min()}-{numbers.max()}" if len(numbers) == numbers.max() - numbers.min() + 1 else \
        f"{len(numbers)} of {numbers.min()}-{numbers.max()}"


def check_token_ids(loader: TokenLoader, streams_dir: str | None) -> None:
    """The store's token ids (its machines' streams) must be where the runs recorded them, or in ``streams_dir``."""
    machines = sorted(set(loader.stored.machine_id.tolist()))
    for machine, stream in machine_streams(machines, loader.stored.metadata.get("machines", []), streams_dir).items():
        missing = [part.path for part in stream.parts if file_size(part.path) is None]
        if missing:
            raise UserError(f"the token ids of machine {machine}: no stream at {missing[0]} (--streams_dir names the "
                            "streams of pipeline.prepare)")


def feature_logits(features: FeatureSet, decoder: np.ndarray, key: ArrayKey,
                   model_path: str | None) -> tuple[LogitEffects | None, int | None]:
    """(the logit effects of ``decoder``'s rows [F, d_out], the vocabulary's size): of features
    writing a residual-width site; (None, None) for features writing another space (a
    transcoder's hook_z, mlp.hook_post)."""
    from model.unembedding import folded_unembedding
    written = features.output_key or key
    site = key_parts(written)[0]
    if SITES[site].width not in ("hidden", "resid"):  # (a hyper-connection model's streams: refused below)
        log.warning("no logit effects: %s's decoder writes %s, not the residual stream's space", features.name,
                    describe_key(written))
        return None, None
    if not model_path:
        raise UserError("the store records no model: pass --model_path (the checkpoint whose unembedding gives the "
                        "logit effects)")
    if not os.path.isdir(model_path) and "://" not in model_path and model_path.startswith(("/", ".")):
        raise UserError(f"--model_path {model_path!r}: no such checkpoint directory")
    unembedding = folded_unembedding(model_path)  # [hidden, vocab]
    if decoder.shape[1] != unembedding.shape[0]:
        raise UserError(f"{features.name}'s directions are {decoder.shape[1]} wide, {model_path}'s residual stream "
                        f"{unembedding.shape[0]}")
    norms = np.linalg.norm(decoder, axis=1, keepdims=True)
    return logit_effects(decoder / np.where(norms > 0, norms, 1), unembedding), unembedding.shape[1]
