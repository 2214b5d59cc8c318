"""What each token of a sample is: its role, and whether it is one of the tokenizer's special tokens.

Every token gets one role (``ROLES``):

* ``system``, ``user``, ``assistant``, ``tool``: the token's text is (mostly) the content of a
  message of that role;
* ``text``: a plain text (FineWeb-style records);
* ``template``: everything else: what the chat template writes around contents (role headers,
  separators, end-of-turn markers, a default system prompt, a generation prompt), and a BOS or EOS
  that the tokenizer's settings put around a text;
* ``generated``: a continuation the model wrote after the stream's tokens (``runners.tpu_host
  --generate``), its stop token included: apart from ``assistant``, which is what the dataset's
  conversations say an assistant wrote;
* ``thinking``: the part of such a continuation inside a thinking section (``<think>`` ...
  ``</think>`` of Qwen3 and its kind, both markers included), where the tokenizer has those
  tokens: a chain-of-thought probe selects it apart from the answer (``generated``).

``special`` marks the tokens that are the tokenizer's special tokens (BOS, end-of-turn markers,
pad), whatever their role. How roles are worked out is ``transforms/spans.py``; the rule for a
token that straddles two spans is there too.

Roles travel with a sample compactly, as runs: ``[[role, count], ...]`` in token order, the counts
summing to the sample's length (the stream record's ``roles``); special tokens as their positions
(``special``). Needs neither Beam nor JAX.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from common.cli import UserError

SYSTEM, USER, ASSISTANT, TOOL, TEXT, TEMPLATE = "system", "user", "assistant", "tool", "text", "template"
# Written by the model itself (runners.tpu_host --generate): last, so earlier codes hold.
GENERATED, THINKING = "generated", "thinking"
ROLES = (SYSTEM, USER, ASSISTANT, TOOL, TEXT, TEMPLATE, GENERATED, THINKING)
WRITTEN_ROLES = (GENERATED, THINKING)  # the roles of a continuation's tokens
ROLE_CODES = {role: code for code, role in enumerate(ROLES)}  # role -> its code in role arrays

Runs = list[list[Any]]  # [[role, count], ...]


def runs_of_codes(codes: np.ndarray) -> Runs:
    """Per-token role codes (``role_codes``'s) as runs ``[[role, count], ...]``."""
    if not len(codes):
        return []
    starts = np.concatenate([[0], np.flatnonzero(np.diff(codes)) + 1])
    counts = np.diff(np.concatenate([starts, [len(codes)]]))
    return [[ROLES[code], count] for code, count in zip(codes[starts].tolist(), counts.tolist())]


def role_codes(runs: Sequence[Sequence[Any]]) -> np.ndarray:
    """[tokens] uint8: each token's role as its index in ``ROLES``."""
    if not runs:
        return np.zeros(0, np.uint8)
    return np.repeat(np.array([ROLE_CODES[role] for role, _ in runs], np.uint8),
                     np.array([count for _, count in runs], np.int64))


def role_names(runs: Sequence[Sequence[Any]]) -> list[str]:
    """Each token's role by name, from runs."""
    return [role for role, count in runs for _ in range(count)]


def cut_runs(runs: Sequence[Sequence[Any]], length: int) -> Runs:
    """The runs of a sample's first ``length`` tokens (after a truncation)."""
    out, left = [], length
    for role, count in runs:
        if left <= 0:
            break
        out.append([role, min(count, left)])
        left -= count
    return out


def role_counts(runs: Sequence[Sequence[Any]]) -> dict[str, int]:
    """Tokens of each role (every role of ``ROLES``, zero where absent)."""
    counts = dict.fromkeys(ROLES, 0)
    for role, count in runs:
        counts[role] += count
    return counts


def missing_roles(what: str, sample_id: int | None = None) -> UserError:
    """The one-line error of ``what`` (a flag) needing the token roles a sample lacks."""
    sample = "the sample" if sample_id is None else f"sample {sample_id}"
    return UserError(f"{what}: {sample} has no token roles (its stream was prepared before roles existed): "
                     "prepare it again")


def runs_problem(runs: Any, num_tokens: int) -> str | None:
    """What is wrong with a record's ``roles`` (None: nothing)."""
    if not isinstance(runs, list):
        return "roles must be a list of [role, count] pairs"
    for run in runs:
        if (not isinstance(run, list) or len(run) != 2 or not isinstance(run[0], str) or run[0] not in ROLE_CODES
                or type(run[1]) is not int or run[1] < 1):
            return f"roles holds {run!r}: each run is [role, count >= 1], a role among {', '.join(ROLES)}"
    total = sum(count for _, count in runs)
    if total != num_tokens:
        return f"roles cover {total} tokens, the record has {num_tokens}"
    return None


def special_problem(special: Any, num_tokens: int) -> str | None:
    """What is wrong with a record's ``special`` positions (None: nothing)."""
    if (not isinstance(special, list) or not all(type(p) is int and 0 <= p < num_tokens for p in special)
            or any(a >= b for a, b in zip(special, special[1:]))):
        return f"special must be increasing token positions below {num_tokens}"
    return None
