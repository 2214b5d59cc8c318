"""An intervention resolved into what the model takes: its arrays (``model.interventions``) over
the blocks a forward computes, with each steering's direction read from its file and the means of
a ``mode=mean`` from theirs, and the tokens its steerings add to (its token selection,
``activations.selection``, read on each sequence's role runs)."""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Sequence

import numpy as np

from activations.directions import KINDS as DIRECTION_KINDS, array_name, read_directions
from activations.index import MODEL_SHAPE, check_same_model, model_shape
from activations.selection import parse_selection
from common.cli import UserError
from common.files import read_optional
from common.roles import GENERATED, ROLE_CODES, WRITTEN_ROLES, missing_roles, role_codes
from interventions.spec import Atom, Intervention, parse_interventions
from model.config import DecoderConfig
from model.interventions import Means, add_steering, kept_arrays, remove, remove_expert, route_to, steered_token_mask
from model.sites import array_key, missing_reason, site_width

if TYPE_CHECKING:  # the model's forward (JAX) is not needed to name what it takes
    from model.extract import AblationSource

log = logging.getLogger("interventions.resolve")


def parse_one(spec: str, config: DecoderConfig) -> Intervention:
    """One intervention (``runners.tpu_host --ablate``): a spec that expands to several is refused."""
    found = parse_for([spec], config)
    if len(found) != 1:
        raise UserError(f"--ablate {spec!r} stands for {len(found)} interventions: name one "
                        "(no * or ranges)")
    if found[0].patches:
        raise UserError(f"--ablate {spec!r}: a patch puts a clean prompt's stored values into its corrupted twin: "
                        "runners.ablate --metric logit_diff --patch_from INDEX runs it over a paired stream")
    check_blocks(found, config)
    return found[0]


def parse_for(specs: Sequence[str], config: DecoderConfig) -> list[Intervention]:
    """``parse_interventions`` for this model: a pattern over several blocks leaves out those that
    lack what it acts on (``absent_target``)."""
    return parse_interventions(specs, config.num_hidden_layers, config.num_attention_heads, config.num_experts,
                               absent=lambda atom: absent_target(atom, config))


def absent_target(atom: Atom, config: DecoderConfig) -> str | None:
    """Why block ``atom.layer`` has nothing for ``atom`` to act on, or None: a site it lacks (a
    steering's, a patch's), heads at a block that mixes with a recurrence or has no mixer, a
    sublayer a block of one lacks (Nemotron-H's), experts at a dense block."""
    if atom.kind in ("steer", "patch"):
        return missing_reason(atom.site, config, atom.layer)
    if atom.kind in ("head", "attn") and not config.has_mixer(atom.layer):
        return f"block {atom.layer} is an MLP alone: it has no mixer (mlp:{atom.layer} removes its MLP)"
    if atom.kind == "mlp" and not config.has_mlp(atom.layer):
        return f"block {atom.layer} is a mixer alone: it has no MLP (attn:{atom.layer} removes its mixer)"
    if atom.kind == "head" and config.is_recurrent(atom.layer):
        return (f"block {atom.layer} mixes with {config.mixer_name(atom.layer)}: it has no attention heads "
                f"(attn:{atom.layer} removes its mixer)")
    if atom.kind in ("expert", "route") and not config.is_sparse(atom.layer):
        return (f"block {atom.layer} has a dense MLP, no experts (its mixtures of experts: blocks "
                f"{', '.join(map(str, config.sparse_layers))})")
    return None


def check_blocks(interventions: Sequence[Intervention], config: DecoderConfig) -> None:
    """``UserError`` for an atom whose block has nothing for it to act on (``absent_target``), or
    a steering whose file does not fit the model (read now, before any weight is)."""
    for intervention in interventions:
        for atom in intervention.atoms:
            if reason := absent_target(atom, config):
                raise UserError(f"intervention {intervention.name!r}: {reason}")
            if atom.kind == "steer":
                steering_vector(atom, config)
        removed = [atom.layer for atom in intervention.atoms if atom.kind == "expert"]
        for layer in set(removed):
            if removed.count(layer) > config.num_experts - config.moe.top_k:
                raise UserError(f"intervention {intervention.name!r}: removes {removed.count(layer)} of block "
                                f"{layer}'s {config.num_experts} experts: each token needs {config.moe.top_k} left")


def ablation_arrays(intervention: Intervention, config: DecoderConfig, num_layers: int,
                    means: Means | None = None) -> dict[str, np.ndarray]:
    """The forward's inputs for one intervention over blocks ``0..num_layers-1``
    (``model.interventions``): per block which heads / sublayers / the block itself / its norms are
    kept, what replaces each one that is not (its mean, else zero, or a neutral norm weight), the
    means, and what its steerings add at each site they steer."""
    if intervention.needs_means and means is None:
        raise ValueError(f"{intervention.name} replaces by means: they are needed")
    if intervention.patches:
        raise ValueError(f"{intervention.name} patches: its arrays are each pair's (ablation.patching)")
    arrays = kept_arrays(config, num_layers, means)
    for atom in intervention.atoms:
        if atom.layer >= num_layers:
            raise ValueError(f"{atom} is past the {num_layers} blocks computed")
        if atom.kind == "expert":
            remove_expert(arrays, atom.layer, atom.head)
        elif atom.kind == "route":
            route_to(arrays, atom.layer, atom.head)
        elif atom.kind == "steer":
            add_steering(arrays, atom.site, atom.layer, np.float32(atom.alpha) * steering_vector(atom, config))
        else:
            remove(arrays, "block" if atom.kind == "layer" else atom.kind, atom.layer, atom.head, atom.mode == "mean")
    return arrays


def intervention_for(spec: str | None, means_path: str | None, config: DecoderConfig,
                     num_layers: int) -> Intervention | None:
    """The intervention ``spec`` (``--ablate``) on a model computing ``num_layers`` blocks (None
    for none); ``UserError`` for a bad spec, one acting past the last block computed, means
    missing or means without a spec."""
    if spec is None:
        if means_path:
            raise UserError("--ablation_means is for --ablate (an intervention with mode=mean)")
        return None
    intervention = parse_one(spec, config)
    late = [a for a in intervention.atoms if a.layer >= num_layers]
    if late:
        raise UserError(f"--ablate {spec!r} acts on block {late[0].layer}, after the last layer extracted "
                        f"({num_layers - 1}): it would change nothing stored")
    if intervention.needs_means and not means_path:
        raise UserError(f"--ablate {spec!r} replaces by means: pass --ablation_means (runners.ablate "
                        "writes means.npz)")
    return intervention


def ablation_for(spec: str | None, means_path: str | None, config: DecoderConfig,
                 num_layers: int) -> tuple[Intervention | None, dict[str, np.ndarray] | None]:
    """The intervention ``spec`` (``intervention_for``) and its arrays over the blocks computed
    (None, None for none)."""
    intervention = intervention_for(spec, means_path, config, num_layers)
    if intervention is None:
        return None, None
    means = Means.load(means_path) if intervention.needs_means else None
    return intervention, ablation_arrays(intervention, config, num_layers, means)


def ablation_source(spec: str | None, means_path: str | None) -> AblationSource | None:
    """What ``model.extract.Extractor.load`` takes for the intervention ``spec`` (None: none): the
    model's config and the blocks it computes -> (the arrays, the tokens its steerings choose)."""
    if spec is None and not means_path:
        return None

    def source(config: DecoderConfig, num_layers: int) -> tuple[dict[str, np.ndarray] | None, str | None]:
        intervention, arrays = ablation_for(spec, means_path, config, num_layers)
        return arrays, intervention and intervention.steer_tokens
    return source


def steered_positions(tokens: str, runs: Sequence | None, length: int, sample_id: int | None = None) -> np.ndarray:
    """[selected] int32: the positions, below ``length``, of a sequence with these role runs
    (common.roles) that a steering with the selection ``tokens`` adds to."""
    if runs is None:
        raise missing_roles(f"a steering's tokens={tokens}", sample_id)
    codes = role_codes(runs)[:length]
    return parse_selection(tokens).positions_of(codes, None, len(codes))


def steered_mask(tokens: str, roles: Sequence[Sequence | None], rows: int, length: int,
                 sample_ids: Sequence[int] | None = None) -> np.ndarray:
    """[rows, length] bool, the ``STEER_TOKENS`` input of a batch of sequences with these role runs
    (``steered_positions``)."""
    return steered_token_mask([steered_positions(tokens, runs, length, None if sample_ids is None else sample_ids[row])
                               for row, runs in enumerate(roles)], rows, length)


def steers_written_tokens(tokens: str | None, thinking: bool = False) -> bool:
    """Whether a steering with the selection ``tokens`` adds to each token the model writes: its
    role ``generated``, or where the tokenizer marks ``thinking`` sections that too (a token's is
    not known while it is written, so the selection must treat the two alike)."""
    if not tokens:
        return True
    selection = parse_selection(tokens)
    kept = {role: len(selection.positions_of(np.array([ROLE_CODES[role]], np.uint8), None, 1)) == 1
            for role in (WRITTEN_ROLES if thinking else (GENERATED,))}
    if len(set(kept.values())) > 1:
        kept_one, left_out = sorted(kept, key=kept.get, reverse=True)
        raise UserError(f"a steering's tokens={tokens} keeps {kept_one} tokens but not {left_out}: while generating, "
                        "whether a written token is thinking is not yet known (treat both alike)")
    return kept[GENERATED]


def steering_digests(intervention: Intervention | None) -> dict[str, str] | None:
    """A short hash of each steering's directions file, by path (None: no steering): a resume, or
    a re-run into the same output, must steer with the same vectors."""
    paths = sorted({a.path for a in intervention.atoms if a.kind == "steer"}) if intervention else []
    if not paths:
        return None
    return {path: hashlib.blake2b(read_optional(path) or b"", digest_size=8).hexdigest() for path in paths}


def steering_vector(atom: Atom, config: DecoderConfig) -> np.ndarray:
    """[hidden] float32: the direction ``atom`` adds at its site, from its file; one line when the
    file is of another model (another family, depth or hidden size) or lacks it. (A file
    of another checkpoint of the same shape, a base model's direction steering its chat model, is
    allowed.)"""
    arrays, metadata = read_directions(atom.path)
    check_same_model(metadata, model_shape(config), f"{atom.path!r} holds directions", "this model")
    unknown = [name for name in MODEL_SHAPE if metadata.get(name) is None]
    if unknown:
        log.warning("%s does not record the model's %s: only its width is checked", atom.path, ", ".join(unknown))
    kinds = [atom.direction] if atom.direction else DIRECTION_KINDS  # diff_in_means first
    names = [array_name(kind, array_key(atom.site, atom.layer)) for kind in kinds]
    found = next((name for name in names if name in arrays), None)
    if found is None:
        raise UserError(f"{atom.path!r} has no {' or '.join(names)} to steer {atom} with (it has "
                        f"{', '.join(sorted(arrays)) or 'nothing'})")
    vector, width = arrays[found], site_width(atom.site, config, atom.layer)
    if vector.shape != (width,):
        raise UserError(f"{atom.path!r}: {found} is {vector.shape[-1]} wide, the model's {atom.site} is {width} "
                        f"wide{' (every hyper-connection stream)' if width != config.hidden_size else ''}")
    return vector.astype(np.float32)
