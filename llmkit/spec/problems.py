"""Turning pydantic errors into one line per problem, each with its full spec path."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _fields_at(model: Any, loc: tuple[Any, ...]) -> list[str]:
    """Field names of the pydantic model found at ``loc`` below ``model``."""
    import typing

    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        ann = fields[part].annotation
        candidates = [ann, *typing.get_args(ann)]
        nxt = None
        for c in candidates:
            for inner in [c, *typing.get_args(c)]:
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    nxt = inner
        if nxt is None:
            return []
        current = nxt
    return list(getattr(current, "model_fields", {}))


def _pydantic_problems(
    exc: ValidationError, prefix: tuple[Any, ...], model: Any, what: str = ""
) -> list[str]:
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = _path(prefix + loc)
        if err["type"] == "extra_forbidden":
            allowed = _fields_at(model, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            opts = f" (allowed: {', '.join(allowed)})" if allowed else " (it takes no options)"
            problems.append(f"{path}: unknown {what or 'key'}{hint}{opts}")
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            problems.append(f"{path}: {msg}")
    return problems
