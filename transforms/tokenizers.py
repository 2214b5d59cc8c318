"""A Hugging Face tokenizer loaded once per process, and what it marks special. Without Beam: the
runner loads the tokenizer that writes its continuations' text here too."""

from __future__ import annotations

import functools

from common.cli import UserError


@functools.lru_cache(maxsize=4)
def load_tokenizer(name_or_path: str):
    """``AutoTokenizer.from_pretrained`` with failures reported as one ``UserError`` line.

    Cached per process: every DoFn of a worker (and the launcher of a local run) shares one
    instance instead of parsing the 150k-entry vocabulary again. Callers must not mutate it.
    """
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception as e:  # transformers raises OSError/ValueError/HFValidationError
        raise UserError(f"cannot load tokenizer {name_or_path!r}: {str(e).splitlines()[0]}") from None


def special_ids(tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's special tokens: those its settings name (BOS, EOS, pad, ...) and
    the added tokens it marks special (end-of-turn markers and the like)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(getattr(tokenizer, "all_special_ids", [])) | {i for i, token in added.items()
                                                                    if getattr(token, "special", False)}
