"""Flat token files: ``<split>-<key>.bin`` (uint16 or uint32 ids) beside a JSON sidecar.

Data with a loss mask (chat data) has two more files beside the ids, named alike:
``<split>-<key>.mask`` (one ``uint8`` per token: 1 where the token is a trained target) and
``<split>-<key>.docs`` (``int64`` offsets of the documents, ``documents + 1`` of them, from 0
to the number of tokens). Plain text has neither.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.errors import LlmkitError, no_space, no_space_message
from llmkit.files import replacing_all

#: Bumped when the token-file layout changes, so older caches are not reused.
FORMAT_VERSION = 1
MASK_SUFFIX = ".mask"
DOCS_SUFFIX = ".docs"


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab ≤ 65535), else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


class TokenFile:
    """A flat file of token ids, memory-mapped read-only, with its JSON sidecar
    (``tokens``, ``dtype``, ``documents``, ``n_bytes_text``: UTF-8 bytes of the text it
    came from, for loss per byte; ``mask``: true when a loss mask and document offsets lie
    beside it). ``layout`` says how batches are cut from it: ``"packed"`` blocks or
    ``"padded"`` rows of one document each (set by :func:`~llmkit.data.prepare_data` from
    ``data.sampling``)."""

    layout: str = "packed"

    def __init__(self, path: str | Path, dtype: str | np.dtype | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise LlmkitError(f"token file not found: {self.path}")
        side = sidecar(self.path)
        self.meta: dict[str, Any] = json.loads(side.read_text()) if side.is_file() else {}
        self.dtype = np.dtype(dtype or self.meta.get("dtype") or np.uint16)
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise LlmkitError(f"{self.path}: size {size} is not a multiple of {self.dtype}")
        self._n = size // self.dtype.itemsize
        self._array: np.ndarray | None = None
        self._mask: np.ndarray | None = None
        self._docs: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        """The ids, as a read-only ``np.memmap`` (opened on first use)."""
        if self._array is None:
            if self._n == 0:
                self._array = np.zeros(0, self.dtype)
            else:
                self._array = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._array

    @property
    def has_mask(self) -> bool:
        """Whether a loss mask lies beside the ids."""
        return bool(self.meta.get("mask"))

    @property
    def mask(self) -> np.ndarray | None:
        """1 where a token is a trained target, 0 where not (``uint8``, memory-mapped), or
        None for data without a mask (every target trained)."""
        if not self.has_mask:
            return None
        if self._mask is None:
            self._mask = self._side_array(MASK_SUFFIX, np.dtype(np.uint8), self._n)
        return self._mask

    @property
    def doc_bounds(self) -> np.ndarray | None:
        """Offsets of the documents (``documents + 1`` of them, 0 first, the token count
        last), or None for data without them."""
        if not self.has_mask:
            return None
        if self._docs is None:
            n = int(self.meta.get("documents") or 0) + 1
            self._docs = self._side_array(DOCS_SUFFIX, np.dtype(np.int64), n)
        return self._docs

    def _side_array(self, suffix: str, dtype: np.dtype, n: int) -> np.ndarray:
        path = self.path.with_suffix(suffix)
        if not path.is_file() or path.stat().st_size != n * dtype.itemsize:
            raise LlmkitError(f"{path}: missing or not {n} {dtype} values; delete {self.path}")
        if n == 0:
            return np.zeros(0, dtype)
        return np.memmap(path, dtype=dtype, mode="r")

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        return self.array[index]

    @property
    def n_bytes_text(self) -> int | None:
        """UTF-8 bytes of the split's text, if recorded."""
        n = self.meta.get("n_bytes_text")
        return int(n) if n is not None else None

    @property
    def n_documents(self) -> int | None:
        n = self.meta.get("documents")
        return int(n) if n is not None else None

    @property
    def bytes_per_token(self) -> float | None:
        """Text bytes per token (EOS tokens included), to turn loss/token into loss/byte."""
        n = self.n_bytes_text
        return n / self._n if n is not None and self._n else None

    def __getstate__(self) -> dict[str, Any]:  # picklable for DataLoader workers
        return {**self.__dict__, "_array": None, "_mask": None, "_docs": None}

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, {self._n} tokens, {self.dtype})"


def sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def _write(f: Any, arr: np.ndarray, dtype: np.dtype) -> None:
    """Write ``arr`` as ``dtype`` through the file object, whose errors keep their errno
    (``ndarray.tofile`` reports a full disk as "N requested and M written")."""
    f.write(np.ascontiguousarray(arr.astype(dtype, copy=False)).tobytes())


def raise_if_full(exc: OSError, path: Path) -> None:
    """A full disk or quota as one line naming the file and the disk (the partial files
    are removed by the caller)."""
    if no_space(exc):
        raise LlmkitError(f"{no_space_message(path)}; the partial file was removed") from exc


def write_token_file(
    chunks: Iterable[np.ndarray], path: str | Path, dtype: np.dtype, meta: dict[str, Any]
) -> TokenFile:
    """Stream id arrays into ``path`` (a temp name, then renamed) and write its sidecar:
    ``meta`` (read after ``chunks`` is exhausted) plus ``tokens`` and ``dtype``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    try:
        with replacing_all([path, sidecar(path)]) as (tmp, side_tmp):
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    arr = np.asarray(chunk)
                    if arr.size and int(arr.max()) > np.iinfo(dtype).max:
                        raise LlmkitError(f"token id {int(arr.max())} does not fit {dtype}")
                    _write(f, arr, dtype)
                    n += arr.size
            side_tmp.write_text(json.dumps({**meta, "tokens": n, "dtype": dtype.name}, indent=1))
    except OSError as exc:
        raise_if_full(exc, path)
        raise
    return TokenFile(path)


def write_masked_token_file(
    chunks: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]],
    path: str | Path,
    dtype: np.dtype,
    meta: dict[str, Any],
) -> TokenFile:
    """As :func:`write_token_file` for chunks of ``(ids, mask, document lengths)``: the ids,
    the mask and the document offsets, each written under a temp name and renamed, the
    sidecar (``mask: true``, ``documents``) last."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    finals = [path, path.with_suffix(MASK_SUFFIX), path.with_suffix(DOCS_SUFFIX), sidecar(path)]
    n, n_docs = 0, 0
    try:
        with replacing_all(finals) as tmps:
            with (
                open(tmps[0], "wb") as f_ids,
                open(tmps[1], "wb") as f_mask,
                open(tmps[2], "wb") as f_docs,
            ):
                np.zeros(1, np.int64).tofile(f_docs)
                for ids, mask, lengths in chunks:
                    ids, mask = np.asarray(ids), np.asarray(mask)
                    lengths = np.asarray(lengths, np.int64)
                    if mask.size != ids.size or int(lengths.sum()) != ids.size:
                        raise ValueError("ids, mask and document lengths disagree")
                    if ids.size and int(ids.max()) > np.iinfo(dtype).max:
                        raise LlmkitError(f"token id {int(ids.max())} does not fit {dtype}")
                    _write(f_ids, ids, dtype)
                    _write(f_mask, mask, np.dtype(np.uint8))
                    _write(f_docs, n + np.cumsum(lengths), np.dtype(np.int64))
                    n += ids.size
                    n_docs += lengths.size
            side = {**meta, "tokens": n, "dtype": dtype.name, "mask": True, "documents": n_docs}
            tmps[3].write_text(json.dumps(side, indent=1))
    except OSError as exc:
        raise_if_full(exc, path)
        raise
    return TokenFile(path)


def _reusable(path: Path) -> bool:
    side = sidecar(path)
    if not (path.is_file() and side.is_file()):
        return False
    try:
        meta = json.loads(side.read_text())
        n = int(meta["tokens"])
        size = n * np.dtype(meta["dtype"]).itemsize
        if meta.get("mask"):
            extra = {MASK_SUFFIX: n, DOCS_SUFFIX: 8 * (int(meta["documents"]) + 1)}
            for suffix, want in extra.items():
                other = path.with_suffix(suffix)
                if not other.is_file() or other.stat().st_size != want:
                    return False
    except (ValueError, KeyError, TypeError):
        return False
    return path.stat().st_size == size


# -- preparing a run's data -----------------------------------------------------------------
