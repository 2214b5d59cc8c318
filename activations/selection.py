"""Token selection: one small grammar, the same wherever tokens are chosen (``runners.tpu_host
--tokens`` when storing; ``read_activations``, the token loader and ``pipeline.export`` when
reading).

A selection is comma-separated terms:

=================  ====================================================================
``ROLE``           the tokens of a role (``system``, ``user``, ``assistant``, ``tool``,
                   ``text``, ``template``, ``generated``, ``thinking``: ``common/roles.py``)
``first``/``last``  the sample's first / last token (of those not excluded)
``first:ROLE``     the first / last token of each span of ROLE (a span: consecutive tokens
``last:ROLE``      of that role; ``last:user`` is where a probe reads each question)
``-ROLE``          leave out the tokens of a role
``-special``       leave out the tokenizer's special tokens (BOS, end-of-turn markers, pad)
``mean``           pool what is selected into one vector per sample (its mean)
``mean:ROLE``      ``ROLE,mean``
=================  ====================================================================

The selected tokens are the union of the positive terms (every token if there are none), each
taken after the exclusions: ``last,-special`` is the last token that is not special. With
``mean`` a sample gives one row, the mean of its selected tokens (none if nothing is selected).
Examples: ``assistant,-special`` (an assistant-only SAE), ``last`` (a last-token probe; under a
chat template the last token is the template's end-of-turn or generation prompt),
``last:user`` (the last token of each question), ``mean:assistant`` (a mean-pooled response).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from common.cli import UserError
from common.roles import ROLE_CODES, ROLES, missing_roles, role_codes

ENDS = ("first", "last")
MEAN = "mean"
SPECIAL = "special"
GRAMMAR = (f"terms separated by commas: a role ({', '.join(ROLES)}), first, last, first:ROLE, last:ROLE, "
           "-ROLE, -special, mean, mean:ROLE")


@dataclasses.dataclass(frozen=True)
class Selection:
    """A parsed selection (``parse_selection``); ``str()`` gives it in a canonical order."""
    roles: tuple[str, ...] = ()                     # tokens of these roles
    ends: tuple[tuple[str, str | None], ...] = ()   # (first | last, of a role's spans or None: the sample)
    excluded: tuple[str, ...] = ()                  # roles left out
    exclude_special: bool = False
    pool: str | None = None                         # mean

    def __str__(self) -> str:
        terms = list(self.roles) + [f"{end}:{role}" if role else end for end, role in self.ends]
        terms += [f"-{role}" for role in self.excluded] + ([f"-{SPECIAL}"] if self.exclude_special else [])
        return ",".join(terms + ([self.pool] if self.pool else []))

    @property
    def pooled(self) -> bool:
        return self.pool is not None

    @property
    def needs_roles(self) -> bool:
        """Whether applying it needs each token's role (else only positions and special tokens)."""
        return bool(self.roles or self.excluded or any(role for _, role in self.ends))

    def positions(self, roles: Sequence[Sequence[Any]] | None, special: Sequence[int] | None,
                  num_tokens: int) -> np.ndarray:
        """[selected] int32: the positions this selection keeps of a sample of ``num_tokens`` tokens
        with these role runs and special positions (each None where the sample has none, e.g. a
        stream prepared before roles existed: a selection that needs them is then a ``UserError``)."""
        return self.positions_of(None if roles is None else role_codes(roles), special, num_tokens)

    def positions_of(self, codes: np.ndarray | None, special: Sequence[int] | np.ndarray | None,
                     num_tokens: int, among: np.ndarray | None = None) -> np.ndarray:
        """``positions`` from each token's role code (``common.roles.role_codes``) instead of runs;
        ``among``: only these positions are there to select (a store's stored rows), so that
        ``first`` and ``last`` are the first and last of them."""
        if codes is None and self.needs_roles:
            raise missing_roles(f"--tokens {self}")
        if special is None and self.exclude_special:
            raise UserError(f"--tokens {self}: the sample does not record its special tokens (its stream was "
                            "prepared before they were): prepare it again")
        keep = np.ones(num_tokens, bool)
        if among is not None:
            keep[:] = False
            keep[np.asarray(among, np.int64)] = True
        for role in self.excluded:
            keep &= codes != ROLE_CODES[role]
        if self.exclude_special:
            keep[np.asarray(special, np.int64)] = False
        if not (self.roles or self.ends):
            return np.flatnonzero(keep).astype(np.int32)
        chosen = np.zeros(num_tokens, bool)
        for role in self.roles:
            chosen |= keep & (codes == ROLE_CODES[role])
        for end, role in self.ends:
            runs = [np.flatnonzero(keep)] if role is None else _spans(codes, ROLE_CODES[role], keep)
            for kept in runs:
                if len(kept):
                    chosen[kept[0] if end == "first" else kept[-1]] = True
        return np.flatnonzero(chosen).astype(np.int32)


def _spans(codes: np.ndarray, code: int, keep: np.ndarray) -> list[np.ndarray]:
    """The kept positions of each span (maximal run) of tokens of role ``code``."""
    inside = codes == code
    edges = np.flatnonzero(np.diff(np.concatenate([[False], inside, [False]]).astype(np.int8)))
    return [np.flatnonzero(keep[start:stop]) + start for start, stop in zip(edges[::2], edges[1::2])]


def _role(name: str, term: str) -> str:
    if name not in ROLE_CODES:
        raise UserError(f"--tokens: {term!r} names no role ({', '.join(ROLES)}); a selection is {GRAMMAR}")
    return name


def parse_selection(text: str | None) -> Selection | None:
    """A ``--tokens`` expression parsed (None for none); a malformed one is a ``UserError``."""
    if text is None:
        return None
    terms = [term.strip() for term in text.split(",")]
    if not any(terms) or not all(terms):
        raise UserError(f"--tokens {text!r}: an empty term; a selection is {GRAMMAR}")
    roles, ends, excluded, exclude_special, pool = [], [], [], False, None
    for term in terms:
        head, _, arg = term.partition(":")
        if term.startswith("-"):
            if term[1:] == SPECIAL:
                exclude_special = True
            else:
                excluded.append(_role(term[1:], term))
        elif head in ENDS:
            ends.append((head, _role(arg, term) if arg else None))
        elif head == MEAN:
            pool = MEAN
            if arg:
                roles.append(_role(arg, term))
        else:
            roles.append(_role(term, term))
    both = sorted(set(roles + [role for _, role in ends if role]) & set(excluded))
    if both:
        raise UserError(f"--tokens {text!r}: {both[0]} is both selected and left out")
    return Selection(tuple(sorted(set(roles), key=ROLES.index)),
                     tuple(sorted(set(ends), key=lambda end: (end[0], end[1] or ""))),
                     tuple(sorted(set(excluded), key=ROLES.index)), exclude_special, pool)


def selection_flag(text: str) -> str:
    """``--tokens``: the expression, checked, in canonical form."""
    return str(parse_selection(text))


def pooled_row(values: np.ndarray) -> np.ndarray:
    """[1, width]: the mean of a sample's selected rows [k, width] (in float64, returned in their
    dtype), or the [0, width] rows themselves when none is selected. Integers (expert ids) have no
    mean: a ``UserError``."""
    if np.issubdtype(values.dtype, np.integer):
        raise UserError("--tokens mean: these arrays hold expert ids, which have no mean; read them without pooling")
    return values.mean(axis=0, dtype=np.float64, keepdims=True).astype(values.dtype) if len(values) else values
