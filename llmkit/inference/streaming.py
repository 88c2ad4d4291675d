"""Text as it is generated: incremental decoding of token ids, stop strings, and the
:class:`TextStream` a streamed generation returns."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from llmkit.inference.sampling import GenerationResult

if TYPE_CHECKING:
    from llmkit.inference.decode import Row


class TokenizerLike(Protocol):
    """What generation needs from a tokenizer (llmkit's, or anything shaped alike)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDecoder:
    """Turns a growing sequence of token ids into text deltas.

    Decodes a short window (the offsets of Hugging Face text-generation-inference): the
    text of ``ids[prefix:]`` minus the text of ``ids[prefix:read]``, so each step costs
    O(1) tokens. A byte-level BPE piece that ends inside a UTF-8 character decodes to
    U+FFFD; such a delta is held back until the character completes. The window starts
    with the last prompt tokens so tokenizers that treat the first token specially (a
    leading space) decode as they would in context.
    """

    CONTEXT = 4  # prompt tokens kept as decoding context

    def __init__(self, tokenizer: TokenizerLike, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = [int(i) for i in prompt_ids[-self.CONTEXT :]]
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if ids else ""

    def push(self, token: int) -> str:
        """Add a token; return the text that became final (possibly empty)."""
        self.ids.append(int(token))
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]


class RowText:
    """The generated text of one row, with stop-string detection and safe streaming."""

    def __init__(
        self, tokenizer: TokenizerLike, prompt_ids: Sequence[int], stops: Sequence[str]
    ) -> None:
        self.decoder = IncrementalDecoder(tokenizer, prompt_ids)
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.stop_at: int | None = None  # index in text where a stop string starts
        self.sent = 0  # characters handed out by take()

    def push(self, token: int) -> bool:
        """Add a token; True when the text now contains a stop string."""
        delta = self.decoder.push(token)
        if delta:
            self._add(delta)
        return self.stop_at is not None

    def _add(self, delta: str) -> None:
        start = max(0, len(self.text) - self.longest + 1)
        self.text += delta
        if self.stops and self.stop_at is None:
            window = self.text[start:]
            hits = [i for i in (window.find(s) for s in self.stops) if i >= 0]
            if hits:
                self.stop_at = start + min(hits)

    def finish(self) -> None:
        if self.stop_at is None:
            rest = self.decoder.flush()
            if rest:
                self._add(rest)

    @property
    def final(self) -> str:
        return self.text if self.stop_at is None else self.text[: self.stop_at]

    def take(self, done: bool) -> str:
        """Text that can be shown now: never part of a stop string that may yet complete."""
        if self.stop_at is not None:
            end = self.stop_at
        elif done or not self.stops:
            end = len(self.text)
        else:
            end = len(self.text) - self._held(self.text)
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def _held(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        for n in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


class TextStream:
    """Iterate to receive the text of a generation as it is produced; afterwards
    ``result`` holds the :class:`GenerationResult`. Stop strings are never shown, not even
    in part."""

    def __init__(self, row: Row, steps: Iterator[None], tokenizer: TokenizerLike) -> None:
        self._row, self._steps, self._tokenizer = row, steps, tokenizer
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        row = self._row
        assert row.text is not None
        try:
            for _ in self._steps:
                piece = row.text.take(done=False)
                if piece:
                    yield piece
        finally:  # a loop left early ends the decoding now (the model's mode restored)
            self._steps.close()
        row.text.finish()
        piece = row.text.take(done=True)
        if piece:
            yield piece
        self.result = row.result(self._tokenizer)

    def text(self) -> str:
        """Run to the end and return the whole text."""
        return "".join(self)
