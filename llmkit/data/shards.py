"""Sharded token stores: the on-disk format and :class:`ShardedTokens`, the lazy reader.

A store is a directory written by ``llmkit data prepare`` (:mod:`llmkit.data.shards_write`)::

    DIR/index.json                  the index (below), rewritten after every shard
    DIR/tokenizer.json              the tokenizer the ids come from
    DIR/train-000000.bin ...        ids, SHARD_TOKENS each but the last of a split
    DIR/train-000000.docs ...       int64 ends of the documents that end in the shard
    DIR/validation-000000.bin ...

With ``--format llmc`` the shards are llm.c files (``train_000000.bin``, ``val_000000.bin``:
a 1024-byte header, then the ids; :mod:`llmkit.data.llmc`), which llm.c and modded-nanogpt
read as they are. ``index.json`` holds ``format``/``version``, ``complete`` (false while
being written), ``dtype``, ``shard_tokens``, the tokenizer (``sha256`` of its JSON,
``vocab_size``, ``eos_id``), the recipe it was made from, and per split its ``tokens``,
``documents``, ``n_bytes_text`` and ``shards``: each with ``file``, ``offset`` (header
bytes), ``tokens``, ``documents``, ``n_bytes_text``, ``max_id``, ``sha256`` (of the ids,
after the header), its ``docs`` file and ``docs_sha256``, and ``next`` (where the next shard
starts, for resuming). Documents run across shard boundaries (shards are fixed-size slices
of one token stream); a document belongs to the shard where it ends.

A shard is checked (size, SHA-256, llm.c header) the first time a process reads it, once per
process; reads go through ``os.preadv`` into the batch, so the resident memory of a training
process does not grow with the corpus (a memory map would keep every page it touched).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.data.tokens import TokenFile
from llmkit.errors import LlmkitError

INDEX = "index.json"
TOKENIZER = "tokenizer.json"
STORE_FORMAT = "llmkit-token-shards"
STORE_VERSION = 1
SPLITS = ("train", "validation")
#: Tokens per shard by default (FineWeb's and llm.c's shards hold 100M).
SHARD_TOKENS = 100_000_000
#: Bytes read at a time when a whole file is hashed or scanned.
READ_CHUNK = 8 << 20

#: (path, size, mtime, checksum) of the shards this process has checked.
_verified: set[tuple[str, int, int, str]] = set()


@dataclass(frozen=True)
class Shard:
    """One file of ids: ``tokens`` ids after ``offset`` header bytes; what the index says of
    it (None where unknown, as for llm.c files given directly); ``header``: the llm.c magic
    to check when it is first read (0: none)."""

    path: Path
    tokens: int
    offset: int = 0
    documents: int | None = None
    n_bytes_text: int | None = None
    max_id: int | None = None
    sha256: str | None = None
    docs: Path | None = None
    docs_sha256: str | None = None
    header: int = 0


def file_sha256(path: Path, offset: int = 0) -> str:
    """The SHA-256 of a file's bytes after ``offset``, read in :data:`READ_CHUNK` pieces (no
    memory map: the pages read do not count as this process's resident memory)."""
    h = hashlib.sha256()
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def file_max(path: Path, offset: int, dtype: np.dtype) -> int:
    """The largest id in a file of ``dtype`` ids after ``offset`` bytes (-1 when empty)."""
    best = -1
    step = READ_CHUNK // dtype.itemsize * dtype.itemsize
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while chunk := f.read(step):
            best = max(best, int(np.frombuffer(chunk, dtype).max()))
    return best


def file_positions(path: Path, offset: int, dtype: np.dtype, value: int) -> np.ndarray:
    """Where ``value`` occurs in a file of ids (int64 positions), read in pieces."""
    out, base = [], 0
    step = READ_CHUNK // dtype.itemsize * dtype.itemsize
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while chunk := f.read(step):
            ids = np.frombuffer(chunk, dtype)
            out.append(np.flatnonzero(ids == value) + base)
            base += len(ids)
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset`` of ``fd``; the bytes read (0 at the end)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)  # no preadv (Windows): one copy more
    view[: len(data)] = data
    return len(data)


class ShardedTokens(TokenFile):
    """Shards read as one token sequence, duck-typing :class:`TokenFile` for every sampler
    (it is one, so the samplers' ``isinstance`` checks take it): ``array`` (a
    :class:`ShardedArray`), ``doc_bounds`` (from the shards' ``.docs`` files, or, for files
    without them, after each ``meta["eos_id"]``, computed when first asked), ``mask`` None,
    ``meta``, ``layout``, ``len()``. Nothing is read at construction; a shard is checked
    and opened when first read. Picklable (open files are not carried)."""

    layout: str = "packed"

    def __init__(
        self,
        shards: Sequence[Shard],
        dtype: str | np.dtype,
        meta: dict[str, Any],
        *,
        path: Path,
        verify: bool = True,
    ) -> None:
        self.path = Path(path)
        self.shards = list(shards)
        self.dtype = np.dtype(dtype)
        self.verify = verify
        self.starts = np.zeros(len(self.shards) + 1, np.int64)
        np.cumsum([s.tokens for s in self.shards], out=self.starts[1:])
        self._n = int(self.starts[-1])
        self.meta = {"tokens": self._n, "dtype": self.dtype.name, **meta}
        if all(s.documents is not None for s in self.shards) and self.shards:
            self.meta.setdefault("documents", sum(int(s.documents or 0) for s in self.shards))
        if all(s.n_bytes_text is not None for s in self.shards) and self.shards:
            self.meta.setdefault("n_bytes_text", sum(int(s.n_bytes_text or 0) for s in self.shards))
        self._reset()

    def _reset(self) -> None:
        self._array: ShardedArray | None = None  # type: ignore[assignment]
        self._mask = None
        self._docs: np.ndarray | None = None
        self._fds: list[int | None] = [None] * len(self.shards)
        self._maps: list[np.ndarray | None] = [None] * len(self.shards)

    # -- what samplers read ------------------------------------------------------------

    @property
    def array(self) -> ShardedArray:  # type: ignore[override]
        if self._array is None:
            self._array = ShardedArray(self)
        return self._array

    @property
    def has_mask(self) -> bool:
        return False

    @property
    def mask(self) -> None:
        return None

    @property
    def doc_bounds(self) -> np.ndarray | None:
        """Document offsets (``documents + 1``, 0 first, the token count last); None when
        the shards have no ``.docs`` files and no EOS is known."""
        if self._docs is None:
            self._docs = self._load_bounds()
        return self._docs

    def _load_bounds(self) -> np.ndarray | None:
        eos = self.meta.get("eos_id")
        parts = [np.zeros(1, np.int64)]
        for i, shard in enumerate(self.shards):
            start = int(self.starts[i])
            if shard.docs is not None:
                ends = self._docs_of(shard)
            elif eos is not None:  # a document starts at each EOS (GPT-2 data puts it first)
                self._check(i)
                at = file_positions(shard.path, shard.offset, self.dtype, int(eos))
                ends = at[at > 0] if start == 0 else at
            else:
                return None
            parts.append(ends.astype(np.int64) + start)
        bounds = np.concatenate(parts)
        if bounds[-1] != self._n:
            bounds = np.append(bounds, self._n)
        return bounds

    def _docs_of(self, shard: Shard) -> np.ndarray:
        docs = shard.docs
        assert docs is not None
        n = int(shard.documents or 0)
        size = docs.stat().st_size if docs.is_file() else -1
        if size != 8 * n:
            raise LlmkitError(f"{docs}: missing or not {n} int64 document ends (the index says)")
        if self.verify and shard.docs_sha256 and file_sha256(docs) != shard.docs_sha256:
            raise LlmkitError(f"{docs}: checksum does not match the index (corrupt)")
        ends = np.fromfile(docs, dtype="<i8")
        if n and (ends[0] < 1 or ends[-1] > shard.tokens or np.any(np.diff(ends) < 1)):
            raise LlmkitError(f"{docs}: document ends out of order or outside the shard")
        return ends

    @property
    def bytes_per_token(self) -> float | None:
        n = self.n_bytes_text
        return n / self._n if n and self._n else None

    # -- shards --------------------------------------------------------------------------

    def _check(self, i: int) -> None:
        """Check shard ``i`` once per process: its size, header and SHA-256, and its largest
        id against ``meta["vocab_size"]``; a one-line error naming the file."""
        shard = self.shards[i]
        path = shard.path
        try:
            st = path.stat()
        except OSError as exc:
            raise LlmkitError(f"{path}: cannot read the shard: {exc.strerror or exc}") from exc
        key = (str(path), st.st_size, st.st_mtime_ns, shard.sha256 or "")
        if key in _verified:
            return
        want = shard.offset + shard.tokens * self.dtype.itemsize
        if st.st_size != want:
            raise LlmkitError(
                f"{path}: {st.st_size} bytes, but the index says {shard.tokens} tokens "
                f"({want} bytes); the shard is truncated or was replaced"
            )
        if shard.header:
            from llmkit.data.llmc import read_header

            head = read_header(path)
            if head.magic != shard.header or head.tokens != shard.tokens:
                raise LlmkitError(f"{path}: its llm.c header changed since the index was made")
        if self.verify and shard.sha256 and file_sha256(path, shard.offset) != shard.sha256:
            raise LlmkitError(
                f"{path}: checksum (SHA-256) does not match the index: the shard is corrupt; "
                "prepare the store again (`llmkit data prepare` remakes a deleted shard)"
            )
        vocab = self.meta.get("vocab_size")
        if vocab is not None:
            top = shard.max_id if shard.max_id is not None else None
            if top is None and self.verify:
                top = file_max(path, shard.offset, self.dtype)
            if top is not None and top >= int(vocab):
                raise LlmkitError(
                    f"{path}: token id {top} is outside the tokenizer's vocabulary of "
                    f"{int(vocab)} ids (another tokenizer made these ids)"
                )
        _verified.add(key)

    def _fd(self, i: int) -> int:
        fd = self._fds[i]
        if fd is None:
            self._check(i)
            fd = os.open(self.shards[i].path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            self._fds[i] = fd
        return fd

    def _map(self, i: int) -> np.ndarray:
        """Shard ``i`` as a read-only memory map (for scattered indices only)."""
        mm = self._maps[i]
        if mm is None:
            self._check(i)
            shard = self.shards[i]
            if shard.tokens == 0:
                mm = np.zeros(0, self.dtype)
            else:
                mm = np.memmap(
                    shard.path, self.dtype, "r", offset=shard.offset, shape=(shard.tokens,)
                )
            self._maps[i] = mm
        return mm

    def read_into(self, start: int, out: np.ndarray) -> None:
        """Ids ``[start, start + len(out))`` into the contiguous 1-D ``out``."""
        pos, stop = start, start + len(out)
        i = int(np.searchsorted(self.starts, pos, side="right")) - 1
        item = self.dtype.itemsize
        while pos < stop:
            end = min(stop, int(self.starts[i + 1]))
            if end > pos:
                view = memoryview(out[pos - start : end - start]).cast("B")
                where = self.shards[i].offset + (pos - int(self.starts[i])) * item
                fd = self._fd(i)
                while len(view):
                    got = _pread_into(fd, view, where)
                    if got <= 0:
                        raise LlmkitError(f"{self.shards[i].path}: shorter than the index says")
                    view, where = view[got:], where + got
                pos = end
            i += 1

    def close(self) -> None:
        """Close the shards' files (they reopen when read again)."""
        for fd in self._fds:
            if fd is not None:
                os.close(fd)
        self._reset()

    def __del__(self) -> None:
        try:
            for fd in getattr(self, "_fds", []):
                if fd is not None:
                    os.close(fd)
        except OSError:
            pass

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_array", "_mask", "_docs", "_fds", "_maps"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __repr__(self) -> str:
        return f"ShardedTokens({str(self.path)!r}, {len(self.shards)} shards, {self._n} tokens)"


class ShardedArray:
    """The ids of a :class:`ShardedTokens` as one read-only array: ``len``, ``dtype``,
    ``shape``; indexing by an int, a slice or an integer array of any shape gives a NumPy
    array, read across shard boundaries. Rows of consecutive positions (the samplers'
    blocks) are read straight into the result; other indices go through memory maps."""

    def __init__(self, owner: ShardedTokens) -> None:
        self._t = owner
        self.dtype = owner.dtype
        self.shape = (len(owner),)
        self.ndim = 1
        self.size = len(owner)

    def __len__(self) -> int:
        return self.size

    def _range(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(max(stop - start, 0), self.dtype)
        if len(out):
            self._t.read_into(start, out)
        return out

    def __getitem__(self, index: Any) -> Any:
        n = self.size
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step == 1:
                return self._range(start, stop)
            picked = range(start, stop, step)
            if not len(picked):
                return np.zeros(0, self.dtype)
            lo = min(picked[0], picked[-1])
            span = self._range(lo, max(picked[0], picked[-1]) + 1)
            return span[np.asarray(picked) - lo]
        if isinstance(index, (int, np.integer)):
            i = int(index) + (n if index < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"index {int(index)} is out of bounds for {n} tokens")
            return self._range(i, i + 1)[0]
        idx = np.asarray(index)
        if idx.dtype == bool or not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"ShardedArray takes ints, slices or integer arrays, not {idx.dtype}")
        idx = np.where(idx < 0, idx + n, idx) if idx.size and idx.min() < 0 else idx
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"an index is out of bounds for {n} tokens")
        if idx.ndim == 2 and idx.shape[1] and np.all(idx[:, 1:] - idx[:, :-1] == 1):
            out = np.empty(idx.shape, self.dtype)
            for row, first in enumerate(idx[:, 0].tolist()):
                self._t.read_into(first, out[row])
            return out
        return self._gather(idx)

    def _gather(self, idx: np.ndarray) -> np.ndarray:
        flat = idx.reshape(-1)
        out = np.empty(flat.shape, self.dtype)
        which = np.searchsorted(self._t.starts, flat, side="right") - 1
        for i in np.unique(which).tolist():
            sel = which == i
            out[sel] = self._t._map(i)[flat[sel] - self._t.starts[i]]
        return out.reshape(idx.shape)

    def astype(self, dtype: Any) -> np.ndarray:
        """Every id, as ``dtype`` (reads the whole sequence)."""
        return self._range(0, self.size).astype(dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self._range(0, self.size)
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"ShardedArray({self.size} tokens, {self.dtype})"
