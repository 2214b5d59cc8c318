"""Batched tokenization with a Hugging Face tokenizer loaded once per worker.

Chat samples are rendered through the tokenizer's own chat template (with the generation prompt
for the assistant) and encoded without adding special tokens again; plain texts are encoded with
the tokenizer's usual special tokens. ``max_seq_length`` keeps the first tokens and marks the
sample ``truncated`` (with its ``original_num_tokens``). A sample's answer (ARC with
``--include_answers``) is encoded on its own and appended to the prompt's tokens, so that its span
starts exactly at ``answer_start``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Iterator, Sequence

import apache_beam as beam

from common.cli import UserError
from transforms.samples import Sample


@dataclasses.dataclass(frozen=True)
class TokenizedSample:
    sample_id: int
    source: str
    prompt: str  # the exact text that was tokenized
    input_ids: tuple[int, ...]
    truncated: bool
    original_num_tokens: int  # before truncation
    answer_start: int | None = None  # first answer token (may lie past a truncation)


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


def render_prompt(tokenizer, sample: Sample) -> str:
    """The text to tokenize: the chat rendered by the tokenizer's template, or the plain text."""
    if sample.messages is None:
        return sample.text
    messages = [{"role": role, "content": content} for role, content in sample.messages]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_batch(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of many texts in one call; the Rust backend's offset-free path when there is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]
    return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]


def tokenize_samples(tokenizer, samples: Sequence[Sample],
                     max_seq_length: int | None) -> list[TokenizedSample]:
    """Tokenizes a batch in one call per kind (chat / plain), preserving the input order."""
    prompts = [render_prompt(tokenizer, s) for s in samples]
    ids: list[list[int] | None] = [None] * len(samples)
    for is_chat in (True, False):
        positions = [i for i, s in enumerate(samples) if (s.messages is not None) == is_chat]
        if positions:
            encoded = encode_batch(tokenizer, [prompts[i] for i in positions],
                                   add_special_tokens=not is_chat)
            for i, tokens in zip(positions, encoded):
                ids[i] = tokens
    answered = [i for i, s in enumerate(samples) if s.answer is not None]
    answers = dict(zip(answered, encode_batch(tokenizer, [samples[i].answer for i in answered],
                                              add_special_tokens=False))) if answered else {}
    out = []
    for i, (sample, prompt, tokens) in enumerate(zip(samples, prompts, ids)):
        answer_start = len(tokens) if i in answers else None
        tokens = list(tokens) + answers.get(i, [])
        truncated = max_seq_length is not None and len(tokens) > max_seq_length
        kept = tokens[:max_seq_length] if truncated else tokens
        out.append(TokenizedSample(sample.sample_id, sample.source, prompt + (sample.answer or ""),
                                   tuple(kept), truncated, len(tokens), answer_start))
    return out


class _TokenizeFn(beam.DoFn):
    def __init__(self, tokenizer: str, max_seq_length: int | None):
        self._tokenizer_name = tokenizer
        self._max_seq_length = max_seq_length
        self._tokenizer = None

    def setup(self):
        self._tokenizer = load_tokenizer(self._tokenizer_name)

    def process(self, batch: list[Sample]) -> Iterator[TokenizedSample]:
        yield from tokenize_samples(self._tokenizer, batch, self._max_seq_length)


class TokenizeSamples(beam.PTransform):
    """``Sample``s -> ``TokenizedSample``s, in batches so the Rust tokenizer can use every core."""

    def __init__(self, tokenizer: str, max_seq_length: int | None,
                 min_batch_size: int = 64, max_batch_size: int = 512):
        super().__init__()
        self._tokenizer = tokenizer
        self._max_seq_length = max_seq_length
        self._batching = dict(min_batch_size=min_batch_size, max_batch_size=max_batch_size)

    def expand(self, samples):
        return (samples
                | "Batch" >> beam.BatchElements(**self._batching)
                | "Encode" >> beam.ParDo(_TokenizeFn(self._tokenizer, self._max_seq_length)))


def decoded_pieces(tokenizer, input_ids: Iterable[int]) -> list[str]:
    """Each token decoded on its own, for people reviewing a tokenization."""
    return [tokenizer.decode([t]) for t in input_ids]
