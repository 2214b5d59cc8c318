"""Stream records continued by the model before their activations are computed
(``runners.tpu_host --generate``): each prompt's continuation (``model.generate``) appended to its
tokens, with the role ``generated``, and recorded as the sample's ``generation``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

from common.roles import GENERATED
from model.sampling import Sampling


@dataclasses.dataclass(frozen=True)
class Continuing:
    """How a window's records are continued: by ``generator`` (``model.generate.Generator``), up
    to ``max_new_tokens`` each, ``batch_size`` prompts at a time."""
    generator: Any
    max_new_tokens: int
    sampling: Sampling
    stop_ids: tuple[int, ...]
    batch_size: int
    tokenizer: Any = None           # writes each continuation's text and finds stop strings (None: no text)
    stop_strings: tuple[str, ...] = ()

    def continued(self, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each record with its continuation (``continued_record``), in the records' order.
        Prompts are batched shortest first (a batch pads to its longest); a sample's continuation
        does not depend on its batch (its draws come from the seed and its sample id)."""
        order = sorted(range(len(records)), key=lambda i: (records[i]["num_tokens"], i))
        out: list[dict[str, Any] | None] = [None] * len(records)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            continuations = self.generator.continuations(
                [records[i]["input_ids"] for i in batch], self.max_new_tokens, self.stop_ids, self.sampling,
                [records[i]["sample_id"] for i in batch])
            for i, continuation in zip(batch, continuations):
                text = None
                if self.tokenizer is not None:
                    continuation = cut_at_stop_strings(continuation, self.tokenizer, self.stop_strings)
                    text = self.tokenizer.decode(continuation.tokens)
                out[i] = continued_record(records[i], continuation, text)
        return out


def cut_at_stop_strings(continuation, tokenizer, stops: Sequence[str]):
    """``continuation`` up to the token that completes the first of ``stops`` in its text
    (finish ``stop_string``), or unchanged where none occurs. The model wrote on past it (the
    device stops at tokens only): those tokens are dropped, as if it had stopped there."""
    from model.generate import STOP_STRING, Continuation
    tokens = list(continuation.tokens)
    if not stops or not any(stop in tokenizer.decode(tokens) for stop in stops):
        return continuation
    low, high = 1, len(tokens)  # the shortest prefix whose text holds a stop string: grows with the prefix
    while low < high:
        middle = (low + high) // 2
        if any(stop in tokenizer.decode(tokens[:middle]) for stop in stops):
            high = middle
        else:
            low = middle + 1
    return Continuation(tokens[:low], STOP_STRING)


def continued_record(record: dict[str, Any], continuation, text: str | None = None) -> dict[str, Any]:
    """``record`` (a prompt) followed by ``continuation`` (``model.generate.Continuation``): its
    tokens appended, their role ``generated`` (a record without roles keeps none), and
    ``generation``: the prompt's length, the continuation's tokens, their number, why it ended and
    its ``text`` (None without a tokenizer)."""
    prompt, written = list(record["input_ids"]), list(continuation.tokens)
    roles = record.get("roles")
    if roles is not None and written:
        roles = [*roles, [GENERATED, len(written)]]
    return {**record, "input_ids": prompt + written, "num_tokens": len(prompt) + len(written), "roles": roles,
            "generation": {"prompt_tokens": len(prompt), "token_ids": written, "num_tokens": len(written),
                           "finish": continuation.finish, "text": text}}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def generation_tokenizer(tokenizer: str | None, model_dir: str) -> str | None:
    """Where the tokenizer of continuations' text is: ``tokenizer`` (``--tokenizer``), else the
    checkpoint directory where it has one's files, else None (no text, no stop strings)."""
    if tokenizer:
        return tokenizer
    return model_dir if any(os.path.exists(os.path.join(model_dir, name)) for name in TOKENIZER_FILES) else None
