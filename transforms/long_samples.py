"""What becomes of a stream record longer than ``--max_seq_length``: ``--long_samples``.

  * ``truncate`` (default): its first ``max_seq_length`` tokens are computed, as a tokenizer's
    truncation would have left them; the record says ``truncated`` and ``original_num_tokens``.
  * ``skip``: it is not computed; a rejection (sample id, source, length, reason) takes its place
    in the stream order, so a runner can account for it exactly once.
  * ``error``: the run stops with one line naming the sample.
With ``--generate N`` the limit is a prompt's: ``max_seq_length - N``, room left for the continuation.
A causal model's first ``n`` positions do not depend on later tokens, so a truncated sample's
activations are exactly those of the full sample's first ``n`` positions.
"""

from __future__ import annotations

from typing import Any

from common.cli import UserError
from common.roles import cut_runs

POLICIES = ("truncate", "skip", "error")
TOO_LONG = "too_long"  # the rejection reason


class SampleTooLong(UserError):
    """A record over the length limit, with ``--long_samples error``."""


def too_long_message(record: dict[str, Any], limit: int, where: str | None = None, new_tokens: int = 0) -> str:
    """The line of ``--long_samples error``; ``limit`` is a prompt's where ``new_tokens`` follow it."""
    sample = f"sample {record['sample_id']}{f' ({where})' if where else ''} has {record['num_tokens']} tokens"
    if not new_tokens:
        return f"{sample}, more than --max_seq_length {limit} (--long_samples truncate or skip would go on)"
    return (f"{sample}, more than the {limit} a prompt may have: --max_seq_length {limit + new_tokens} less "
            f"--generate {new_tokens} new tokens (--long_samples truncate would continue its first {limit} "
            "tokens; skip would leave it out)")


def fit_record(record: dict[str, Any], limit: int, policy: str, new_tokens: int = 0) -> dict[str, Any] | None:
    """The record as it will be computed, or None when it is to be skipped; ``limit`` is a
    prompt's where ``new_tokens`` will follow it (``--generate``).

    A truncated record's ``roles`` and ``special`` are cut with its tokens. Every returned record
    carries ``truncated`` (also when the prepare pipeline truncated it:
    its stream field) and ``original_num_tokens`` (before any truncation, where known)."""
    if "original_num_tokens" in record:
        original = record["original_num_tokens"]
    else:  # a stream truncated by an older prepare does not say how long the sample was
        original = None if record.get("truncated") else record["num_tokens"]
    if record["num_tokens"] <= limit:
        return {**record, "truncated": bool(record.get("truncated", False)),
                "original_num_tokens": original}
    if policy == "truncate":
        cut = {"roles": cut_runs(record["roles"], limit)} if "roles" in record else {}
        if "special" in record:
            cut["special"] = [p for p in record["special"] if p < limit]
        return {**record, "input_ids": record["input_ids"][:limit], "num_tokens": limit,
                "truncated": True, "original_num_tokens": original, **cut}
    if policy == "skip":
        return None
    if policy == "error":
        raise SampleTooLong(too_long_message(record, limit, new_tokens=new_tokens))
    raise ValueError(f"unknown long-sample policy {policy!r} (choose from {', '.join(POLICIES)})")


def rejection(record: dict[str, Any], limit: int, new_tokens: int = 0) -> dict[str, Any]:
    """The ``rejected.jsonl`` entry of a skipped record; ``limit`` is a prompt's where
    ``new_tokens`` were to follow it (``--generate``: the entry says how many)."""
    generate = {"generate": new_tokens} if new_tokens else {}
    return {"sample_id": record["sample_id"], "source": record["source"], "num_tokens": record["num_tokens"],
            "max_seq_length": limit + new_tokens, **generate, "reason": TOO_LONG}
