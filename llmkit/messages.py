"""The chat message contract: a conversation is a list of ``{"role", "content"}`` messages,
each role one of :data:`ROLES` and each content a string.

Shared by the chat dataset component (training records), the tokenizer's chat rendering and
the data pipeline; templates and prompt/response cutting live in :mod:`llmkit.data.chat`.
Nothing here imports torch or the components.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmkit.errors import LlmkitError

#: The roles a message may have.
ROLES = ("system", "user", "assistant")


def check_messages(
    items: Any, what: str = "messages", *, training: bool = False
) -> list[dict[str, str]]:
    """``items`` as a list of ``{"role", "content"}`` dicts; a one-line error naming the
    first bad entry (``what`` says where). Training data (``training``) may hold no empty
    list and no empty assistant turn."""
    if not isinstance(items, list | tuple) or (training and not items):
        kind = "a non-empty list" if training else "a list"
        raise LlmkitError(f"{what}: expected {kind} of messages, got {json_type(items)}")
    messages = []
    for i, m in enumerate(items):
        at = f"{what}[{i}]"
        if not isinstance(m, Mapping):
            raise LlmkitError(f"{at}: expected an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise LlmkitError(f"{at}.role: unknown role {role!r} ({', '.join(ROLES)})")
        if not isinstance(content, str):
            raise LlmkitError(f"{at}.content: expected a string, got {json_type(content)}")
        if training and role == "assistant" and not content.strip():
            raise LlmkitError(f"{at}.content: empty assistant turn")
        messages.append({"role": role, "content": content})
    return messages


def json_type(value: Any) -> str:
    """What a parsed JSON value is, for errors: "an object", "a list", "null", ..."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)
