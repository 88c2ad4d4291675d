"""What import may read of a local checkpoint directory: files inside it, JSON within bounds.

A Hugging Face checkpoint is untrusted input. Every file import reads, by its fixed name
(``config.json``), or by a name a file of the checkpoint gives (a shard of
``model.safetensors.index.json``), must resolve, links followed, to a path inside the
checkpoint directory (:func:`inside`); the one exception is a Hugging Face cache snapshot
(``…/models--org--name/snapshots/REV``), whose files are links into the repository's
``blobs`` directory, which they may reach. An absolute name, a ``..`` or a link leading
anywhere else is a one-line error naming the entry, before anything is read from it.

JSON files are read whole only up to :data:`MAX_JSON_BYTES` and may nest at most
:data:`MAX_JSON_DEPTH` levels (a real config nests 4 or 5): a deeper value would reach
recursion limits later, in a copy, a dump or a validation, as a traceback.

No torch here: the tokenizer side uses it too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmkit.errors import LlmkitError
from llmkit.files import parse_json, read_utf8

#: The largest JSON file of a checkpoint read (configs, shard indexes, tokenizer configs).
MAX_JSON_BYTES = 64 << 20
#: The deepest nesting accepted in those files.
MAX_JSON_DEPTH = 64
#: A Hugging Face cache snapshot's directory, inside the repository's directory.
SNAPSHOTS, BLOBS = "snapshots", "blobs"
#: Subdirectories ``transformers`` reads of a tokenizer directory.
TOKENIZER_SUBDIRS = ("additional_chat_templates",)


def _roots(root: Path) -> tuple[Path, ...]:
    """Where the files of the (resolved) checkpoint directory ``root`` may lead: itself,
    and for a cache snapshot the repository's ``blobs``."""
    blobs = root.parent.parent / BLOBS
    if root.parent.name == SNAPSHOTS and blobs.is_dir():
        return root, blobs.resolve()
    return (root,)


def inside(hf_dir: Path, name: Any, what: str | None = None) -> Path:
    """The real path of the file ``name`` of the checkpoint directory ``hf_dir`` (links
    followed); a one-line error naming it (``what``: where the name came from) when it is
    not a relative path, or leads outside the directory through ``..`` or a link."""
    where = f"{what}: {name!r}" if what else f"{Path(hf_dir) / str(name)}"
    if not isinstance(name, str) or not name:
        raise LlmkitError(f"{where} is not a file name")
    if os.path.isabs(name) or Path(name).drive or Path(name).root:
        raise LlmkitError(f"{where} is an absolute path; refusing to read it")
    try:
        root = Path(hf_dir).resolve()
        real = (root / name).resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # a link loop, a NUL byte
        raise LlmkitError(f"{where} cannot be resolved ({exc})") from exc
    if not any(real == r or real.is_relative_to(r) for r in _roots(root)):
        raise LlmkitError(
            f"{where} leads outside the checkpoint directory {hf_dir} (to {real}); "
            "refusing to read it"
        )
    return real


def check_tree(hf_dir: Path) -> None:
    """Every entry of the checkpoint directory (and of the subdirectories ``transformers``
    reads) stays inside it: before a library that opens files by itself is given it."""
    hf_dir = Path(hf_dir)
    dirs = [hf_dir, *(hf_dir / d for d in TOKENIZER_SUBDIRS if (hf_dir / d).is_dir())]
    for d in dirs:
        inside(hf_dir, os.path.relpath(d, hf_dir))
        for entry in sorted(os.listdir(d)):
            inside(hf_dir, os.path.relpath(d / entry, hf_dir))


def depth(value: Any) -> int:
    """How deeply a parsed JSON value nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if level > MAX_JSON_DEPTH:
            return level
        stack.extend((c, level + 1) for c in children)
    return deepest


def parse_bounded(text: str, where: str) -> Any:
    """``text`` as JSON nested at most :data:`MAX_JSON_DEPTH` levels; one-line errors."""
    data = parse_json(text, where)
    if depth(data) > MAX_JSON_DEPTH:
        raise LlmkitError(f"{where}: nested more than {MAX_JSON_DEPTH} levels deep")
    return data


def read_json(path: Path, real: Path | None = None) -> Any:
    """The JSON value of the file ``path`` (read at ``real``, its resolved path, when
    given): at most :data:`MAX_JSON_BYTES`, UTF-8, :func:`parse_bounded`."""
    source = real or path
    try:
        size = source.stat().st_size
    except OSError as exc:
        raise LlmkitError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    if size > MAX_JSON_BYTES:
        raise LlmkitError(f"{path}: {size:,} bytes, more than the {MAX_JSON_BYTES:,} read")
    text = read_utf8(source)
    return parse_bounded(text, str(path))


def read_object(path: Path, real: Path | None = None) -> dict[str, Any] | None:
    """:func:`read_json` of a file that must hold an object; None when there is no file."""
    if not (real or path).is_file():
        return None
    data = read_json(path, real)
    if not isinstance(data, dict):
        raise LlmkitError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def checkpoint_object(hf_dir: Path, name: str) -> dict[str, Any] | None:
    """The JSON object of the checkpoint's file ``name`` (:func:`inside` it); None when
    the directory has no such file."""
    path = Path(hf_dir) / name
    return read_object(path, inside(hf_dir, name))
