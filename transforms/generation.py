"""Stream records continued by the model before their activations are computed
(``runners.tpu_host --generate``): each prompt's continuation (``model.generate``) appended to its
tokens, with the role ``generated`` (``thinking`` inside a thinking section), its special tokens
marked, and recorded as the sample's ``generation``: with its text where a tokenizer is known, and
scored where the stream record knows the answer (an ARC task's ``expected_output``)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import numpy as np

from common.roles import GENERATED, ROLE_CODES, THINKING, Runs, runs_of_codes
from interventions.resolve import steered_positions
from model.sampling import Sampling
from transforms.arc import scored_answer

THINKING_MARKERS = ("<think>", "</think>")  # Qwen3's, DeepSeek-R1's and their kind's: one token each


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
    special_ids: frozenset[int] = frozenset()  # marked special where the model writes them (its stop ids too)
    thinking: tuple[int, int] | None = None    # the ids opening and closing a thinking section (thinking_ids)
    steer_tokens: str | None = None  # the tokens of each prompt its intervention's steerings add to (None: all)

    def continued(self, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each record with its continuation (``continued_record``), in the records' order.
        Prompts are batched shortest first (a batch pads to its longest); a sample's continuation
        does not depend on its batch (its draws come from the seed and its sample id)."""
        order = sorted(range(len(records)), key=lambda i: (records[i]["num_tokens"], i))
        out: list[dict[str, Any] | None] = [None] * len(records)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            steered = [steered_positions(self.steer_tokens, records[i].get("roles"), records[i]["num_tokens"],
                                         records[i]["sample_id"]) for i in batch] if self.steer_tokens else None
            continuations = self.generator.continuations(
                [records[i]["input_ids"] for i in batch], self.max_new_tokens, self.stop_ids, self.sampling,
                [records[i]["sample_id"] for i in batch], steered)
            for i, continuation in zip(batch, continuations):
                text, answer = None, None
                if self.tokenizer is not None:
                    continuation = cut_at_stop_strings(continuation, self.tokenizer, self.stop_strings)
                    text = self.tokenizer.decode(continuation.tokens)
                    answer = self.answer_text(records[i]["input_ids"], continuation.tokens, text)
                out[i] = continued_record(records[i], continuation, text, self.special_ids | set(self.stop_ids),
                                          self.thinking, answer)
        return out

    def answer_text(self, prompt: Sequence[int], tokens: Sequence[int], text: str) -> str:
        """The text of a continuation ``tokens`` after ``prompt`` that follows its thinking
        section: all of it where it has none, nothing where it ends inside one."""
        if self.thinking is None:
            return text
        runs = written_runs(prompt, tokens, self.thinking)
        if runs[-1][0] == THINKING:
            return ""
        return text if len(runs) == 1 else self.tokenizer.decode(list(tokens[len(tokens) - runs[-1][1]:]))


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


def continued_record(record: dict[str, Any], continuation, text: str | None = None,
                     special_ids: frozenset[int] | set[int] = frozenset(), thinking: tuple[int, int] | None = None,
                     answer_text: str | None = None) -> dict[str, Any]:
    """``record`` (a prompt) followed by ``continuation`` (``model.generate.Continuation``): its
    tokens appended with their roles (``written_runs``; a record without roles keeps none), those
    among ``special_ids`` added to its ``special`` positions (where it has them), and
    ``generation``: the prompt's length, the continuation's tokens, their number, why it ended,
    its ``text`` (None without a tokenizer) and, where the record has an ARC ``expected_output``
    and ``answer_text`` is known, ``transforms.arc.scored_answer``'s fields."""
    prompt, written = list(record["input_ids"]), list(continuation.tokens)
    roles, special = record.get("roles"), record.get("special")
    if roles is not None and written:
        roles = [*roles, *written_runs(prompt, written, thinking)]
    if special is not None:
        special = [*special, *(len(prompt) + i for i, token in enumerate(written) if token in special_ids)]
    generation = {"prompt_tokens": len(prompt), "token_ids": written, "num_tokens": len(written),
                  "finish": continuation.finish, "text": text}
    if record.get("expected_output") is not None and answer_text is not None:
        generation.update(scored_answer(answer_text, record["expected_output"]))
    return {**record, "input_ids": prompt + written, "num_tokens": len(prompt) + len(written), "roles": roles,
            "special": special, "generation": generation}


def written_runs(prompt: Sequence[int], written: Sequence[int], thinking: tuple[int, int] | None) -> Runs:
    """The role runs of a continuation ``written`` after ``prompt``: ``thinking`` from an opening
    marker through its closing one (``thinking``: their ids; None: no such section), ``generated``
    elsewhere. A prompt whose last opening marker is not closed (a chat template that opens the
    section for the model) starts the continuation inside it."""
    if thinking is None:
        return [[GENERATED, len(written)]]
    opening, closing = thinking
    inside = last_index(prompt, opening) > last_index(prompt, closing)
    codes = np.empty(len(written), np.uint8)  # [written]
    for i, token in enumerate(written):
        inside = inside or token == opening
        codes[i] = ROLE_CODES[THINKING if inside else GENERATED]
        inside = inside and token != closing
    return runs_of_codes(codes)


def last_index(tokens: Sequence[int], token: int) -> int:
    """The last position of ``token`` in ``tokens`` (-1: none)."""
    return max((i for i, t in enumerate(tokens) if t == token), default=-1)


def thinking_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of ``THINKING_MARKERS`` where ``tokenizer`` has each as one token (None: it has no
    thinking section)."""
    vocabulary = tokenizer.get_vocab()
    ids = tuple(vocabulary.get(marker) for marker in THINKING_MARKERS)
    return None if None in ids else ids


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def generation_tokenizer(tokenizer: str | None, model_dir: str) -> str | None:
    """Where the tokenizer of continuations' text is: ``tokenizer`` (``--tokenizer``), else the
    checkpoint directory where it has one's files, else None (no text, no stop strings)."""
    if tokenizer:
        return tokenizer
    return model_dir if any(os.path.exists(os.path.join(model_dir, name)) for name in TOKENIZER_FILES) else None
