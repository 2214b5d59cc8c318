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

Every token gets its role (``common/roles.py``): a chat's from where each message's content lies
in the rendered text (``transforms/spans.py``) and the tokenizer's offset mapping; a plain text's
tokens are ``text``; a BOS or EOS put around a text by the tokenizer's settings, and an ARC
answer's tokens (``assistant``), are known by construction. Tokens whose id is one of the
tokenizer's special tokens are listed in ``special``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import weakref
from typing import Any, Iterable, Iterator, Sequence

import apache_beam as beam
import numpy as np
from apache_beam import pvalue

from common.cli import UserError
from common.roles import ASSISTANT, ROLE_CODES, TEMPLATE, TEXT, runs_of_codes
from transforms.ids import split_sample_id
from transforms.rejections import RejectedRecord, count_rejection, rejection
from transforms.tokenizers import load_tokenizer, special_ids
from transforms.samples import REJECTED_TAG, Sample
from transforms.spans import Rendering, plain_rendering, template_rendering, token_role_codes


@dataclasses.dataclass(frozen=True)
class TokenizedSample:
    sample_id: int
    source: str
    prompt: str  # the exact text that was tokenized (a BOS put in front by ``with_bos`` is not in it)
    input_ids: tuple[int, ...]
    truncated: bool
    original_num_tokens: int  # before truncation
    answer_start: int | None = None  # first answer token (may lie past a truncation)
    roles: tuple[tuple[str, int], ...] = ()  # each token's role, as runs (common/roles.py)
    special: tuple[int, ...] = ()  # positions of the tokenizer's special tokens
    columns: tuple[tuple[str, Any], ...] = ()  # the kept columns' (name, value)
    answers: tuple[int, ...] = ()  # the answer's and the wrong answer's token (--answer_columns)
    expected_output: Any = None  # ARC: the test's output grid, where known (transforms.arc.scored_answer)


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
    special_ids: frozenset[int] = frozenset()  # the tokenizer's special tokens (BOS, EOS, end of turn, ...)

    @functools.cached_property
    def special_array(self) -> np.ndarray:
        """``special_ids`` as a sorted int64 array (for ``np.isin``)."""
        return np.array(sorted(self.special_ids), np.int64)

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


# The date Llama 3.1-3.3's templates write into the prompt ("Today Date: ..."): they read
# ``date_string`` where given, else today's date, which would make a sample's ids depend on the
# day it was prepared.
PROMPT_DATE = "01 Jan 2024"


def _apply_template(tokenizer, messages: Sequence[tuple[str, str]], generation_prompt: bool = True) -> str:
    chat = [{"role": role, "content": content} for role, content in messages]
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt,
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
    specials = special_ids(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        return PromptConventions(False, False, bos, end_ids, None, special_ids=specials)
    folded, rendered, error = _probe_template(tokenizer)
    template_bos = _template_bos(tokenizer, rendered, bos) if rendered is not None else None
    return PromptConventions(True, folded, bos, end_ids, template_bos, error, specials)


_CONVENTIONS: weakref.WeakKeyDictionary[Any, PromptConventions] = weakref.WeakKeyDictionary()


def prompt_conventions(tokenizer) -> PromptConventions:
    """``probe_conventions``, once per tokenizer object (a few renderings; cheap, but not per
    sample)."""
    conventions = _CONVENTIONS.get(tokenizer)
    if conventions is None:
        conventions = _CONVENTIONS[tokenizer] = probe_conventions(tokenizer)
    return conventions


def render_sample(tokenizer, sample: Sample) -> Rendering:
    """The text to tokenize and where each message's content lies in it: the chat rendered by the
    tokenizer's template (folding the system turn where it refuses one) or plainly without a
    template, or the plain text (no spans: all of it is text). ``RejectedRecord`` for a conversation
    the template refuses (it raises: roles out of the order it takes) or rewrites
    (``transforms/spans.py``)."""
    if sample.messages is None:
        return Rendering(sample.text, ())
    conventions = prompt_conventions(tokenizer)
    if not conventions.chat_template:
        return plain_rendering(sample.messages)
    if conventions.template_error is not None:
        raise UserError(conventions.template_error)
    fold = fold_system if conventions.system_folded else tuple

    def render(messages: Sequence[tuple[str, str]]) -> str:
        try:
            return _apply_template(tokenizer, messages, sample.generation_prompt)
        except Exception as e:  # jinja2's TemplateError from raise_exception, or anything a template does
            raise RejectedRecord("template_refused", (str(e).splitlines() or [type(e).__name__])[0]) from None
    return template_rendering(render, sample.messages, fold)


def render_prompt(tokenizer, sample: Sample) -> str:
    """The text to tokenize (``render_sample``'s)."""
    return render_sample(tokenizer, sample).text


def with_bos(ids: list[int], conventions: PromptConventions) -> list[int]:
    """The BOS rule, in one place: ``ids`` (encoded without special tokens) with the BOS of the
    tokenizer's settings in front, unless they already start with it (rendered by the template,
    or written in the text). Without such a BOS, ``ids`` as they are (a BOS the template rendered
    stays)."""
    if conventions.bos is None or ids[:1] == [conventions.bos[0]]:
        return ids
    return [conventions.bos[0]] + ids


def encode_with_offsets(tokenizer, texts: list[str]) -> list[tuple[list[int], np.ndarray]]:
    """(ids, character offsets of each token [tokens, 2]) of many texts in one call, without
    special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UserError(f"tokenizer {_name(tokenizer)!r} is not a fast (Rust) tokenizer: token roles need its "
                        "offset mapping")
    return [(e.ids, np.array(e.offsets, np.int64).reshape(-1, 2))
            for e in backend.encode_batch(texts, add_special_tokens=False)]


@dataclasses.dataclass
class Encoded:
    """A prompt's tokens as encoded (BOS by ``with_bos``, the settings' end tokens after a plain
    text) with each token's role code (``common.roles.ROLE_CODES``)."""
    ids: list[int]
    roles: np.ndarray  # [tokens] uint8


def encode_prompts(tokenizer, samples: Sequence[Sample], renderings: Sequence[Rendering]) -> list[Encoded]:
    """The tokens of rendered samples and their roles: plain texts in one offset-free encoding
    call, chats in one call with offsets. BOS by ``with_bos``, and the settings' end tokens after
    plain texts only; both ``template``."""
    conventions = prompt_conventions(tokenizer)
    chats = [i for i, s in enumerate(samples) if s.messages is not None]
    texts = [i for i, s in enumerate(samples) if s.messages is None]
    encoded: dict[int, Encoded] = {}
    for i, ids in zip(texts, encode_batch(tokenizer, [renderings[i].text for i in texts], add_special_tokens=False)):
        encoded[i] = Encoded(ids, np.full(len(ids), ROLE_CODES[TEXT], np.uint8))
    for i, (ids, offsets) in zip(chats, encode_with_offsets(tokenizer, [renderings[i].text for i in chats])):
        encoded[i] = Encoded(ids, token_role_codes(offsets, renderings[i].spans))
    out, template = [], ROLE_CODES[TEMPLATE]
    for i, sample in enumerate(samples):
        ids, roles = encoded[i].ids, encoded[i].roles
        full = with_bos(ids, conventions)
        after = list(conventions.end_ids) if sample.messages is None else []
        roles = np.concatenate([np.full(len(full) - len(ids), template, np.uint8), roles,
                                np.full(len(after), template, np.uint8)])
        out.append(Encoded(full + after, roles))
    return out


def tokenize_samples(tokenizer, samples: Sequence[Sample], max_seq_length: int | None,
                     rejected: list[tuple[Sample, RejectedRecord]] | None = None) -> list[TokenizedSample]:
    """Tokenizes a batch (one encoding call for the plain texts, one for the chats, one for the
    answers), in order, each token with its role and special tokens marked. A sample that cannot be
    rendered (``render_sample``) raises, or with ``rejected`` is left out and listed there."""
    renderings = []
    for sample in samples:
        try:
            renderings.append(render_sample(tokenizer, sample))
        except RejectedRecord as e:
            if rejected is None:
                raise
            rejected.append((sample, e))
            renderings.append(None)
    if None in renderings:
        samples = [s for s, r in zip(samples, renderings) if r is not None]
        renderings = [r for r in renderings if r is not None]
    encoded = encode_prompts(tokenizer, samples, renderings)
    answered = [i for i, s in enumerate(samples) if s.answer is not None]
    answers = dict(zip(answered, encode_batch(tokenizer, [samples[i].answer for i in answered],
                                              add_special_tokens=False))) if answered else {}
    specials = prompt_conventions(tokenizer).special_array
    metric_answers = _metric_answers(tokenizer, samples)
    out = []
    for i, (sample, rendering, prompt) in enumerate(zip(samples, renderings, encoded)):
        answer = answers.get(i, [])
        answer_start = len(prompt.ids) if i in answers else None
        tokens = prompt.ids + answer
        roles = np.concatenate([prompt.roles, np.full(len(answer), ROLE_CODES[ASSISTANT], np.uint8)])
        truncated = max_seq_length is not None and len(tokens) > max_seq_length
        kept = tokens[:max_seq_length] if truncated else tokens
        special = np.flatnonzero(np.isin(np.asarray(kept, np.int64), specials))
        out.append(TokenizedSample(
            sample.sample_id, sample.source, rendering.text + (sample.answer or ""), tuple(kept), truncated,
            len(tokens), answer_start, roles=tuple(map(tuple, runs_of_codes(roles[:len(kept)]))),
            special=tuple(special.tolist()), columns=sample.columns, answers=metric_answers.get(i, ()),
            expected_output=sample.expected_output))
    return out


def _metric_answers(tokenizer, samples: Sequence[Sample]) -> dict[int, tuple[int, ...]]:
    """Sample index -> the token of each of its answer texts (``--answer_columns``: a logit
    difference compares one token with one token); ``UserError`` for a text of another count."""
    having = [i for i, s in enumerate(samples) if s.answer_texts]
    texts = [text for i in having for text in samples[i].answer_texts]
    if not texts:
        return {}
    encoded = iter(zip(texts, encode_batch(tokenizer, texts, add_special_tokens=False)))
    out = {}
    for i in having:
        found = [next(encoded) for _ in samples[i].answer_texts]
        bad = next(((text, ids) for text, ids in found if len(ids) != 1), None)
        if bad is not None:
            raise UserError(f"sample {samples[i].sample_id} ({samples[i].origin or samples[i].source}): the answer "
                            f"{bad[0]!r} is {len(bad[1])} tokens of {_name(tokenizer)}, not one (--answer_columns: a "
                            "logit difference compares one token with one)")
        out[i] = tuple(ids[0] for _, ids in found)
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

    def process(self, batch: list[Sample]) -> Iterator[Any]:
        rejected: list[tuple[Sample, RejectedRecord]] = []
        yield from tokenize_samples(self._tokenizer, batch, self._max_seq_length, rejected)
        for sample, error in rejected:
            count_rejection(error.reason)
            file_index, row, _ = split_sample_id(sample.sample_id)
            preview = [{"role": role, "content": content} for role, content in sample.messages or ()]
            yield pvalue.TaggedOutput(REJECTED_TAG, rejection(error, sample.origin, file_index, row, preview))


class TokenizeSamples(beam.PTransform):
    """``Sample``s -> ``TokenizedSample``s (main output ``samples``) and the dead-letter dicts of
    conversations the chat template refuses (``rejected``), in batches (one encoding call each). Run in the
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
                | "Encode" >> beam.ParDo(_TokenizeFn(self._tokenizer, self._max_seq_length)).with_outputs(
                    REJECTED_TAG, main="samples"))


def decoded_pieces(tokenizer, input_ids: Iterable[int]) -> list[str]:
    """Each token decoded on its own, for people reviewing a tokenization."""
    return [tokenizer.decode([t]) for t in input_ids]
