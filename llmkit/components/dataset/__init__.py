"""Built-in corpus sources (kind ``dataset``).

A source is a class with an ``Options`` model, built as ``Source(options)``, with
``splits(seed) -> datasets.DatasetDict`` holding ``"train"`` and ``"validation"``, each with
a ``"text"`` string column (one document per row), and ``describe() -> str``, a one-line
summary. It may also define ``fingerprint() -> str``, which changes when its input files
change, so cached token files are never reused for edited data.

Splits are deterministic for a seed whatever order the filesystem lists files in. Modules
here import ``datasets`` lazily so that resolving a spec stays cheap; shared helpers live
in this file, and every source's options in :mod:`llmkit.components.dataset.options`.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmkit.components.dataset.options import FileSourceOptions as FileSourceOptions
from llmkit.components.dataset.options import TableSourceOptions as TableSourceOptions
from llmkit.errors import LlmkitError, first_line

if TYPE_CHECKING:
    import datasets

VALIDATION_NAMES = ("validation", "valid", "val", "test")
_GLOB_CHARS = set("*?[")


# -- files ----------------------------------------------------------------------------------


def resolve_paths(patterns: Sequence[str], what: str = "paths") -> list[Path]:
    """Files named by ``patterns`` (plain paths or globs), each glob's matches sorted, in
    pattern order, without duplicates. Missing files and empty globs are errors."""
    out: dict[Path, None] = {}
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if _GLOB_CHARS & set(expanded):
            matches = sorted(
                Path(m) for m in glob.glob(expanded, recursive=True) if Path(m).is_file()
            )
            if not matches:
                raise LlmkitError(f"data.source.{what}: {pattern!r} matches no file")
        else:
            p = Path(expanded)
            if p.is_dir():
                raise LlmkitError(
                    f"data.source.{what}: {pattern!r} is a directory; name files or use a glob "
                    f"such as '{pattern.rstrip('/')}/*.txt'"
                )
            if not p.is_file():
                raise LlmkitError(f"data.source.{what}: file not found: {pattern}")
            matches = [p]
        for m in matches:
            out.setdefault(m, None)
    return list(out)


def train_val_files(
    paths: Sequence[str], val_paths: Sequence[str] | None
) -> tuple[list[Path], list[Path] | None]:
    """Resolve ``paths`` and ``val_paths``; validation files are removed from the training
    files (so ``data/*.txt`` with ``val_paths = ["data/val.txt"]`` works)."""
    if not paths:
        raise LlmkitError("data.source.paths: name at least one file or glob pattern")
    val = resolve_paths(val_paths, "val_paths") if val_paths is not None else None
    train = resolve_paths(paths)
    if val is not None:
        taken = {p.resolve() for p in val}
        train = [p for p in train if p.resolve() not in taken]
        if not train:
            raise LlmkitError("data.source.paths: every file is also in val_paths")
    return train, val


#: Inputs up to this many bytes in all are fingerprinted by content (:func:`files_fingerprint`).
CONTENT_FINGERPRINT_LIMIT = 64 << 20


def files_fingerprint(files: Iterable[Path]) -> str:
    """Changes when the files change. Up to :data:`CONTENT_FINGERPRINT_LIMIT` bytes in all: a
    BLAKE2b hash of each file's path as the source names it (not resolved) and its bytes, so
    a copy of the corpus (another checkout, another machine, a new modification time) keys
    the same and a same-size edit that kept the time does not. Larger inputs: each file's
    resolved path, size and modification time (reading them all would cost more)."""
    files = list(files)
    stats = [p.stat() for p in files]
    if sum(st.st_size for st in stats) <= CONTENT_FINGERPRINT_LIMIT:
        h = hashlib.blake2b(digest_size=8)
        for p in files:
            data = p.read_bytes()
            h.update(f"{p}\0{len(data)}\0".encode())
            h.update(data)
        return "b2-" + h.hexdigest()
    h = hashlib.sha256()
    for p, st in zip(files, stats):
        h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def unit_hash(seed: int, key: str, salt: str = "split") -> float:
    """A number in [0, 1) fixed by (seed, key, salt) alone."""
    digest = hashlib.sha256(f"{salt}\0{seed}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_by_hash(keys: Sequence[str], seed: int, val_fraction: float) -> list[bool]:
    """For each key, whether it goes to validation: ``unit_hash < val_fraction``, so a key's
    split does not depend on the other keys. With two keys or more, neither split is left
    empty: the lowest-hash key goes to validation (or the highest to train) if needed."""
    u = [unit_hash(seed, k) for k in keys]
    is_val = [x < val_fraction for x in u]
    if len(keys) >= 2:
        if not any(is_val):
            is_val[min(range(len(u)), key=u.__getitem__)] = True
        if all(is_val):
            is_val[max(range(len(u)), key=u.__getitem__)] = False
    return is_val


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


# -- datasets -------------------------------------------------------------------------------


def text_dataset(columns: dict[str, list[Any]]) -> datasets.Dataset:
    """An in-memory dataset from columns (``text`` first)."""
    import datasets

    features = datasets.Features({k: datasets.Value("string") for k in columns})
    return datasets.Dataset.from_dict(columns, features=features)


def dataset_dict(train: datasets.Dataset, validation: datasets.Dataset) -> datasets.DatasetDict:
    import datasets

    return datasets.DatasetDict({"train": train, "validation": validation})


def select_text(ds: datasets.Dataset, field: str, where: str) -> datasets.Dataset:
    """Keep only ``field``, renamed ``text``; clear errors if it is missing or not text."""
    if field not in ds.column_names:
        have = ", ".join(ds.column_names) or "none"
        raise LlmkitError(f"{where}: no text field {field!r} (fields: {have}); set text_field")
    feature = ds.features[field]
    dtype = getattr(feature, "dtype", None)
    if dtype not in ("string", "large_string"):
        raise LlmkitError(f"{where}: field {field!r} holds {feature}, not text")
    ds = ds.select_columns([field])
    return ds.rename_column(field, "text") if field != "text" else ds


def seeded_split(
    ds: datasets.Dataset, val_fraction: float, seed: int, where: str
) -> datasets.DatasetDict:
    """Rows split at random, seeded: ``val_fraction`` of them (at least one, rounded up) to
    validation, the rest to train."""
    if len(ds) < 2:
        raise LlmkitError(
            f"{where}: {len(ds)} document(s) cannot be split into train and validation; "
            "add documents or give val_paths"
        )
    import math

    import numpy as np

    n = len(ds)
    n_val = min(max(1, math.ceil(n * val_fraction)), n - 1)
    perm = np.random.default_rng(seed % 2**63).permutation(n)
    # Rows keep their file order within each split (sequential reads); the indices stay in
    # memory, so nothing is written next to the source's own files.
    val_idx, train_idx = np.sort(perm[:n_val]), np.sort(perm[n_val:])
    return dataset_dict(
        ds.select(train_idx, keep_in_memory=True), ds.select(val_idx, keep_in_memory=True)
    )


def hf_load(
    builder: str, train: list[Path], val: list[Path] | None, cache_dir: str | None
) -> dict[str, datasets.Dataset]:
    """``datasets.load_dataset(builder)`` over local files: ``{"train": ..., "validation":
    ...}`` (no validation without ``val``). A file that fails to parse is named."""
    import datasets

    files = {"train": [str(p) for p in train]}
    if val is not None:
        files["validation"] = [str(p) for p in val]
    try:
        loaded = datasets.load_dataset(builder, data_files=files, cache_dir=cache_dir)
    except Exception as exc:
        bad, reason = _find_bad_file(builder, [*train, *(val or [])], cache_dir, exc)
        raise LlmkitError(f"{bad}: cannot read as {builder}: {reason}") from exc
    return dict(loaded)


def _find_bad_file(
    builder: str, files: list[Path], cache_dir: str | None, exc: BaseException
) -> tuple[str, str]:
    import datasets

    for p in files:
        try:
            datasets.load_dataset(builder, data_files=[str(p)], split="train", cache_dir=cache_dir)
        except Exception as one:
            return str(p), _reason(one)
    return ", ".join(str(p) for p in files), _reason(exc)


def _reason(exc: BaseException) -> str:
    while exc.__cause__ is not None and "error occurred while generating" in str(exc):
        exc = exc.__cause__
    return first_line(exc)


# -- sources read through datasets.load_dataset ------------------------------------------------


class FileSource:
    """Base of sources reading local files: ``paths`` (and optional ``val_paths``)."""

    def __init__(self, options: FileSourceOptions) -> None:
        self.options = options
        self._summary: str | None = None

    #: The streaming reader's format for these files ("" = not streamable).
    stream_format = ""

    def _files(self) -> tuple[list[Path], list[Path] | None]:
        return train_val_files(self.options.paths, self.options.val_paths)

    def stream_inputs(self) -> dict[str, Any] | None:
        """What ``data.streaming`` reads instead of :meth:`splits`: the format, the training
        and validation files, the text field and the share held out for validation when
        there are no validation files (None: this source cannot be streamed)."""
        if not self.stream_format:
            return None
        train, val = self._files()
        return {
            "format": self.stream_format,
            "train": [str(p) for p in train],
            "validation": None if val is None else [str(p) for p in val],
            "text_field": getattr(self.options, "text_field", "text"),
            "val_fraction": float(getattr(self.options, "val_fraction", 0.0) or 0.0),
        }

    def fingerprint(self) -> str:
        """Changes when any input file changes (:func:`files_fingerprint`)."""
        train, val = self._files()
        return files_fingerprint([*train, *(val or [])])


class TableSource(FileSource):
    """Local files loaded with ``datasets.load_dataset(builder, data_files=...)``, one
    document per row; validation is ``val_paths`` or a seeded share of the rows."""

    builder = ""  # "json", "parquet", ...
    label = ""
    Options = TableSourceOptions

    def splits(self, seed: int) -> datasets.DatasetDict:
        o = self.options
        train_files, val_files = self._files()
        loaded = hf_load(self.builder, train_files, val_files, o.cache_dir)
        where = f"{self.label} {', '.join(str(p) for p in train_files[:2])}"
        train = select_text(loaded["train"], o.text_field, where)
        if val_files is None:
            parts = seeded_split(train, o.val_fraction, seed, where)
        else:
            vwhere = f"{self.label} {', '.join(str(p) for p in val_files[:2])}"
            val = select_text(loaded["validation"], o.text_field, vwhere)
            parts = dataset_dict(train, val)
        for name, ds in parts.items():
            if len(ds) == 0:
                raise LlmkitError(f"{where}: the {name} split has no documents")
        n_files = len(train_files) + len(val_files or [])
        self._summary = (
            f"{self.label}: {n_files} file(s), {len(parts['train'])} train docs, "
            f"{len(parts['validation'])} validation docs (field {o.text_field!r})"
        )
        return parts

    def describe(self) -> str:
        return self._summary or f"{self.label}: {', '.join(self.options.paths)}"
