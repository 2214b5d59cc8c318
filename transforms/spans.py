"""Where each message's content lies in a rendered prompt, and so the role of every token.

A chat template writes text of its own around the messages' contents. Which characters of the
rendered text are a message's content is found by rendering the conversation a second time with
each content wrapped in markers the template passes through untouched (Unicode noncharacters,
with the message's index): what the template renders between a message's markers is its content
(a content it transforms as a whole keeps its role), everything outside any markers is the
template's. The plain rendering is checked against the marked one with the markers removed. A
template that trims whitespace around a content (Llama 3's and Gemma's ``| trim``) renders the
contents with less whitespace than the marked rendering shows (the markers shield it): each
content's span is then found in the plain rendering as the content less some of its leading and
trailing whitespace, between the template's own pieces. Contents may come in another order than
the messages (Mistral's template writes the system text into the last user turn). A template
that drops a content, renders one twice or keeps only part of one (Qwen3's moves a ``<think>``
block of earlier assistant turns out of the text) cannot be split into roles exactly: the
conversation is rejected (``template_rewrites_content``).

Token roles (``token_roles``) come from the spans and the tokenizer's offset mapping: a token
takes the role of the message whose content holds the most of its characters (the earlier
message on a tie), and ``template`` if it holds none of a content's characters. A token that
straddles a content's edge and the template's text (a BPE merge across the boundary) is content
if any of its characters is: the text of a role's tokens is its content, give or take
whitespace or punctuation merged at its edges.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

import numpy as np

from common.roles import ROLE_CODES, ROLES, TEMPLATE
from transforms.rejections import RejectedRecord

# Noncharacters (never assigned, "for internal use"): open, index separator, close.
OPEN, SEPARATOR, CLOSE = "\ufdd0", "\ufdd1", "\ufdd2"
_MARKED = re.compile(f"{OPEN}(\\d+){SEPARATOR}(.*?){CLOSE}", re.S)
_MARKERS = re.compile(f"[{OPEN}{SEPARATOR}{CLOSE}]")

# Whitespace a template may drop at either end of a content, at most (a bound on the search).
MAX_WHITESPACE = 64
Span = tuple[int, int, str]  # [start, end) characters of the rendered text, and the content's role
Messages = Sequence[tuple[str, str]]


@dataclasses.dataclass(frozen=True)
class Rendering:
    """A rendered prompt and the span of each message's content in it, in text order."""
    text: str
    spans: tuple[Span, ...]


def plain_rendering(messages: Messages) -> Rendering:
    """A chat for a tokenizer without a chat template (a base model): every turn's text in order,
    no role names, each followed by a blank line (the blank lines are ``template``)."""
    text, spans = "", []
    for role, content in messages:
        spans.append((len(text), len(text) + len(content), role))
        text += f"{content}\n\n"
    return Rendering(text, tuple(spans))


def marked(index: int, content: str) -> str:
    """A content wrapped in the markers of message ``index``."""
    if _MARKERS.search(content):
        raise RejectedRecord("reserved_characters", f"message {index} holds one of the noncharacters "
                             "U+FDD0..U+FDD2, which mark contents while rendering")
    return f"{OPEN}{index}{SEPARATOR}{content}{CLOSE}"


def template_rendering(render: Callable[[Messages], str], messages: Messages,
                       fold: Callable[[Messages], Messages] = tuple) -> Rendering:
    """The rendering of ``messages`` by ``render`` (a chat template) with each content's span;
    ``fold`` rewrites the messages before rendering (the system turn folded into the first user
    turn), applied to the marked contents alike. Raises ``RejectedRecord`` where the contents
    cannot be located exactly."""
    text = render(fold(messages))
    marked_text = render(fold([(role, marked(i, content)) for i, (role, content) in enumerate(messages)]))
    pieces, regions, cursor = [], [], 0
    for found in _MARKED.finditer(marked_text):
        pieces.append(marked_text[cursor:found.start()])
        regions.append((int(found.group(1)), found.group(2)))
        cursor = found.end()
    pieces.append(marked_text[cursor:])
    order = [index for index, _ in regions]
    if sorted(order) != list(range(len(messages))) or any(_MARKERS.search(piece) for piece in pieces):
        raise RejectedRecord("template_rewrites_content", "the chat template does not render each message's "
                             f"content once (contents seen: {order} of {len(messages)} messages)")
    spans = _align(text, pieces, [content for _, content in regions])
    if spans is None:
        first = next((i for i, content in regions if content.strip() not in text), order[0])
        raise RejectedRecord("template_rewrites_content", f"the chat template changes the text of message "
                             f"{first} beyond whitespace around it: its tokens' roles cannot be told exactly")
    # In text order, which need not be the messages' (Mistral's puts the system text in the last user turn).
    return Rendering(text, tuple((start, end, messages[i][0]) for i, (start, end) in zip(order, spans)))


def _align(text: str, pieces: list[str], contents: list[str]) -> list[tuple[int, int]] | None:
    """Spans (start, end) of the contents in ``text`` such that ``text`` is ``pieces[0]``, content
    0, ``pieces[1]``, content 1, ..., ``pieces[-1]``, each content as given or with some of its
    leading and trailing whitespace left out (the most kept that fits); None if there are none."""
    if not text.startswith(pieces[0]):
        return None
    spans, at = [], len(pieces[0])
    for content, piece in zip(contents, pieces[1:]):
        lead = min(len(content) - len(content.lstrip()), MAX_WHITESPACE)
        trail = min(len(content) - len(content.rstrip()), MAX_WHITESPACE) if content.strip() else 0
        options = sorted(((a, b) for a in range(lead + 1) for b in range(trail + 1)), key=sum)
        for a, b in options:
            kept = content[a:len(content) - b]
            if text.startswith(kept, at) and text.startswith(piece, at + len(kept)):
                spans.append((at, at + len(kept)))
                at += len(kept) + len(piece)
                break
        else:
            return None
    return spans if at == len(text) else None


def token_role_codes(offsets: np.ndarray | Sequence[tuple[int, int]], spans: Sequence[Span]) -> np.ndarray:
    """[tokens] uint8: each token's role (its code in ``common.roles.ROLES``) from its character
    offsets in the rendered text: the role of the span holding the most of its characters (the
    earlier span on a tie), ``template`` if none. A token with an empty offset range takes the role
    of the span its position lies in. Vectorised: each token is compared with the few spans its
    range reaches (spans are in text order and do not overlap)."""
    bounds = np.asarray(offsets, np.int64).reshape(-1, 2)  # [T, 2]: each token's [begin, end) characters
    codes = np.full(len(bounds), ROLE_CODES[TEMPLATE], np.uint8)
    if not spans or not len(bounds):
        return codes
    starts = np.array([span[0] for span in spans], np.int64)  # [N]
    ends = np.array([span[1] for span in spans], np.int64)
    roles = np.array([ROLE_CODES[span[2]] for span in spans], np.uint8)
    begin, end = bounds[:, 0], bounds[:, 1]
    empty = end <= begin
    first = np.searchsorted(ends, begin, side="right")  # the first span that ends after the token begins
    stop = np.searchsorted(starts, np.where(empty, begin + 1, end), side="left")  # spans beginning before it ends
    width = max(1, int((stop - first).max()))
    candidate = first[:, None] + np.arange(width)[None, :]  # [T, W]
    reached = candidate < stop[:, None]
    candidate = np.minimum(candidate, len(spans) - 1)
    overlap = np.minimum(end[:, None], ends[candidate]) - np.maximum(begin[:, None], starts[candidate])
    overlap = np.where(reached, np.where(empty[:, None], 1, overlap), 0)  # [T, W]
    best = overlap.argmax(axis=1)  # the first of the largest
    held = overlap[np.arange(len(bounds)), best] > 0
    codes[held] = roles[candidate[np.arange(len(bounds)), best][held]]
    return codes


def token_roles(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> list[str]:
    """``token_role_codes`` by name."""
    return [ROLES[code] for code in token_role_codes(offsets, spans).tolist()]
