"""Batched tokenization with a Hugging Face tokenizer loaded once per worker.

How a tokenizer's prompts are built is decided once per tokenizer (``prompt_conventions``, by
probing the tokenizer itself, whatever its family) and applied to every sample:

* **Chats** are rendered by the tokenizer's own chat template with the assistant generation
  prompt. A template that refuses a ``system`` turn (raises, or drops its text) gets the system
  text at the start of the first user turn: system text, a blank line, the user text. A tokenizer
  without a chat template (a base model) gets the plain rendering (``plain_rendering``). A
  template that writes today's date (Llama 3.1-3.3's) gets ``PROMPT_DATE``, so ids never
  depend on the day.
* **Plain texts** are encoded as they are.
* **BOS, one rule** (``with_bos``): every sequence starts with the BOS token exactly once if the
  tokenizer's own settings add one (what encoding with special tokens puts in front: with a
  ``tokenizer.json``, transformers 5 reads only its post-processor, not ``add_bos_token``) or its
  chat template renders one, and never otherwise. Texts are encoded without special tokens and
  the BOS is put in front unless the text already begins with it, so a template that renders
  ``{{ bos_token }}`` is not given a second one and a template that does not is not left
  without. What the settings add after a text (an EOS, for a few tokenizers) follows plain texts
  only, never a prompt that the assistant's answer continues.

``max_seq_length`` keeps the first tokens and marks the sample ``truncated`` (with its
``original_num_tokens``). A sample's answer (ARC with ``--include_answers``) is encoded on its own
and appended to the prompt's tokens, so that its span starts exactly at ``answer_start``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import weakref
from typing import Any, Iterable, Iterator, Sequence

import apache_beam as beam

from common.cli import UserError
from transforms.samples import Sample


@dataclasses.dataclass(frozen=True)
class TokenizedSample:
    sample_id: int
    source: str
    prompt: str  # the exact text that was tokenized (a BOS put in front by ``with_bos`` is not in it)
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


# What the conventions are probed with: plain words (the system text is looked for in a rendering).
PROBE_TEXT = "probe text"
PROBE_SYSTEM = "Probe system text."
PROBE_USER = "Probe user text."

BOS_FROM_TEMPLATE = "chat_template"
BOS_FROM_TOKENIZER = "tokenizer"


@dataclasses.dataclass(frozen=True)
class PromptConventions:
    """How one tokenizer's prompts are built; see the module docstring for the rules."""
    chat_template: bool  # chats go through the tokenizer's template (else ``plain_rendering``)
    system_folded: bool  # the template refuses a system turn: its text opens the first user turn
    bos: tuple[int, str] | None  # (id, token) the tokenizer's settings put before every text
    end_ids: tuple[int, ...]  # what the settings put after a text (plain texts only)
    template_bos: tuple[int, str] | None  # (id, token) the template's rendering starts with
    template_error: str | None = None  # why the template cannot render a chat (a UserError line)

    def manifest_record(self, chat: bool) -> dict[str, Any]:
        """What happened to the prompts of a run of chats (``chat``) or plain texts, for
        ``manifest.json``: template or plain rendering, system folding, and which BOS token starts
        every prompt (``bos_token``, ``bos_token_id``) and where it came from (``bos_source``:
        ``"chat_template"``, ``"tokenizer"`` for the tokenizer's settings, or null: no BOS)."""
        templated = chat and self.chat_template
        if templated and self.template_bos is not None:
            bos, source = self.template_bos, BOS_FROM_TEMPLATE
        elif self.bos is not None:
            bos, source = self.bos, BOS_FROM_TOKENIZER
        else:
            bos, source = None, None
        return {"chat_template": templated, "system_folded": templated and self.system_folded,
                "bos_token": bos[1] if bos else None, "bos_token_id": bos[0] if bos else None,
                "bos_source": source}


def encode_batch(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of many texts in one call; the Rust backend's offset-free path when there is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]
    return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def settings_specials(tokenizer) -> tuple[tuple[int, str] | None, tuple[int, ...]]:
    """(BOS, end ids) that the tokenizer's settings add around a text, seen by encoding a probe
    with and without special tokens: whichever mechanism adds them (a post-processor in
    tokenizer.json, ``add_bos_token`` of a converted tokenizer), this is what encoding does."""
    with_specials, bare = (encode_batch(tokenizer, [PROBE_TEXT], flag)[0] for flag in (True, False))
    starts = [i for i in range(len(with_specials) - len(bare) + 1)
              if with_specials[i:i + len(bare)] == bare]
    if not starts or starts[0] > 1:
        raise UserError(f"tokenizer {_name(tokenizer)!r} adds special tokens other than one BOS "
                        f"before a text ({with_specials} for {bare}): not supported")
    start = starts[0]
    bos = None
    if start:
        bos = (with_specials[0], tokenizer.convert_ids_to_tokens(with_specials[0]))
    return bos, tuple(with_specials[start + len(bare):])


def fold_system(messages: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The chat without its leading system turn: the system text, a blank line, then the first
    user turn's text become that user turn (the system text alone if no user turn follows)."""
    messages = tuple(messages)
    if not messages or messages[0][0] != "system":
        return messages
    system, rest = messages[0][1], messages[1:]
    if rest and rest[0][0] == "user":
        return (("user", f"{system}\n\n{rest[0][1]}"),) + rest[1:]
    return (("user", system),) + rest


def plain_rendering(messages: Sequence[tuple[str, str]]) -> str:
    """A chat for a tokenizer without a chat template (a base model): every turn's text in order,
    no role names, each followed by a blank line. For ARC: the system text, a blank line, the
    user text (ending with the question), a blank line; the answer (``--include_answers``)
    follows as the next paragraph."""
    return "".join(f"{content}\n\n" for _, content in messages)


# The date Llama 3.1-3.3's templates write into the prompt ("Today Date: ..."): they read
# ``date_string`` where given, else today's date, which would make a sample's ids depend on the
# day it was prepared.
PROMPT_DATE = "01 Jan 2024"


def _apply_template(tokenizer, messages: Sequence[tuple[str, str]]) -> str:
    chat = [{"role": role, "content": content} for role, content in messages]
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                         date_string=PROMPT_DATE)


def _probe_template(tokenizer) -> tuple[bool, str | None, str | None]:
    """(fold the system turn, a rendering of the probe chat, why it cannot render) for a tokenizer
    with a chat template. Templates that refuse a system turn are found by trying one, whatever
    the family: they raise (Gemma 2: "System role not supported") or drop its text."""
    chat = (("system", PROBE_SYSTEM), ("user", PROBE_USER))
    try:
        rendered = _apply_template(tokenizer, chat)
        if PROBE_SYSTEM in rendered:
            return False, rendered, None
    except Exception:  # jinja2's TemplateError from raise_exception, or anything a template does
        pass
    try:
        return True, _apply_template(tokenizer, fold_system(chat)), None
    except Exception as e:
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        return True, None, (f"the chat template of tokenizer {_name(tokenizer)!r} cannot render "
                            f"a user turn: {first_line}")


def _template_bos(tokenizer, rendered: str, bos: tuple[int, str] | None) -> tuple[int, str] | None:
    """The BOS the template renders itself (``{{ bos_token }}``), if its rendering starts with one."""
    first = encode_batch(tokenizer, [rendered], add_special_tokens=False)[0][:1]
    candidates = [bos] if bos is not None else []
    if getattr(tokenizer, "bos_token_id", None) is not None:
        candidates.append((tokenizer.bos_token_id, tokenizer.bos_token))
    return next((c for c in candidates if first == [c[0]]), None)


def probe_conventions(tokenizer) -> PromptConventions:
    """The ``PromptConventions`` of a tokenizer, from its behaviour on probe texts and chats."""
    bos, end_ids = settings_specials(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        return PromptConventions(False, False, bos, end_ids, None)
    folded, rendered, error = _probe_template(tokenizer)
    template_bos = _template_bos(tokenizer, rendered, bos) if rendered is not None else None
    return PromptConventions(True, folded, bos, end_ids, template_bos, error)


_CONVENTIONS: weakref.WeakKeyDictionary[Any, PromptConventions] = weakref.WeakKeyDictionary()


def prompt_conventions(tokenizer) -> PromptConventions:
    """``probe_conventions``, once per tokenizer object (a few renderings; cheap, but not per
    sample)."""
    conventions = _CONVENTIONS.get(tokenizer)
    if conventions is None:
        conventions = _CONVENTIONS[tokenizer] = probe_conventions(tokenizer)
    return conventions


def render_prompt(tokenizer, sample: Sample) -> str:
    """The text to tokenize: the chat rendered by the tokenizer's template (folding the system
    turn where it refuses one) or plainly without a template, or the plain text."""
    if sample.messages is None:
        return sample.text
    conventions = prompt_conventions(tokenizer)
    if not conventions.chat_template:
        return plain_rendering(sample.messages)
    if conventions.template_error is not None:
        raise UserError(conventions.template_error)
    messages = fold_system(sample.messages) if conventions.system_folded else sample.messages
    return _apply_template(tokenizer, messages)


def with_bos(ids: list[int], conventions: PromptConventions) -> list[int]:
    """The BOS rule, in one place: ``ids`` (encoded without special tokens) with the BOS of the
    tokenizer's settings in front, unless they already start with it (rendered by the template,
    or written in the text). Without such a BOS, ``ids`` as they are (a BOS the template rendered
    stays)."""
    if conventions.bos is None or ids[:1] == [conventions.bos[0]]:
        return ids
    return [conventions.bos[0]] + ids


def encode_prompts(tokenizer, samples: Sequence[Sample], prompts: Sequence[str]) -> list[list[int]]:
    """The ids of rendered samples, in one encoding call: BOS by ``with_bos``, and the settings'
    end tokens after plain texts only."""
    conventions = prompt_conventions(tokenizer)
    encoded = encode_batch(tokenizer, list(prompts), add_special_tokens=False)
    return [with_bos(ids, conventions) + (list(conventions.end_ids) if s.messages is None else [])
            for s, ids in zip(samples, encoded)]


def tokenize_samples(tokenizer, samples: Sequence[Sample],
                     max_seq_length: int | None) -> list[TokenizedSample]:
    """Tokenizes a batch (one encoding call for the prompts, one for the answers), in order."""
    prompts = [render_prompt(tokenizer, s) for s in samples]
    ids = encode_prompts(tokenizer, samples, prompts)
    answered = [i for i, s in enumerate(samples) if s.answer is not None]
    answers = dict(zip(answered, encode_batch(tokenizer, [samples[i].answer for i in answered],
                                              add_special_tokens=False))) if answered else {}
    out = []
    for i, (sample, prompt, tokens) in enumerate(zip(samples, prompts, ids)):
        answer_start = len(tokens) if i in answers else None
        tokens = tokens + answers.get(i, [])
        truncated = max_seq_length is not None and len(tokens) > max_seq_length
        kept = tokens[:max_seq_length] if truncated else tokens
        out.append(TokenizedSample(sample.sample_id, sample.source, prompt + (sample.answer or ""),
                                   tuple(kept), truncated, len(tokens), answer_start))
    return out


def _this_process() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


class _TokenizeFn(beam.DoFn):
    def __init__(self, tokenizer: str, max_seq_length: int | None):
        self._tokenizer_name = tokenizer
        self._max_seq_length = max_seq_length
        self._tokenizer = None
        self._launcher = _this_process()  # the process that builds the pipeline

    def setup(self):
        if _this_process() != self._launcher:
            # A Beam worker process: Beam runs one per core (Dataflow's Python harness, local
            # --direct_num_workers), so the Rust tokenizer's own threads would only compete with
            # the other workers' (benchmarks/prepare_throughput.py: 2 workers on 2 cores, 12%
            # slower). The library reads the variable at every call; a value the user set is kept.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._tokenizer = load_tokenizer(self._tokenizer_name)

    def process(self, batch: list[Sample]) -> Iterator[TokenizedSample]:
        yield from tokenize_samples(self._tokenizer, batch, self._max_seq_length)


class TokenizeSamples(beam.PTransform):
    """``Sample``s -> ``TokenizedSample``s, in batches (one encoding call each). Run in the
    launching process (the local runner's default), a batch is spread over every core by the Rust
    tokenizer's threads; in Beam's worker processes, one per core, each encodes on one thread."""

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
