"""Conversation records: reading the messages of a chat dataset, and prompt/response pairs, as
(role, content) turns.

Two message styles are read, per message:

* OpenAI's ``{"role": ..., "content": ...}`` (LMSYS-Chat-1M, UltraChat, Tulu, most SFT sets), the
  content a string or a list of parts of which only ``{"type": "text", "text": ...}`` is taken
  (joined in order);
* ShareGPT's ``{"from": ..., "value": ...}`` with ``human``/``gpt``/``system`` (and the other names
  in ``ROLE_NAMES``).

Roles are mapped to ``system``, ``user``, ``assistant`` and ``tool`` (``ROLE_NAMES``); an unknown
role, a message without text, a part that is not text or an empty conversation rejects the
record with its reason. A message's other keys (``tool_calls``, ``name``) are not rendered: only
contents are.
"""

from __future__ import annotations

from typing import Any

from common.roles import ASSISTANT, SYSTEM, TOOL, USER
from transforms.rejections import RejectedRecord

MESSAGE_FIELDS = ("messages", "conversations")  # looked for, in this order, when not named
# A message's role as datasets write it -> its role here.
ROLE_NAMES = {
    "system": SYSTEM, "developer": SYSTEM,
    "user": USER, "human": USER,
    "assistant": ASSISTANT, "gpt": ASSISTANT, "model": ASSISTANT, "chatgpt": ASSISTANT, "bot": ASSISTANT,
    "tool": TOOL, "function": TOOL, "ipython": TOOL, "observation": TOOL,
}


def messages_field(record: Any, named: str | None) -> str | None:
    """The column holding a record's conversation: ``named``, else the first of
    ``MESSAGE_FIELDS`` the record has (None: it has none)."""
    if not isinstance(record, dict):
        return None
    if named is not None:
        return named if named in record else None
    return next((name for name in MESSAGE_FIELDS if name in record), None)


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or the text parts of a list, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RejectedRecord("non_text_content", f"{where} part {k} is {kind!r}, not text")
        return "".join(texts)
    raise RejectedRecord("missing_field", f"{where} has no text content")


def conversation(messages: Any) -> tuple[tuple[str, str], ...]:
    """(role, content) turns of a conversation column; ``RejectedRecord`` for an invalid one."""
    if not isinstance(messages, list) or not messages:
        raise RejectedRecord("empty_conversation", "the conversation is not a non-empty list of messages")
    turns = []
    for i, message in enumerate(messages):
        where = f"message {i}"
        if not isinstance(message, dict):
            raise RejectedRecord("missing_field", f"{where} is not an object")
        if "role" in message:
            name, content = message["role"], message.get("content")
        elif "from" in message:
            name, content = message["from"], message.get("value")
        else:
            raise RejectedRecord("missing_field", f"{where} has neither 'role' nor 'from'")
        role = ROLE_NAMES.get(name.lower()) if isinstance(name, str) else None
        if role is None:
            raise RejectedRecord("unknown_role", f"{where} has role {name!r} (known: {', '.join(ROLE_NAMES)})")
        turns.append((role, _text(content, where)))
    return tuple(turns)


def prompt_response(record: dict, prompt_field: str, response_field: str | None) -> tuple[tuple[str, str], ...]:
    """A prompt/response pair as a user turn and an assistant turn (the user turn alone without a
    ``response_field``)."""
    turns = []
    for field, role in ((prompt_field, USER), (response_field, ASSISTANT)):
        if field is None:
            continue
        value = record.get(field)
        if not isinstance(value, str):
            raise RejectedRecord("missing_field", f"record has no text in {field!r}")
        turns.append((role, value))
    if not turns[0][1].strip():
        raise RejectedRecord("empty_text", f"{prompt_field!r} is empty")
    return tuple(turns)
