"""Interventions on the model: a small spec language, parsed and checked, and the arrays the
compiled forward takes for one intervention.

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
                of these roles: ``steering_tokens``) to SITE of block L (``STEER_SITES``:
                a point of the residual stream, or what a sublayer adds to it; hook_resid_post,
                the block's output, by default): the array ``KIND/blocks.L.SITE`` of a
                directions file (``probing.directions``: runners.probe writes them; KIND
                diff_in_means, the default where the file has it, or probe), A 1 by default;
                FILE local or gs://. What is stored at SITE is the steered value

Each is followed by ``:mode=zero`` (the default) or ``:mode=mean`` (``expert``, ``route`` and
``steer`` have no mode), and several joined by ``+`` form one intervention (``head:3.1+head:3.2``).
``zero`` removes the component: zeros for a head, attn or mlp output, the bare residual for a
layer, and a neutral weight for a norm (the norm then only normalises: w = 1 for x * w, w = 0
for Gemma's x * (1 + w), and a LayerNorm's bias 0). ``mean`` replaces it by its mean over the
stream's real tokens under the unablated model (``Means``, computed by a first pass): a head's
output, a sublayer's output, a block's contribution (output - input); for a norm, each weight
(and bias) vector's own mean.

In a grid, L and H may be ``*`` (all) or a range ``A-B`` (inclusive); every combination is one
intervention: ``head:0-3.*`` is one intervention per head of blocks 0 to 3, ``mlp:*:mode=mean``
one per block.

The arrays (``ablation_arrays``) have the same shapes for every intervention of a model, so one
compiled forward per batch shape serves a whole grid; a steering adds an array per site it steers
(and with ``tokens=`` the batch's tokens), so each set of steered sites compiles its own, and the
forward of an intervention that steers nothing computes no steering at all.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import os
import re
from typing import Sequence

import numpy as np

from common.cli import UserError
from common.files import read_optional, write_bytes
from model.config import DecoderConfig
from model.sites import ATTN_OUT, MLP_OUT, RESID_MID, RESID_POST, RESID_PRE, array_key, missing_reason

log = logging.getLogger("model.interventions")
KINDS = ("head", "layer", "attn", "mlp", "norm", "expert", "route", "steer")
INDEXED = {"head": "head", "expert": "expert", "route": "expert"}  # kinds with a second index: what it counts
MODES = ("zero", "mean")
_ATOM = re.compile(r"(?P<kind>[a-z_]+):(?P<target>[^:]+)(?::mode=(?P<mode>[a-z]+))?")
_INDEX = re.compile(r"\*|\d+|\d+-\d+")
STEER_OPTIONS = {"alpha": float, "direction": str, "site": str, "tokens": str}
# The per-batch entry of an intervention's arrays, beside the per-block ones (``steered_token_mask``):
# [B, S] bool, which tokens its steerings add to; absent, every token.
STEER_TOKENS = "steer_tokens"
# Where a steering may add its direction, in block order: the block's input, attention's addition,
# the stream between, the MLP's addition, the block's output. Each is [hidden] wide and flows on
# through the stream.
STEER_SITES = (RESID_PRE, ATTN_OUT, RESID_MID, MLP_OUT, RESID_POST)


@dataclasses.dataclass(frozen=True, order=True)
class Atom:
    """One component removed or replaced."""
    kind: str
    layer: int
    head: int | None = None  # the head, or for expert and route the expert
    mode: str = "zero"
    path: str = ""           # steer: the directions file
    alpha: float = 1.0       # steer: the direction's scale
    direction: str = ""      # steer: the kind of direction in the file ("": diff_in_means where it has one)
    site: str = RESID_POST   # steer: where in the block it is added (STEER_SITES)
    tokens: str = ""         # steer: the tokens it is added to (steering_tokens; "": every token)

    def __str__(self) -> str:
        if self.kind == "steer":
            options = (f":alpha={alpha_text(self.alpha)}" if self.alpha != 1 else "") + (
                f":direction={self.direction}" if self.direction else "") + (
                f":site={self.site}" if self.site != RESID_POST else "") + (
                f":tokens={self.tokens}" if self.tokens else "")
            return f"steer:{self.layer}:{self.path}{options}"
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
    def needs_means(self) -> bool:
        return any(a.mode == "mean" and a.kind != "norm" for a in self.atoms)


BASELINE = "baseline"


def _indices(text: str, what: str, count: int, spec: str) -> list[int]:
    """``*`` | ``N`` | ``A-B`` -> the indices, each checked against ``count``."""
    if not _INDEX.fullmatch(text):
        raise UserError(f"intervention {spec!r}: {what} must be a number, a range A-B or *, got {text!r}")
    if text == "*":
        return list(range(count))
    low, _, high = text.partition("-")
    indices = list(range(int(low), int(high or low) + 1))
    if not indices:
        raise UserError(f"intervention {spec!r}: empty range {text!r}")
    bad = [i for i in indices if i >= count]
    if bad:
        plural = {"layer": "blocks", "head": "attention heads", "expert": "experts per block"}[what]
        raise UserError(f"intervention {spec!r}: {what} {bad[0]} does not exist: the model has {count} "
                        f"{plural} (0..{count - 1})")
    return indices


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
    from probing.directions import KINDS as DIRECTION_KINDS  # the file's format lives with what writes it
    if direction and direction not in DIRECTION_KINDS:
        raise UserError(f"intervention {spec!r}: direction must be {' or '.join(DIRECTION_KINDS)}, got {direction!r}")
    site = str(options.get("site", RESID_POST))
    if site not in STEER_SITES:
        raise UserError(f"intervention {spec!r}: a steering adds to the residual stream or to what a sublayer adds "
                        f"to it: site must be one of {', '.join(STEER_SITES)}, got {site!r}")
    tokens = steering_tokens(str(options["tokens"]), spec) if "tokens" in options else ""
    return [Atom("steer", layer, path=rest, alpha=float(options.get("alpha", 1.0)), direction=direction, site=site,
                 tokens=tokens) for layer in _indices(layers, "layer", num_layers, spec)]


def steering_tokens(text: str, spec: str) -> str:
    """A steering's token selection (``tokens=``) in its canonical form: terms of
    ``activations.selection`` that choose a token by its own role (``ROLE``, ``-ROLE``), so that
    the choice is the same in a whole sequence, a prompt and each token being written."""
    from activations.selection import parse_selection
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


def parse_interventions(specs: Sequence[str], num_layers: int, num_heads: int,
                        num_experts: int = 0) -> list[Intervention]:
    """Every intervention the specs stand for, in order, each once; ``UserError`` names a bad one.

    A spec joins patterns with ``+``; a pattern with ranges or ``*`` expands, and a spec stands
    for every combination of its patterns' expansions. ``num_experts``: 0 for a dense model."""
    out: dict[str, Intervention] = {}
    for spec in specs:
        if not spec.strip():
            raise UserError("an empty intervention spec")
        parts = [_atoms(part, spec, num_layers, num_heads, num_experts) for part in spec.split("+")]
        for combination in itertools.product(*parts):
            atoms = tuple(sorted(set(combination)))
            targets = [(a.kind, a.layer, a.head, a.path, a.direction, a.site) for a in atoms]
            if len(set(targets)) != len(targets):
                twice = next(a for a in atoms if targets.count((a.kind, a.layer, a.head, a.path, a.direction,
                                                                a.site)) > 1)
                if twice.kind == "steer":
                    raise UserError(f"intervention {spec!r}: block {twice.layer}'s {twice.site} is steered twice by "
                                    "one direction (give one alpha)")
                raise UserError(f"intervention {spec!r}: {str(twice).split(':mode')[0]} is given two modes")
            selections = {a.tokens for a in atoms if a.kind == "steer"}
            if len(selections) > 1:
                raise UserError(f"intervention {spec!r}: its steerings choose different tokens "
                                f"({', '.join(repr(t or 'every token') for t in sorted(selections))}): they share one")
            routes = [a.layer for a in atoms if a.kind == "route"]
            if len(set(routes)) != len(routes):
                raise UserError(f"intervention {spec!r}: block {routes[0]}'s tokens are routed to two experts")
            intervention = Intervention(atoms)
            out.setdefault(intervention.name, intervention)
    return list(out.values())


def parse_one(spec: str, config: DecoderConfig) -> Intervention:
    """One intervention (``runners.tpu_host --ablate``): a spec that expands to several is refused."""
    found = parse_interventions([spec], config.num_hidden_layers, config.num_attention_heads, config.num_experts)
    if len(found) != 1:
        raise UserError(f"--ablate {spec!r} stands for {len(found)} interventions: name one "
                        "(no * or ranges)")
    check_blocks(found, config)
    return found[0]


def check_blocks(interventions: Sequence[Intervention], config: DecoderConfig) -> None:
    """``UserError`` for an expert or route atom on a block whose MLP is dense (Qwen's
    mlp_only_layers), a head atom on a block that mixes with Gated DeltaNet (no attention
    heads: ``attn:L`` removes its mixer), or a steering whose file does not fit the model (read
    now, before any weight is)."""
    for intervention in interventions:
        for atom in intervention.atoms:
            if atom.kind == "steer":
                if reason := missing_reason(atom.site, config, atom.layer):
                    raise UserError(f"intervention {intervention.name!r}: {reason}")
                steering_vector(atom, config)
            if atom.kind == "head" and config.is_deltanet(atom.layer):
                raise UserError(f"intervention {intervention.name!r}: block {atom.layer} mixes with Gated DeltaNet: "
                                f"it has no attention heads (attn:{atom.layer} removes its mixer)")
            if atom.kind in ("expert", "route") and not config.is_sparse(atom.layer):
                raise UserError(f"intervention {intervention.name!r}: block {atom.layer} has a dense MLP, no experts "
                                f"(its mixtures of experts: blocks {', '.join(map(str, config.sparse_layers))})")
        removed = [atom.layer for atom in intervention.atoms if atom.kind == "expert"]
        for layer in set(removed):
            if removed.count(layer) > config.num_experts - config.moe.top_k:
                raise UserError(f"intervention {intervention.name!r}: removes {removed.count(layer)} of block "
                                f"{layer}'s {config.num_experts} experts: each token needs {config.moe.top_k} left")


@dataclasses.dataclass
class Means:
    """Means over a stream's real tokens under the unablated model, per block: what ``mean`` mode
    puts in place of a component."""
    head: np.ndarray    # [L, N, D] each head's output (its slice of the o_proj input)
    attn: np.ndarray    # [L, H] attention output
    mlp: np.ndarray     # [L, H] MLP output
    block: np.ndarray   # [L, H] the block's contribution: its output minus its input
    tokens: int         # tokens averaged over

    def save(self, path: str) -> None:
        """Writes ``path`` (local: atomically, so a crash never leaves half a file to reuse)."""
        out = io.BytesIO()
        np.savez(out, head=self.head, attn=self.attn, mlp=self.mlp, block=self.block, tokens=self.tokens)
        if "://" in path:
            write_bytes(path, out.getvalue())
            return
        write_bytes(path + ".tmp", out.getvalue())
        os.replace(path + ".tmp", path)

    @classmethod
    def load(cls, path: str) -> "Means":
        data = read_optional(path)
        if data is None:
            raise UserError(f"no means file at {path!r} (runners.ablate writes means.npz)")
        try:
            arrays = np.load(io.BytesIO(data))
            return cls(arrays["head"], arrays["attn"], arrays["mlp"], arrays["block"], int(arrays["tokens"]))
        except Exception as e:  # not an npz, truncated, keys missing
            raise UserError(f"{path!r} is not a means file of runners.ablate: {e}") from None

    def check(self, config: DecoderConfig, num_layers: int) -> None:
        """``UserError`` unless these are means of this model's shape."""
        c = config
        expected = {"head": (c.num_attention_heads, c.max_head_dim), "attn": (c.hidden_size,),
                    "mlp": (c.hidden_size,), "block": (c.hidden_size,)}
        for name, shape in expected.items():
            array = getattr(self, name)
            if array.shape[1:] != shape or array.shape[0] < num_layers:
                raise UserError(f"the means file holds {name} means of shape {array.shape}: not of this model "
                                f"({num_layers} blocks, per block {shape})")


def ablation_arrays(intervention: Intervention, config: DecoderConfig, num_layers: int,
                    means: Means | None = None) -> dict[str, np.ndarray]:
    """The forward's inputs for one intervention over blocks ``0..num_layers-1``: per block which
    heads / sublayers / the block itself / its norms are kept, what replaces each one that is not
    (``*_fill``: its mean, else zero, or a neutral norm weight), the means, and what its steerings
    add at each site they steer (``steer_key``). Shapes depend on the model only; the steered sites
    name arrays of their own."""
    if intervention.needs_means and means is None:
        raise ValueError(f"{intervention.name} replaces by means: they are needed")
    n, d, h = config.num_attention_heads, config.max_head_dim, config.hidden_size  # heads padded to the widest
    arrays = {"head_keep": np.ones((num_layers, n), bool), "head_fill": np.zeros((num_layers, n), bool)}
    for kind in ("attn", "mlp", "block", "norm"):
        arrays[f"{kind}_keep"] = np.ones(num_layers, bool)
        arrays[f"{kind}_fill"] = np.zeros(num_layers, bool)
    if config.moe is not None:
        arrays["expert_keep"] = np.ones((num_layers, config.moe.num_experts), bool)  # [L, E]
        arrays["route_to"] = np.full(num_layers, -1, np.int32)  # [L]: the expert every token goes to, or -1
    if means is not None:  # views of the means, shared by every intervention's arrays
        means.check(config, num_layers)
        arrays.update({f"{kind}_mean": getattr(means, kind)[:num_layers] for kind in ("head", "attn", "mlp", "block")})
    else:
        arrays["head_mean"] = np.zeros((num_layers, n, d), np.float32)    # [L, N, D]
        arrays.update({f"{kind}_mean": np.zeros((num_layers, h), np.float32) for kind in ("attn", "mlp", "block")})
    for atom in intervention.atoms:
        if atom.layer >= num_layers:
            raise ValueError(f"{atom} is past the {num_layers} blocks computed")
        if atom.kind == "expert":
            arrays["expert_keep"][atom.layer, atom.head] = False
            continue
        if atom.kind == "route":
            arrays["route_to"][atom.layer] = atom.head
            continue
        if atom.kind == "steer":  # [L, H]: what each block adds at the site; only the sites steered have one
            steer = arrays.setdefault(steer_key(atom.site), np.zeros((num_layers, h), np.float32))
            steer[atom.layer] += np.float32(atom.alpha) * steering_vector(atom, config)
            continue
        kind = "block" if atom.kind == "layer" else atom.kind
        where = (atom.layer, atom.head) if atom.kind == "head" else atom.layer
        arrays[f"{kind}_keep"][where] = False
        arrays[f"{kind}_fill"][where] = atom.mode == "mean"
    return arrays


def steer_key(site: str) -> str:
    """The name, among an intervention's arrays, of what its steerings add at ``site`` (absent
    where none adds there: the forward then computes no steering at that site)."""
    return f"steer@{site}"


def steered_positions(tokens: str, runs: Sequence | None, length: int, sample_id: int | None = None) -> np.ndarray:
    """[selected] int32: the positions, below ``length``, of a sequence with these role runs
    (common.roles) that a steering with the selection ``tokens`` adds to."""
    from activations.selection import parse_selection
    from common.roles import missing_roles, role_codes
    if runs is None:
        raise missing_roles(f"a steering's tokens={tokens}", sample_id)
    codes = role_codes(runs)[:length]
    return parse_selection(tokens).positions_of(codes, None, len(codes))


def steered_token_mask(tokens: str, roles: Sequence[Sequence | None], rows: int, length: int,
                       sample_ids: Sequence[int] | None = None) -> np.ndarray:
    """[rows, length] bool, the ``STEER_TOKENS`` input of a batch: the tokens of each sequence
    (its role runs) that a steering with the selection ``tokens`` adds to (``steered_positions``;
    rows past them and padding False)."""
    mask = np.zeros((rows, length), bool)
    for row, runs in enumerate(roles):
        mask[row, steered_positions(tokens, runs, length, None if sample_ids is None else sample_ids[row])] = True
    return mask


def steers_written_tokens(tokens: str | None, thinking: bool = False) -> bool:
    """Whether a steering with the selection ``tokens`` adds to each token the model writes: its
    role ``generated``, or where the tokenizer marks ``thinking`` sections that too (a token's is
    not known while it is written, so the selection must treat the two alike)."""
    if not tokens:
        return True
    from activations.selection import parse_selection
    from common.roles import GENERATED, ROLE_CODES, WRITTEN_ROLES
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
    import hashlib
    paths = sorted({a.path for a in intervention.atoms if a.kind == "steer"}) if intervention else []
    if not paths:
        return None
    return {path: hashlib.blake2b(read_optional(path) or b"", digest_size=8).hexdigest() for path in paths}


def steering_vector(atom: Atom, config: DecoderConfig) -> np.ndarray:
    """[hidden] float32: the direction ``atom`` adds at its site, from its file; one line when the
    file is of another model (another family, depth or hidden size) or lacks it. (A file
    of another checkpoint of the same shape, a base model's direction steering its chat model, is
    allowed.)"""
    from probing.directions import KINDS as DIRECTION_KINDS, array_name, read_directions
    arrays, metadata = read_directions(atom.path)
    shape = {"model_type": config.model_type, "num_hidden_layers": config.num_hidden_layers,
             "hidden_size": config.hidden_size}
    other = [f"{name} {metadata[name]} (this model: {value})" for name, value in shape.items()
             if metadata.get(name) is not None and metadata[name] != value]
    if other:
        raise UserError(f"{atom.path!r} holds directions of another model: {', '.join(other)}")
    unknown = [name for name in shape if metadata.get(name) is None]
    if unknown:
        log.warning("%s does not record the model's %s: only its width is checked", atom.path, ", ".join(unknown))
    kinds = [atom.direction] if atom.direction else DIRECTION_KINDS  # diff_in_means first
    names = [array_name(kind, array_key(atom.site, atom.layer)) for kind in kinds]
    found = next((name for name in names if name in arrays), None)
    if found is None:
        raise UserError(f"{atom.path!r} has no {' or '.join(names)} to steer {atom} with (it has "
                        f"{', '.join(sorted(arrays)) or 'nothing'})")
    vector = arrays[found]
    if vector.shape != (config.hidden_size,):
        raise UserError(f"{atom.path!r}: {found} is {vector.shape[-1]} wide, the model's hidden size is "
                        f"{config.hidden_size}")
    return vector.astype(np.float32)
