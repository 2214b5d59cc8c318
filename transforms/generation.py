"""Stream records continued by the model before their activations are computed
(``runners.tpu_host --generate``): each prompt's continuation (``model.generate``) appended to its
tokens, with the role ``generated``, and recorded as the sample's ``generation``."""

from __future__ import annotations

import dataclasses
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
                out[i] = continued_record(records[i], continuation)
        return out


def continued_record(record: dict[str, Any], continuation) -> dict[str, Any]:
    """``record`` (a prompt) followed by ``continuation`` (``model.generate.Continuation``): its
    tokens appended, their role ``generated`` (a record without roles keeps none), and
    ``generation``: the prompt's length, the continuation's tokens, their number, why it ended."""
    prompt, written = list(record["input_ids"]), list(continuation.tokens)
    roles = record.get("roles")
    if roles is not None and written:
        roles = [*roles, [GENERATED, len(written)]]
    return {**record, "input_ids": prompt + written, "num_tokens": len(prompt) + len(written), "roles": roles,
            "generation": {"prompt_tokens": len(prompt), "token_ids": written, "num_tokens": len(written),
                           "finish": continuation.finish}}
