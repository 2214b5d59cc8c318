"""Interventions on the model as users write them: a small spec language, parsed into atoms.

    head:L.H    attention head H of block L: its slice of the o_proj input
    layer:L     block L skipped: the residual passes through it unchanged
    attn:L      block L's attention output, as added to the residual (after the
                post-attention norm in a sandwich block: Gemma 2, 3, OLMo 2)
    mlp:L       block L's MLP output, likewise (after the post-feedforward norm)
    norm:L      every norm of block L (its weight, and a LayerNorm's bias): the
                pre-attention and pre-MLP norms, the post-attention and post-feedforward
                norms of a sandwich block, and the q/k norms (Qwen3, Gemma 3, OLMo 2) or a
                latent attention's q and latent norms (DeepSeek)
    expert:L.E  expert E of block L's mixture of experts removed: its router logit is -inf,
                so the router picks its top k among the others, their probabilities
                renormalised as the family's router would without it
    route:L.E   every token of block L sent to expert E alone, with weight 1 (a shared
                expert still adds its part); the routing sites still record the router's choice
    steer:L:FILE[:alpha=A][:direction=KIND][:site=SITE][:tokens=ROLES]
                A times a direction added at every token (or, with tokens=, at the tokens
                of these roles: ``steering_tokens``) to SITE of block L (``model.interventions.STEER_SITES``:
                a point of the residual stream, or what a sublayer adds to it; hook_resid_post,
                the block's output, by default): the array ``KIND/blocks.L.SITE`` of a
                directions file (``activations.directions``: runners.probe writes them; KIND
                diff_in_means, the default where the file has it, or probe), A 1 by default;
                FILE local or gs://. What is stored at SITE is the steered value

    patch:L:SITE[:heads=H][:pos=P][:tokens=ROLES]
                activation patching (``runners.ablate --metric logit_diff --patch_from STORE``): at
                SITE of block L (``model.interventions.PATCH_SITES``: the residual stream, what a sublayer adds
                to it, or ``attn.hook_z``, the heads' outputs) the corrupted prompt takes the value
                its pair's clean prompt has there, read from a store; at every position (the two
                prompts of one length), or with tokens= at the tokens of these roles (the i-th
                chosen token of one prompt takes the i-th of the other: their counts must agree).
                heads= (``attn.hook_z`` only) patches one head; pos= the P-th position (of those
                chosen), ``*`` or a range a cell per position: TransformerLens's grids

Each is followed by ``:mode=zero`` (the default) or ``:mode=mean`` (``expert``, ``route`` and
``steer``, ``patch`` have no mode), and several joined by ``+`` form one intervention (``head:3.1+head:3.2``).
``zero`` removes the component: zeros for a head, attn or mlp output, the bare residual for a
layer, and a neutral weight for a norm (the norm then only normalises: w = 1 for x * w, w = 0
for Gemma's x * (1 + w), and a LayerNorm's bias 0). ``mean`` replaces it by its mean over the
stream's real tokens under the unablated model (``Means``, computed by a first pass): a head's
output, a sublayer's output, a block's contribution (output - input); for a norm, each weight
(and bias) vector's own mean.

In a grid, L and H may be ``*`` (all) or a range ``A-B`` (inclusive; read against a model,
``interventions.resolve.parse_for``, a grid over blocks leaves out those without its target: the
Gated DeltaNet blocks of a head grid, say); every combination is one
intervention: ``head:0-3.*`` is one intervention per head of blocks 0 to 3, ``mlp:*:mode=mean``
one per block, ``patch:*:attn.hook_z:heads=*`` one per head. A patch's ``pos=*`` (or ``pos=A-B``)
stays in the intervention: each pair's prompt decides its positions (``ablation.patching``).

An intervention becomes the arrays the compiled forward takes in ``interventions.resolve``
(``model.interventions``: the same shapes for every intervention of a model, so one compiled
forward per batch shape serves a whole grid; a steering adds an array per site it steers, and with
``tokens=`` the batch's tokens, so each set of steered sites compiles its own).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Callable, Sequence

import numpy as np

from activations.directions import KINDS as DIRECTION_KINDS
from activations.selection import parse_selection
from common.cli import UserError
from model.interventions import PATCH_SITES, STEER_SITES
from model.sites import ATTN_Z, RESID_POST

KINDS = ("head", "layer", "attn", "mlp", "norm", "expert", "route", "steer", "patch")
INDEXED = {"head": "head", "expert": "expert", "route": "expert"}  # kinds with a second index: what it counts
MODES = ("zero", "mean")
_ATOM = re.compile(r"(?P<kind>[a-z_]+):(?P<target>[^:]+)(?::mode=(?P<mode>[a-z]+))?")
_INDEX = re.compile(r"\*|\d+|\d+-\d+")
STEER_OPTIONS = {"alpha": float, "direction": str, "site": str, "tokens": str}
PATCH_OPTIONS = ("heads", "pos", "tokens")



@dataclasses.dataclass(frozen=True, order=True)
class Atom:
    """One component removed or replaced."""
    kind: str
    layer: int
    head: int | None = None  # the head, or for expert and route the expert, or a patch's head (None: all)
    mode: str = "zero"
    path: str = ""           # steer: the directions file
    alpha: float = 1.0       # steer: the direction's scale
    direction: str = ""      # steer: the kind of direction in the file ("": diff_in_means where it has one)
    site: str = RESID_POST   # steer, patch: where in the block it acts (STEER_SITES, PATCH_SITES)
    tokens: str = ""         # steer, patch: the tokens it acts on (steering_tokens; "": every token)
    position: str = ""       # patch: of the tokens chosen, the P-th (pos=P), each (*, A-B), or "": all

    @property
    def position_grid(self) -> bool:
        """A patch's pos= stands for a cell per position (``*`` or ``A-B``), not one cell."""
        return self.position == "*" or "-" in self.position

    def positions(self, count: int) -> range:
        """A patch's pos= among ``count`` chosen tokens: every one for ``*``, else its number or
        range (not checked against ``count``)."""
        return range(count) if self.position == "*" else _span(self.position)

    def sort_key(self) -> tuple:
        """The atoms' order in an intervention's name (a patch's head None: before any head)."""
        return tuple(-1 if value is None else value for value in dataclasses.astuple(self))

    def __str__(self) -> str:
        if self.kind == "steer":
            options = (f":alpha={alpha_text(self.alpha)}" if self.alpha != 1 else "") + (
                f":direction={self.direction}" if self.direction else "") + (
                f":site={self.site}" if self.site != RESID_POST else "") + (
                f":tokens={self.tokens}" if self.tokens else "")
            return f"steer:{self.layer}:{self.path}{options}"
        if self.kind == "patch":
            return f"patch:{self.layer}:{self.site}" + (f":heads={self.head}" if self.head is not None else "") + (
                f":pos={self.position}" if self.position else "") + (f":tokens={self.tokens}" if self.tokens else "")
        target = f"{self.layer}.{self.head}" if self.kind in INDEXED else str(self.layer)
        return f"{self.kind}:{target}" + (":mode=mean" if self.mode == "mean" else "")


@dataclasses.dataclass(frozen=True)
class Intervention:
    """Atoms applied together; no atoms is the unablated model."""
    atoms: tuple[Atom, ...] = ()

    @property
    def name(self) -> str:
        """The canonical spec (atoms sorted), or ``baseline``."""
        return "+".join(str(a) for a in self.atoms) or BASELINE

    @property
    def steer_tokens(self) -> str | None:
        """The token selection its steerings share (``steering_tokens``); None: every token."""
        return next((a.tokens for a in self.atoms if a.kind == "steer" and a.tokens), None)

    @property
    def patches(self) -> tuple[Atom, ...]:
        """Its patches (``patch`` atoms)."""
        return tuple(a for a in self.atoms if a.kind == "patch")

    @property
    def needs_means(self) -> bool:
        return any(a.mode == "mean" and a.kind != "norm" for a in self.atoms)


BASELINE = "baseline"


def _indices(text: str, what: str, count: int, spec: str) -> list[int]:
    """``*`` | ``N`` | ``A-B`` -> the indices, each checked against ``count``."""
    if not _INDEX.fullmatch(text):
        raise UserError(f"intervention {spec!r}: {what} must be a number, a range A-B or *, got {text!r}")
    if text == "*":
        return list(range(count))
    indices = list(_span(text))
    if not indices:
        raise UserError(f"intervention {spec!r}: empty range {text!r}")
    bad = [i for i in indices if i >= count]
    if bad:
        plural = {"layer": "blocks", "head": "attention heads", "expert": "experts per block"}[what]
        raise UserError(f"intervention {spec!r}: {what} {bad[0]} does not exist: the model has {count} "
                        f"{plural} (0..{count - 1})")
    return indices


def _span(text: str) -> range:
    """``N`` | ``A-B`` (inclusive) -> the indices."""
    low, _, high = text.partition("-")
    return range(int(low), int(high or low) + 1)


def alpha_text(alpha: float) -> str:
    """A steering's scale as its spec writes it: exact (it parses back to the same float), no
    ``+`` (which joins atoms), no trailing ``.0``."""
    text = repr(float(alpha)).replace("e+", "e")
    return text[:-2] if text.endswith(".0") else text


def _steer_atoms(text: str, spec: str, num_layers: int) -> list[Atom]:
    """``steer:L:FILE[:alpha=A][:direction=KIND][:site=SITE][:tokens=ROLES]`` (FILE may hold
    colons: gs://) -> one atom per layer."""
    layers, _, rest = text.strip()[len("steer:"):].partition(":")
    # FILE (it may hold colons: gs://), then NAME=VALUE options (a token selection may hold commas).
    rest, *given = re.split(r":(?=[a-z_]+=)", rest)
    options: dict[str, object] = {}
    for option in given:
        name, _, value = option.partition("=")
        if name not in STEER_OPTIONS:
            raise UserError(f"intervention {spec!r}: steer takes alpha=, direction=, site= and tokens=, not {name}="
                            + (" (a steering has no mode)" if name == "mode" else ""))
        if name in options:
            raise UserError(f"intervention {spec!r}: {name}= is given twice")
        try:
            options[name] = STEER_OPTIONS[name](value)
        except ValueError:
            raise UserError(f"intervention {spec!r}: {name} must be a number, got {value!r}") from None
    if not np.isfinite(float(options.get("alpha", 1.0))):
        raise UserError(f"intervention {spec!r}: alpha must be finite")
    if not rest:
        raise UserError(f"intervention {spec!r}: expected steer:LAYER:FILE[:alpha=A][:direction=KIND][:site=SITE]"
                        "[:tokens=ROLES], e.g. steer:12:probe_out/directions.npz:alpha=4")
    direction = str(options.get("direction", ""))
    if direction and direction not in DIRECTION_KINDS:
        raise UserError(f"intervention {spec!r}: direction must be {' or '.join(DIRECTION_KINDS)}, got {direction!r}")
    site = str(options.get("site", RESID_POST))
    if site not in STEER_SITES:
        raise UserError(f"intervention {spec!r}: a steering adds to the residual stream or to what a sublayer adds "
                        f"to it: site must be one of {', '.join(STEER_SITES)}, got {site!r}")
    tokens = steering_tokens(str(options["tokens"]), spec) if "tokens" in options else ""
    return [Atom("steer", layer, path=rest, alpha=float(options.get("alpha", 1.0)), direction=direction, site=site,
                 tokens=tokens) for layer in _indices(layers, "layer", num_layers, spec)]


def _patch_atoms(text: str, spec: str, num_layers: int, num_heads: int) -> list[Atom]:
    """``patch:L:SITE[:heads=H][:pos=P][:tokens=ROLES]`` -> one atom per layer (and head)."""
    layers, _, rest = text.strip()[len("patch:"):].partition(":")
    site, *given = rest.split(":")
    if not site:
        raise UserError(f"intervention {spec!r}: expected patch:LAYER:SITE[:heads=H][:pos=P][:tokens=ROLES], "
                        "e.g. patch:*:hook_resid_pre:pos=*")
    if site not in PATCH_SITES:
        raise UserError(f"intervention {spec!r}: a patch puts back a value of the residual stream, of what a "
                        f"sublayer adds to it or of the heads' outputs: SITE must be one of {', '.join(PATCH_SITES)}, "
                        f"got {site!r}")
    options: dict[str, str] = {}
    for option in given:
        name, equals, value = option.partition("=")
        if name not in PATCH_OPTIONS or not equals:
            raise UserError(f"intervention {spec!r}: patch takes heads=, pos= and tokens=, not {option!r}"
                            + (" (a patch has no mode)" if name == "mode" else ""))
        if name in options:
            raise UserError(f"intervention {spec!r}: {name}= is given twice")
        options[name] = value
    if "heads" in options and site != ATTN_Z:
        raise UserError(f"intervention {spec!r}: heads= chooses heads of attn.hook_z; {site} is one vector a token")
    position = options.get("pos", "")
    if position and not _INDEX.fullmatch(position):
        raise UserError(f"intervention {spec!r}: pos must be a number, a range A-B or *, got {position!r}")
    if position and position != "*" and not _span(position):
        raise UserError(f"intervention {spec!r}: empty range pos={position}")
    tokens = steering_tokens(options["tokens"], spec) if "tokens" in options else ""
    heads = _indices(options["heads"], "head", num_heads, spec) if "heads" in options else [None]
    return [Atom("patch", layer, head, site=site, tokens=tokens, position=position)
            for layer in _indices(layers, "layer", num_layers, spec) for head in heads]


def steering_tokens(text: str, spec: str) -> str:
    """A steering's token selection (``tokens=``) in its canonical form: terms of
    ``activations.selection`` that choose a token by its own role (``ROLE``, ``-ROLE``), so that
    the choice is the same in a whole sequence, a prompt and each token being written."""
    try:
        selection = parse_selection(text)
    except UserError as e:
        raise UserError(f"intervention {spec!r}: tokens={text}: {str(e).split(': ', 1)[-1]}") from None
    if selection.ends or selection.pooled or selection.exclude_special:
        raise UserError(f"intervention {spec!r}: tokens={text}: a steering chooses its tokens by their role alone "
                        "(ROLE and -ROLE terms, e.g. tokens=user or tokens=-template; no first, last, mean or "
                        "-special)")
    return str(selection)


def _atoms(text: str, spec: str, num_layers: int, num_heads: int, num_experts: int = 0) -> list[Atom]:
    """The atoms one pattern stands for (``head:*.0`` -> one per block)."""
    if text.strip().startswith("steer:"):
        return _steer_atoms(text, spec, num_layers)
    if text.strip().startswith("patch:"):
        return _patch_atoms(text, spec, num_layers, num_heads)
    match = _ATOM.fullmatch(text.strip())
    if not match:
        raise UserError(f"intervention {spec!r}: expected KIND:TARGET[:mode=zero|mean], e.g. head:3.7 "
                        f"or mlp:2:mode=mean (KIND: {', '.join(KINDS)})")
    kind, target, mode = match["kind"], match["target"], match["mode"] or "zero"
    if kind not in KINDS:
        raise UserError(f"intervention {spec!r}: unknown kind {kind!r} (choose from {', '.join(KINDS)})")
    if mode not in MODES:
        raise UserError(f"intervention {spec!r}: unknown mode {mode!r} (choose from {', '.join(MODES)})")
    if kind in ("expert", "route") and not num_experts:
        raise UserError(f"intervention {spec!r}: {kind} acts on a mixture of experts; this model is dense")
    if kind in ("expert", "route") and match["mode"]:
        raise UserError(f"intervention {spec!r}: {kind} has no mode (the router renormalises over the experts left)")
    if kind in INDEXED:
        what = INDEXED[kind]
        layer, dot, index = target.partition(".")
        if not dot:
            raise UserError(f"intervention {spec!r}: {'a head' if what == 'head' else 'an expert'} is "
                            f"LAYER.{what.upper()}, e.g. {kind}:3.7")
        return [Atom(kind, l, i, mode) for l in _indices(layer, "layer", num_layers, spec)
                for i in _indices(index, what, num_heads if what == "head" else num_experts, spec)]
    return [Atom(kind, l, None, mode) for l in _indices(target, "layer", num_layers, spec)]


def _present(atoms: list[Atom], spec: str, absent: Callable[[Atom], str | None] | None) -> list[Atom]:
    """A pattern's atoms without those on blocks that lack their target, where the pattern spans
    several blocks (one block named alone is checked where it is resolved, ``check_blocks``)."""
    if absent is None or len({atom.layer for atom in atoms}) < 2:
        return atoms
    reasons = [absent(atom) for atom in atoms]
    kept = [atom for atom, reason in zip(atoms, reasons) if reason is None]
    if not kept:
        raise UserError(f"intervention {spec!r}: no block it spans has what it acts on ({reasons[0]})")
    return kept


def _target(atom: Atom) -> tuple:
    """What an atom acts on: two atoms of one intervention may not share it (a patch's: also its
    positions)."""
    extra = (atom.position, atom.tokens) if atom.kind == "patch" else ()
    return (atom.kind, atom.layer, atom.head, atom.path, atom.direction, atom.site, *extra)


def parse_interventions(specs: Sequence[str], num_layers: int, num_heads: int, num_experts: int = 0,
                        absent: Callable[[Atom], str | None] | None = None) -> list[Intervention]:
    """Every intervention the specs stand for, in order, each once; ``UserError`` names a bad one.

    A spec joins patterns with ``+``; a pattern with ranges or ``*`` expands, and a spec stands
    for every combination of its patterns' expansions. ``num_experts``: 0 for a dense model.
    ``absent``: why the model has no target for an atom (None: it has one); a pattern over several
    blocks leaves out the blocks that lack its target (a head grid the Gated DeltaNet blocks,
    ``mlp:*`` Nemotron-H's mixer blocks), and one that none has is refused."""
    out: dict[str, Intervention] = {}
    for spec in specs:
        if not spec.strip():
            raise UserError("an empty intervention spec")
        parts = [_present(_atoms(part, spec, num_layers, num_heads, num_experts), spec, absent)
                 for part in spec.split("+")]
        for combination in itertools.product(*parts):
            atoms = tuple(sorted(set(combination), key=Atom.sort_key))
            targets = [_target(a) for a in atoms]
            if len(set(targets)) != len(targets):
                twice = next(a for a in atoms if targets.count(_target(a)) > 1)
                if twice.kind == "steer":
                    raise UserError(f"intervention {spec!r}: block {twice.layer}'s {twice.site} is steered twice by "
                                    "one direction (give one alpha)")
                raise UserError(f"intervention {spec!r}: {str(twice).split(':mode')[0]} is given two modes")
            selections = {a.tokens for a in atoms if a.kind == "steer"}
            if len(selections) > 1:
                raise UserError(f"intervention {spec!r}: its steerings choose different tokens "
                                f"({', '.join(repr(t or 'every token') for t in sorted(selections))}): they share one")
            if len(atoms) > 1 and any(a.position_grid for a in atoms):
                raise UserError(f"intervention {spec!r}: a grid over positions (pos=* or A-B) is for one patch alone")
            routes = [a.layer for a in atoms if a.kind == "route"]
            if len(set(routes)) != len(routes):
                raise UserError(f"intervention {spec!r}: block {routes[0]}'s tokens are routed to two experts")
            intervention = Intervention(atoms)
            out.setdefault(intervention.name, intervention)
    return list(out.values())
