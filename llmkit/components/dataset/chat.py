"""Instruction and chat data: JSON Lines files (or JSON arrays) of conversations, rendered
with a chat template and trained on the assistant's turns only.

A record is either ``{"prompt": ..., "response": ...}`` (optional ``"system"``) or
``{"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}``; other
keys are ignored. Each split is a dataset with a ``messages`` column (the conversation as
JSON), a ``where`` column (``file:line``, for errors) and a ``text`` column (the contents,
for the plain-text contract); :meth:`ChatSource.chat_format` tells the data pipeline how to
render, mask and tokenize them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmkit.components.dataset import FileSource, dataset_dict, seeded_split, text_dataset
from llmkit.components.dataset.options import CHATML as CHATML
from llmkit.components.dataset.options import PLAIN as PLAIN
from llmkit.components.dataset.options import TEMPLATES, ChatFormat
from llmkit.components.dataset.options import ChatOptions as Options
from llmkit.errors import LlmkitError
from llmkit.files import read_utf8
from llmkit.messages import check_messages, json_type

if TYPE_CHECKING:
    import datasets


class ChatSource(FileSource):
    """Conversations from JSON Lines files (one record per line) or JSON arrays of records;
    validation is ``val_paths`` or a seeded share of the records."""

    Options = Options

    def chat_format(self) -> ChatFormat:
        """The template, its tokens and the masking, for the data pipeline."""
        o = self.options
        base = TEMPLATES.get(o.template) or ChatFormat("custom", o.template)
        tokens = tuple(dict.fromkeys([*base.special_tokens, *o.special_tokens]))
        end = o.end_of_turn or base.end_of_turn
        return ChatFormat(base.name, base.template, tokens, end, o.mask_prompt)

    def splits(self, seed: int) -> datasets.DatasetDict:
        o = self.options
        train_files, val_files = self._files()
        train = _to_dataset([r for p in train_files for r in read_records(p)], train_files)
        if val_files is None:
            parts = seeded_split(train, o.val_fraction, seed, f"chat {train_files[0]}")
            how = f"{1 - o.val_fraction:g}/{o.val_fraction:g} split"
        else:
            val = _to_dataset([r for p in val_files for r in read_records(p)], val_files)
            parts = dataset_dict(train, val)
            how = "val_paths"
        n_files = len(train_files) + len(val_files or [])
        fmt = self.chat_format()
        self._summary = (
            f"chat: {n_files} file(s), {how}: {len(parts['train'])} train and "
            f"{len(parts['validation'])} validation conversations (template {fmt.name}"
            f"{', prompts masked' if fmt.mask_prompt else ''})"
        )
        return parts

    def describe(self) -> str:
        return self._summary or f"chat: {', '.join(self.options.paths)}"


def _to_dataset(records: list[tuple[str, list[dict[str, str]]]], files: list[Path]) -> Any:
    if not records:
        names = ", ".join(str(p) for p in files[:3])
        raise LlmkitError(f"data.source: no records in {names}")
    return text_dataset(
        {
            "text": ["\n".join(m["content"] for m in msgs) for _, msgs in records],
            "messages": [json.dumps(msgs, ensure_ascii=False) for _, msgs in records],
            "where": [where for where, _ in records],
        }
    )


def read_records(path: Path) -> list[tuple[str, list[dict[str, str]]]]:
    """``(where, messages)`` of each record of a JSON Lines file, or of a JSON file holding
    one array of records; a one-line error naming the file and line of a bad one."""
    text = read_utf8(path)
    if text.lstrip().startswith("["):  # one JSON array, unless it is JSON Lines of lists
        try:
            items = json.loads(text)
        except RecursionError:
            raise LlmkitError(f"{path}: not valid JSON (nested too deeply)") from None
        except json.JSONDecodeError as exc:
            if not _first_line_parses(text):
                raise LlmkitError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        else:
            return [
                (f"{path}: record {i}", to_messages(r, f"{path}: record {i}"))
                for i, r in enumerate(items)
            ]
    out = []
    # Lines end at "\n" only: U+2028 and friends (which str.splitlines also breaks at) are
    # legal, unescaped, inside JSON strings.
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except RecursionError:
            raise LlmkitError(f"{where}: not valid JSON (nested too deeply)") from None
        except json.JSONDecodeError as exc:
            raise LlmkitError(f"{where}: not valid JSON ({exc.msg})") from None
        out.append((where, to_messages(record, where)))
    return out


def _first_line_parses(text: str) -> bool:
    try:
        json.loads(text.lstrip().split("\n", 1)[0])
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


def to_messages(record: Any, where: str) -> list[dict[str, str]]:
    """A record's conversation as ``{"role", "content"}`` messages; a one-line error
    naming ``where`` and the field for a record in neither form, an unknown role, a
    non-string content, or a missing or empty assistant turn."""
    if not isinstance(record, dict):
        raise LlmkitError(f"{where}: a record must be a JSON object, got {json_type(record)}")
    chat, instruction = "messages" in record, "prompt" in record or "response" in record
    if chat and instruction:
        raise LlmkitError(f"{where}: a record has either 'messages' or 'prompt'/'response'")
    if chat:
        messages = check_messages(record["messages"], f"{where}: messages", training=True)
    elif instruction:
        messages = _instruction_messages(record, where)
    else:
        keys = ", ".join(map(repr, record)) or "none"
        raise LlmkitError(
            f"{where}: a record needs 'messages' (chat) or 'prompt' and 'response' "
            f"(instruction); its keys: {keys}"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise LlmkitError(f"{where}: messages: no assistant turn to train on")
    return messages


def _instruction_messages(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    for key in ("prompt", "response"):
        if key not in record:
            raise LlmkitError(f"{where}: {key}: missing (the instruction form needs both)")
    messages = []
    for key, role in (("system", "system"), ("prompt", "user"), ("response", "assistant")):
        value = record.get(key)
        if key == "system" and value is None:
            continue
        if not isinstance(value, str):
            raise LlmkitError(f"{where}: {key}: expected a string, got {json_type(value)}")
        if role == "assistant" and not value.strip():
            raise LlmkitError(f"{where}: response: empty assistant turn")
        messages.append({"role": role, "content": value})
    return messages
