"""Flat token files: ``<split>-<key>.bin`` (uint16 or uint32 ids) beside a JSON sidecar."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.errors import LlmkitError

#: Bumped when the token-file layout changes, so older caches are not reused.
FORMAT_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab ≤ 65535), else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


class TokenFile:
    """A flat file of token ids, memory-mapped read-only, with its JSON sidecar
    (``tokens``, ``dtype``, ``documents``, ``n_bytes_text``: UTF-8 bytes of the text it
    came from, for loss per byte)."""

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

    @property
    def array(self) -> np.ndarray:
        """The ids, as a read-only ``np.memmap`` (opened on first use)."""
        if self._array is None:
            if self._n == 0:
                self._array = np.zeros(0, self.dtype)
            else:
                self._array = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._array

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
        return {**self.__dict__, "_array": None}

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, {self._n} tokens, {self.dtype})"


def sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def write_token_file(
    chunks: Iterable[np.ndarray], path: str | Path, dtype: np.dtype, meta: dict[str, Any]
) -> TokenFile:
    """Stream id arrays into ``path`` (a temp name, then renamed) and write its sidecar:
    ``meta`` (read after ``chunks`` is exhausted) plus ``tokens`` and ``dtype``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    side_tmp = tmp.with_suffix(".json.tmp")
    n = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                arr = np.asarray(chunk)
                if arr.size and int(arr.max()) > np.iinfo(dtype).max:
                    raise LlmkitError(f"token id {int(arr.max())} does not fit {dtype}")
                arr.astype(dtype, copy=False).tofile(f)
                n += arr.size
        side_tmp.write_text(json.dumps({**meta, "tokens": n, "dtype": dtype.name}, indent=1))
        os.replace(tmp, path)
        os.replace(side_tmp, sidecar(path))
    finally:
        tmp.unlink(missing_ok=True)
        side_tmp.unlink(missing_ok=True)
    return TokenFile(path)


def _reusable(path: Path) -> bool:
    side = sidecar(path)
    if not (path.is_file() and side.is_file()):
        return False
    try:
        meta = json.loads(side.read_text())
        size = int(meta["tokens"]) * np.dtype(meta["dtype"]).itemsize
    except (ValueError, KeyError, TypeError):
        return False
    return path.stat().st_size == size


# -- preparing a run's data -----------------------------------------------------------------
