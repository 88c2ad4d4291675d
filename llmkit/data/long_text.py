"""Any text tokenized in bounded memory: ``tokenizers`` holds ≈ 200–400 bytes per character
of one call's text, so a long text is cut into pieces of :data:`CHUNK_CHARS`
(:func:`split_text`, never inside a special token, at points no usual pre-tokenizer spans)
and encoded at most :data:`BATCH_CHARS` at a time into one ``int32`` array
(:func:`encode_long`). Eval data, task fields, chat records and prompts go through it."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

#: The longest text handed to ``tokenizers`` in one piece (characters): a longer one is cut
#: (:func:`split_text`), so one piece costs at most ≈ 25 MB inside ``tokenizers``.
CHUNK_CHARS = 1 << 16
#: The most characters handed to ``tokenizers`` in one (parallel) batch call.
BATCH_CHARS = 8 * CHUNK_CHARS

#: Where :func:`split_text` cuts: before a space that follows a non-space, else before any
#: whitespace that follows a letter or digit. No piece of GPT-2's or Llama 3's byte-level
#: pre-tokenizer regex, of Metaspace (SentencePiece), WordPiece or a char tokenizer spans
#: such a point (a piece holding whitespace starts with it or is all whitespace; Llama 3's
#: punctuation takes the newlines after it, never a space), so the ids are those of one call.
_CUTS = (re.compile(r"(?<=\S) "), re.compile(r"(?<=[^\W_])\s"))


def split_text(
    text: str, chunk_chars: int = CHUNK_CHARS, keep: Sequence[str] = ()
) -> Iterator[str]:
    """``text`` as consecutive pieces of at most ``chunk_chars`` characters (all of it,
    nothing for an empty text). Each piece but the last ends in its second half right
    before a space after a non-space, else before whitespace after a letter or digit (see
    ``_CUTS``); a piece with neither is cut where it runs out, off a combining mark and
    ``\r\n``. No cut falls inside one of ``keep`` (the special tokens' texts)."""
    if chunk_chars < 2:
        raise ValueError(f"chunk_chars must be at least 2, got {chunk_chars}")
    start, n = 0, len(text)
    while n - start > chunk_chars:
        end = start + chunk_chars
        cut = _soft_cut(text, start + chunk_chars // 2, end) or _hard_cut(text, start, end)
        cut = _clear_of(text, cut, start, keep)
        yield text[start:cut]
        start = cut
    if start < n:
        yield text[start:]


def _soft_cut(text: str, lo: int, hi: int) -> int | None:
    """The last cut point of ``_CUTS`` (the first pattern that has one) in ``[lo, hi)``,
    searched back from ``hi`` in growing windows."""
    for pattern in _CUTS:
        top, width = hi, 512
        while top > lo:
            bottom = max(lo, top - width)
            found = None
            for found in pattern.finditer(text, bottom, top):  # noqa: B007 (the last one)
                pass
            if found is not None:
                return found.start()
            top, width = bottom, width * 8
    return None


def _hard_cut(text: str, start: int, end: int) -> int:
    cut = end
    while (
        cut > start + 1
        and cut > end - 32
        and (unicodedata.category(text[cut])[0] == "M" or text[cut - 1 : cut + 1] == "\r\n")
    ):
        cut -= 1
    return cut


def _clear_of(text: str, cut: int, start: int, keep: Sequence[str]) -> int:
    """``cut`` moved before (or, at ``start``, after) any of ``keep`` it falls inside."""
    for token in sorted((t for t in keep if len(t) > 1), key=len, reverse=True):
        i = text.find(token, max(start, cut - len(token) + 1), cut + len(token) - 1)
        if i != -1 and i < cut:
            cut = i if i > start else i + len(token)
    return cut


def encode_long(tokenizer: Any, text: str, chunk_chars: int = CHUNK_CHARS) -> np.ndarray:
    """The token ids of ``text`` as an ``int32`` array, in bounded memory whatever its
    length: cut by :func:`split_text` (never inside a special token), encoded at most
    :data:`BATCH_CHARS` characters per ``encode_batch`` call (a char tokenizer's by its
    :class:`CharTable`), the pieces' ids joined. For llmkit's tokenizers (byte-level BPE,
    char) and the usual imported pre-tokenizers the ids equal one ``encode`` call's
    (tests/data/test_bounded_tokenize.py); a tokenizer that looks past whitespace (one
    without a pre-tokenizer, a ``Prepend`` normalizer) may differ at a cut. ``tokenizer``:
    a :class:`Tokenizer`, or anything with ``encode`` (and maybe ``encode_batch``)."""
    import numpy as np

    if len(text) <= chunk_chars:
        return np.asarray(tokenizer.encode(text), dtype=np.int32)
    added = getattr(tokenizer, "added_texts", None)
    table = tokenizer.char_table() if hasattr(tokenizer, "char_table") else None
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is None:

        def batch(texts: list[str]) -> list[list[int]]:
            return [tokenizer.encode(t) for t in texts]

    parts: list[np.ndarray] = []
    group: list[str] = []
    size = 0

    def flush() -> None:
        parts.extend(np.asarray(ids, dtype=np.int32) for ids in batch(group))
        group.clear()

    for piece in split_text(text, chunk_chars, added() if added else ()):
        fast = table.encode(piece) if table is not None else None
        if fast is not None:
            if group:
                flush()
            parts.append(fast.astype(np.int32, copy=False))
            continue
        if group and size + len(piece) > BATCH_CHARS:
            flush()
            size = 0
        group.append(piece)
        size += len(piece)
    if group:
        flush()
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)
