"""The OpenAI API's bodies as the server reads and writes them: requests validated with
pydantic (a wrong field is a 400 naming it), responses and stream chunks built from the
engine's events, and the API's error schema."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmkit.serving.sequences import MAX_LOGPROBS, Token

log = logging.getLogger("llmkit.serving")

#: Bounds on what one request may ask for, beyond the body's size: each generated token is
#: checked against every stop string (the OpenAI API takes 4), and each biased token is
#: added to every step's logits (the OpenAI API takes 300).
MAX_STOPS, MAX_STOP_CHARS, MAX_BIASED = 16, 256, 1024


class ApiError(Exception):
    """An error the API returns: an HTTP status and the OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints take (llmkit's extensions, as vLLM's: top_k, min_p,
    repetition_penalty, ignore_eos). Strict: ``"yes"`` is no bool, ``true`` no token id."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOPS)
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_BIASED)
    ignore_eos: bool = False
    user: str | None = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for s in stops:
            if len(s) > MAX_STOP_CHARS:
                raise ApiError(
                    400, f"stop: a stop string is over {MAX_STOP_CHARS} characters", param="stop"
                )
        return stops

    def bias(self) -> tuple[tuple[int, float], ...]:
        out = []
        for key, value in (self.logit_bias or {}).items():
            try:
                out.append((int(key), float(value)))
            except ValueError:
                raise ApiError(
                    400, f"logit_bias: {key!r} is not a token id", param="logit_bias"
                ) from None
        return tuple(out)

    def top_k_or_none(self) -> int | None:
        """top_k, where 0 and -1 (vLLM's "off") mean no top-k filter."""
        if self.top_k is None or self.top_k in (0, -1):
            return None
        if self.top_k < 1:
            raise ApiError(
                400, f"top_k must be ≥ 1 (or 0/-1: off), got {self.top_k}", param="top_k"
            )
        return self.top_k


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None


#: The names pydantic gives a union's members in an error's location.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_name(part: str | int) -> bool:
    """A field name or list index in an error's location (a union member's type is not)."""
    if isinstance(part, int):
        return True
    return part.replace("_", "").isalnum() and part.islower() and part not in _TYPE_TAGS


def parse(model: type[BaseModel], data: Any) -> Any:
    """``data`` (parsed JSON) as ``model``; a 400 naming the first wrong field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        parts: list[str] = []
        for part in err["loc"]:  # field names and list indexes, not a union member's type
            if not _is_name(part):
                break
            parts.append(str(part))
        where = ".".join(parts) or "body"
        message = err["msg"] if len(parts) == len(err["loc"]) else "not any accepted form"
        raise ApiError(400, f"{where}: {message}", param=where) from None
    if body.model_extra:  # as vLLM: fields of other servers' dialects are ignored, and said
        log.warning("serving: ignoring unknown fields %s", ", ".join(sorted(body.model_extra)))
    return body


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class TokenText:
    """Token ids as the API's logprobs show them: each token's own text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token: int) -> str:
        if self.tokenizer is None:
            return f"<{token}>"
        return self.tokenizer.decode([token])


def completion_logprobs(
    tokens: list[Token], text_of: TokenText, offset: int
) -> tuple[dict[str, Any], int]:
    """The legacy completions ``logprobs`` object of ``tokens``, their text offsets from
    ``offset``; also the offset after them."""
    out: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for t in tokens:
        piece = text_of(t.id)
        out["tokens"].append(piece)
        out["token_logprobs"].append(t.logprob)
        top = None
        if t.top is not None:
            top = {}
            for tid, lp in t.top:
                top.setdefault(text_of(tid), lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(piece)
    return out, offset


def chat_logprobs(tokens: list[Token], text_of: TokenText) -> list[dict[str, Any]]:
    """The chat ``logprobs.content`` entries of ``tokens``."""

    def entry(token: int, logprob: float | None) -> dict[str, Any]:
        piece = text_of(token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

    out = []
    for t in tokens:
        item = entry(t.id, t.logprob)
        item["top_logprobs"] = [entry(i, lp) for i, lp in (t.top or [])]
        out.append(item)
    return out
