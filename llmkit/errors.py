"""User-facing errors: the CLI prints them as one line and exits 2."""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    from pydantic import ValidationError


class LlmkitError(Exception):
    """An error a user can cause and fix (bad spec, unknown component, missing file)."""


class SpecError(LlmkitError):
    """A spec that failed validation; carries every problem found, each with its path."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        where = f"{source}: " if source else ""
        if len(self.problems) == 1:
            msg = f"{where}{self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            msg = f"{where}{len(self.problems)} problems\n{lines}"
        super().__init__(msg)


class RegistryError(LlmkitError):
    """An unknown or conflicting component."""


class PluginError(LlmkitError):
    """A plugin that failed to import or to register."""


def first_line(
    source: BaseException | str, *, limit: int | None = None, typed: bool = False
) -> str:
    """The first non-empty line of a text or an exception's message, for one-line errors that
    quote a library's.

    An exception without a message gives its type's name (a text without one gives ``""``);
    ``typed`` puts the type's name first (``"KeyError: 'x'"``, or ``"KeyError"`` alone).
    ``limit`` cuts the line to that many characters, the last one ``…``."""
    text = str(source).strip()
    line = text.splitlines()[0] if text else ""
    if isinstance(source, BaseException):
        name = type(source).__name__
        line = (f"{name}: {line}" if line else name) if typed else (line or name)
    if limit is not None and len(line) > limit:
        line = line[: limit - 1] + "…"
    return line


def location(loc: Sequence[Any], *, quote_dotted: bool = False) -> str:
    """A pydantic error location as a spec path: ``model.layers[0].name``; with
    ``quote_dotted`` a key holding a dot is quoted, ``axes["optimizer.lr"].num``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif quote_dotted and "." in str(part):
            out += f"[{json.dumps(str(part))}]"
        else:
            out += f".{part}" if out else str(part)
    return out


@overload
def validation_problems(
    exc: ValidationError,
    *,
    prefix: Sequence[Any] = ...,
    top: str | None = ...,
    quote_dotted: bool = ...,
    shown: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = ...,
    allowed: Callable[[tuple[Any, ...]], list[str]] | None = ...,
    what: str = ...,
    sep: None = ...,
) -> list[str]: ...
@overload
def validation_problems(
    exc: ValidationError,
    *,
    prefix: Sequence[Any] = ...,
    top: str | None = ...,
    quote_dotted: bool = ...,
    shown: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = ...,
    allowed: Callable[[tuple[Any, ...]], list[str]] | None = ...,
    what: str = ...,
    sep: str,
) -> str: ...
def validation_problems(
    exc: ValidationError,
    *,
    prefix: Sequence[Any] = (),
    top: str | None = "(top level)",
    quote_dotted: bool = False,
    shown: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None,
    allowed: Callable[[tuple[Any, ...]], list[str]] | None = None,
    what: str = "key",
    sep: str | None = None,
) -> list[str] | str:
    """A pydantic ``ValidationError`` as one ``path: message`` line per problem (the list), or
    those lines joined by ``sep`` into one.

    The path is :func:`location` of ``prefix`` + the error's location (``shown`` may first
    rewrite the location, e.g. drop the tag pydantic adds for a tagged union); an error at no
    location is ``top: message``, or the bare message when ``top`` is None. Pydantic's
    ``"Value error, "`` is dropped. Given ``allowed`` (the keys accepted where an unknown key
    sits, from the error's own location), an unknown key reads ``unknown {what}; did you mean
    'x'? (allowed: ...)`` instead of pydantic's ``Extra inputs are not permitted``."""
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = location((*prefix, *(shown(loc) if shown else loc)), quote_dotted=quote_dotted)
        msg = err["msg"].removeprefix("Value error, ")
        if allowed is not None and err["type"] == "extra_forbidden" and loc:
            keys = allowed(loc)
            close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            opts = f" (allowed: {', '.join(keys)})" if keys else " (it takes no options)"
            msg = f"unknown {what}{hint}{opts}"
        path = path or top or ""
        problems.append(f"{path}: {msg}" if path else msg)
    return problems if sep is None else sep.join(problems)


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` reports a full disk or quota: an ``OSError`` with ENOSPC/EDQUOT, or a
    library's error quoting one (safetensors: "No space left on device (os error 28)";
    pyarrow's write errors)."""
    import errno

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return any(m in text for m in ("No space left on device", "os error 28", "quota exceeded"))


def mount_point(path: str | os.PathLike[str]) -> Path:
    """The mount point of the file system holding ``path`` (or its nearest existing parent)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def no_space_message(path: str | os.PathLike[str]) -> str:
    """``no space left on device writing PATH (the disk mounted at M is full)``."""
    return (
        f"no space left on device writing {path} (the disk mounted at {mount_point(path)} is full)"
    )
