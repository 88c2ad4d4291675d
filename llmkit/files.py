"""Files written whole or not at all, full disks as one-line errors, text files read as
UTF-8 (:func:`read_utf8`), and llmkit's cache directory.

A file is written under a temporary name beside its target (``.NAME.PID.tmp``: two processes
writing the same target never share one) and renamed over it with ``os.replace``, so a
reader sees the old file or the new one, never part of either, and a crash leaves the old
file. Nothing here imports torch: the bottom layer (``hardware``, ``data``) uses it too.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from llmkit.errors import LlmkitError, no_space, no_space_message

#: Environment variable naming llmkit's cache directory (the data store, built kernels).
CACHE_ENV = "LLMKIT_CACHE_DIR"


def store_root() -> Path:
    """llmkit's cache directory: ``$LLMKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/llmkit``, else
    ``~/.cache/llmkit`` (layout: :mod:`llmkit.data.store`)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "llmkit"


class NoSpaceLeft(LlmkitError):
    """A write failed because the disk (or the user's quota) is full."""


@contextlib.contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn a full-disk error raised in the body into :class:`NoSpaceLeft` naming ``path``."""
    try:
        yield
    except NoSpaceLeft:
        raise
    except Exception as exc:
        if not no_space(exc):
            raise
        raise NoSpaceLeft(no_space_message(path)) from exc


def temporary_name(path: Path, suffix: str = "") -> Path:
    """``.NAME.PID.tmp`` beside ``path``, then ``suffix`` (a plot's ``.png`` keeps its
    format)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp{suffix}")


@contextlib.contextmanager
def replacing_all(paths: Sequence[Path], suffix: str = "") -> Iterator[list[Path]]:
    """Temporary paths for the body to write, one beside each of ``paths``; when the body
    returns, each replaces its target in order (the last one is the one readers check
    first, e.g. a sidecar). Whatever happens, no temporary file is left behind."""
    tmps = [temporary_name(Path(p), suffix) for p in paths]
    try:
        yield tmps
        for tmp, path in zip(tmps, paths, strict=True):
            os.replace(tmp, path)
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def replacing(path: Path, suffix: str = "") -> Iterator[Path]:
    """:func:`replacing_all` of one file: the body writes the yielded temporary path."""
    with replacing_all([path], suffix) as (tmp,):
        yield tmp


def write_text_atomic(path: Path, text: str) -> None:
    """Write UTF-8 text under a temporary name, then rename (readers never see half a
    file); :class:`NoSpaceLeft` on a full disk (the temporary file removed)."""
    with replacing(path) as tmp, writing(path):
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: Path, data: Any) -> None:
    """:func:`write_text_atomic` of ``data`` as indented JSON."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def read_utf8(path: Path) -> str:
    """A file's text; a clear error if it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise LlmkitError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise LlmkitError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def parse_json(text: str, where: str) -> Any:
    """``text`` parsed as JSON; a one-line error naming ``where`` (a file, or a file and
    line) if it is not JSON or nests too deeply to parse (a RecursionError otherwise)."""
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise LlmkitError(f"{where}: invalid JSON: nested too deeply") from exc
    except ValueError as exc:
        raise LlmkitError(f"{where}: invalid JSON: {exc}") from exc


def read_json(path: Path) -> Any:
    """A JSON file's value: :func:`read_utf8`, then :func:`parse_json`."""
    return parse_json(read_utf8(path), str(path))
