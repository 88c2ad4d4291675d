"""Writing a sharded token store (:mod:`llmkit.data.shards`) in parallel, resumably.

Each split's documents are cut into *pieces* (:mod:`llmkit.data.shards_encode`): the same
pieces whatever the number of workers. Worker processes tokenize pieces (one thread each);
the main process takes their results in piece order and cuts the one token stream into
shards of ``shard_tokens`` ids.
Each shard is written under a temporary name and renamed, then recorded in ``index.json``
(also replaced whole) with where the next shard starts (``next``: a piece and an offset
in its ids). A rerun after a crash or ``kill -9`` checks the recorded shards and goes on
from the last one's ``next``: pieces before it are read but not tokenized, so the store is
byte for byte the one an uninterrupted run writes, with any number of workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmkit.data import shards_encode
from llmkit.data.shards import (
    INDEX,
    SHARD_TOKENS,
    STORE_FORMAT,
    STORE_VERSION,
    TOKENIZER,
    file_sha256,
    text_sha256,
)
from llmkit.data.shards_encode import PieceEncoder, encoded, pieces
from llmkit.data.shards_open import inside
from llmkit.data.tokens import token_dtype
from llmkit.errors import LlmkitError, no_space, no_space_message
from llmkit.files import read_json, temporary_name, write_json_atomic, write_text_atomic

if TYPE_CHECKING:
    from llmkit.data.tokenizer import Tokenizer

LAYOUTS = ("llmkit", "llmc")
#: llm.c's names of the splits (``fineweb_train_000001.bin``, ``fineweb_val_000000.bin``).
LLMC_SPLITS = {"train": "train", "validation": "val"}
#: Test failpoint: once this many shards of a split are recorded and the next one has ids,
#: the process kills itself (SIGKILL), as a crash mid-shard would.
FAIL_ENV = "LLMKIT_PREPARE_KILL_AT_SHARD"


@dataclass
class SplitInput:
    """A split's documents: ``texts()`` iterates them from the first, in a fixed order;
    ``count()``: how many (for progress; None if unknown), asked once ``texts()`` began."""

    texts: Callable[[], Iterable[str]]
    count: Callable[[], int | None] = lambda: None


@dataclass
class Progress:
    """Where writing stands, handed to the ``progress`` callback after each piece."""

    split: str
    documents: int
    total: int | None
    tokens: int
    shards: int
    text_bytes: int
    resumed: bool  # still passing over work an earlier run did


def shard_name(split: str, k: int, layout: str) -> str:
    if layout == "llmc":
        return f"{LLMC_SPLITS[split]}_{k:06d}.bin"
    return f"{split}-{k:06d}.bin"


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    """What names a tokenizer: the SHA-256 of its ``tokenizer.json`` as ``tokenizers``
    writes it (formatting of the file aside)."""
    return text_sha256(tokenizer.to_str())


# -- shards ----------------------------------------------------------------------------------


class ShardWriter:
    """The shard being filled: ids streamed into a temporary file (SHA-256 and largest id
    kept as they go), the ends of the documents that end in it, their text bytes."""

    def __init__(self, out: Path, split: str, k: int, layout: str, dtype: np.dtype) -> None:
        import hashlib

        self.path = out / shard_name(split, k, layout)
        self.layout, self.dtype = layout, dtype
        self.offset = 1024 if layout == "llmc" else 0
        self.tmp = temporary_name(self.path)
        self.f = open(self.tmp, "wb")  # noqa: SIM115 (closed in finish/abort)
        if self.offset:
            self.f.write(b"\0" * self.offset)  # the header, once the count is known
        self.hash = hashlib.sha256()
        self.size, self.max_id, self.n_bytes = 0, -1, 0
        self.ends: list[np.ndarray] = []

    def add(self, ids: np.ndarray, ends: np.ndarray, n_bytes: int) -> None:
        """Append ``ids``; ``ends``: the documents ending among them (ends relative to
        ``ids``' first); ``n_bytes``: those documents' text bytes."""
        data = np.ascontiguousarray(ids, self.dtype.newbyteorder("<"))
        self.f.write(data.tobytes())
        self.hash.update(data.tobytes())
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))
        self.ends.append(ends.astype(np.int64) + self.size)
        self.size += len(ids)
        self.n_bytes += n_bytes

    def finish(self, nxt: list[int] | None) -> dict[str, Any]:
        """Close, rename into place (the ``.docs`` file first) and return the index entry."""
        from llmkit.data.llmc import header_bytes

        if self.offset:
            self.f.seek(0)
            self.f.write(header_bytes(self.size, self.dtype))
        self.f.close()
        ends = np.concatenate(self.ends) if self.ends else np.zeros(0, np.int64)
        docs = self.path.with_suffix(".docs")
        docs_tmp = temporary_name(docs)
        try:
            ends.astype("<i8").tofile(docs_tmp)
            os.replace(docs_tmp, docs)
            os.replace(self.tmp, self.path)
        finally:
            docs_tmp.unlink(missing_ok=True)
            self.tmp.unlink(missing_ok=True)
        entry = {
            "file": self.path.name,
            "offset": self.offset,
            "tokens": self.size,
            "documents": len(ends),
            "n_bytes_text": self.n_bytes,
            "max_id": self.max_id,
            "sha256": self.hash.hexdigest(),
            "docs": docs.name,
            "docs_sha256": file_sha256(docs),
        }
        if nxt is not None:
            entry["next"] = nxt
        return entry

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold ``out/.lock`` while writing: a second writer of the same store is refused."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(out / ".lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise LlmkitError(f"{out}: another `llmkit data prepare` is writing it") from None
        yield


def _clean_temporaries(out: Path) -> None:
    """Remove what a killed writer left under temporary names (``.NAME.PID.tmp``)."""
    for tmp in out.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


# -- the store --------------------------------------------------------------------------------


def open_for_writing(
    out: Path, recipe: dict[str, Any], layout: str, shard_tokens: int
) -> dict[str, Any]:
    """The index to go on with: a new one for an empty or missing ``out``, the existing
    one when it was started from the same recipe, shard size and format; otherwise a
    one-line error (nothing in ``out`` is touched)."""
    index_path = out / INDEX
    recipe = json.loads(json.dumps(recipe, sort_keys=True, default=str))  # as stored
    if index_path.is_file():
        index = read_json(index_path)
        if not isinstance(index, dict) or index.get("format") != STORE_FORMAT:
            raise LlmkitError(f"{index_path}: not the index of a token store; choose another --out")
        old = index.get("recipe", {})
        have = (old, index.get("layout"), index.get("shard_tokens"), index.get("pieces"))
        same = have == (recipe, layout, shard_tokens, _pieces())
        if index.get("pieces") != _pieces() and _started(index):
            raise LlmkitError(
                f"{out}: begun by an llmkit that cuts the work otherwise ({index.get('pieces')}"
                f", now {_pieces()}); delete it (or finish it with that version)"
            )
        if not same and not _started(index):  # nothing made yet: start afresh
            (out / TOKENIZER).unlink(missing_ok=True)
            index_path.unlink()
            return open_for_writing(out, recipe, layout, shard_tokens)
        for key, what in (("source", "source"), ("tokenizer", "tokenizer recipe")):
            if old.get(key) != recipe.get(key):
                raise LlmkitError(
                    f"{out}: prepared from another {what} ({_short(old.get(key))}, now "
                    f"{_short(recipe.get(key))}); use another --out or delete it"
                )
        for key, have in (("layout", layout), ("shard_tokens", shard_tokens)):
            if index.get(key) != have:
                flag = "--format" if key == "layout" else "--shard-tokens"
                raise LlmkitError(
                    f"{out}: prepared with {flag} {index.get(key)}, not {have}; use the same "
                    "or another --out"
                )
        return index
    if out.exists() and any(p.name != ".lock" for p in out.iterdir()):
        raise LlmkitError(f"{out}: not empty and holds no {INDEX}; choose an empty or new --out")
    out.mkdir(parents=True, exist_ok=True)
    index = {
        "format": STORE_FORMAT,
        "version": STORE_VERSION,
        "complete": False,
        "layout": layout,
        "shard_tokens": shard_tokens,
        "pieces": _pieces(),
        "recipe": recipe,
        "splits": {},
    }
    write_json_atomic(index_path, index)  # the recipe is claimed before any work
    return index


def _pieces() -> list[int]:
    """How the work is cut (recorded: a store is finished only with the same pieces)."""
    return [shards_encode.PIECE_DOCS, shards_encode.PIECE_CHARS]


def _started(index: dict[str, Any]) -> bool:
    """Whether a store holds work: a tokenizer recorded or a shard written."""
    splits = index.get("splits") or {}
    return "tokenizer" in index or any(part.get("shards") for part in splits.values())


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:79] + "…"


def recorded_shards(out: Path, entries: list[dict[str, Any]], log: Callable[[str], None]) -> int:
    """How many of the recorded shards are whole (each checked: size and SHA-256); the
    first missing one and those after it are to be written again. A shard that is there
    but corrupt is an error (delete it to have it written again)."""
    for i, entry in enumerate(entries):
        where = f"shards[{i}]"
        path = inside(out, entry.get("file"), out / INDEX, f"{where}.file")
        docs = inside(out, entry.get("docs"), out / INDEX, f"{where}.docs")
        if not path.is_file() or not docs.is_file():
            log(f"data prepare: {path.name} is missing; writing it and the shards after it again")
            return i
        offset = int(entry.get("offset", 0))
        if (
            file_sha256(path, offset) != entry["sha256"]
            or file_sha256(docs) != entry["docs_sha256"]
        ):
            raise LlmkitError(
                f"{path}: checksum does not match {out / INDEX}: the shard is corrupt; delete "
                "it and run `llmkit data prepare` again to write it (and those after it) again"
            )
    return len(entries)


def write_store(
    inputs: dict[str, SplitInput],
    tokenizer: Tokenizer,
    out: str | Path,
    *,
    recipe: dict[str, Any],
    description: str | Callable[[], str],
    workers: int = 1,
    shard_tokens: int = SHARD_TOKENS,
    layout: str = "llmkit",
    progress: Callable[[Progress], None] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Write (or finish) the store ``out`` from the splits' texts, tokenized by
    ``tokenizer`` with an EOS after each document; returns its index. ``recipe`` names what
    the texts are made from (a rerun with another one is refused); ``description`` (or
    what it returns once the texts are read) is the store's one-line summary."""
    out = Path(out)
    if layout not in LAYOUTS:
        raise LlmkitError(f"--format must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if shard_tokens < 1:
        raise LlmkitError(f"--shard-tokens must be positive, got {shard_tokens}")
    tok_hash = tokenizer_sha256(tokenizer)
    index = open_for_writing(out, recipe, layout, shard_tokens)
    with locked(out):
        _clean_temporaries(out)
        tok_path = out / TOKENIZER
        known = index.get("tokenizer", {}).get("sha256")
        if known is not None and known != tok_hash:
            raise LlmkitError(
                f"{out}: prepared with another tokenizer (sha256 {known[:12]}…, now "
                f"{tok_hash[:12]}…); use another --out or delete it"
            )
        if not tok_path.is_file() or text_sha256(tok_path.read_text("utf-8")) != tok_hash:
            write_text_atomic(tok_path, tokenizer.to_str())
        dtype = token_dtype(tokenizer.vocab_size)
        index["dtype"] = dtype.name
        index["tokenizer"] = {
            "file": TOKENIZER,
            "sha256": tok_hash,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "eos_token": tokenizer.eos_token,
            "kind": tokenizer.kind,
        }
        index.setdefault("source", description if isinstance(description, str) else "")
        write_json_atomic(out / INDEX, index)
        encoder = PieceEncoder(tokenizer.to_str(), tokenizer.eos_id, dtype.name)
        wrote = False
        try:
            for split, given in inputs.items():
                wrote |= _write_split(
                    out, index, split, given, encoder, dtype, workers, progress, log
                )
        except OSError as exc:
            if no_space(exc):
                raise LlmkitError(no_space_message(out)) from exc
            raise
        index["complete"] = True
        if wrote or not index.get("source"):  # the summary of the texts read
            index["source"] = description if isinstance(description, str) else description()
        write_json_atomic(out / INDEX, index)
    return index


def _write_split(
    out: Path,
    index: dict[str, Any],
    split: str,
    given: SplitInput,
    encoder: PieceEncoder,
    dtype: np.dtype,
    workers: int,
    progress: Callable[[Progress], None] | None,
    log: Callable[[str], None],
) -> bool:
    """Write what is missing of ``split``; whether anything was."""
    state = index["splits"].setdefault(split, {"done": False, "shards": []})
    entries: list[dict[str, Any]] = state["shards"]
    kept = recorded_shards(out, entries, log)
    if state.get("done") and kept == len(entries):
        _totals(state)
        return False
    del entries[kept:]
    state["done"] = False
    first_piece, skip = entries[-1]["next"] if entries else (0, 0)
    layout, shard_tokens = index["layout"], index["shard_tokens"]
    seen = {"documents": 0, "tokens": sum(e["tokens"] for e in entries), "bytes": 0}

    def report(resumed: bool) -> None:
        if progress is not None:
            progress(
                Progress(split, seen["documents"], given.count(), seen["tokens"],
                         len(entries), seen["bytes"], resumed)
            )  # fmt: skip

    def work() -> Iterator[tuple[int, list[str]]]:
        for k, texts in enumerate(pieces(given.texts())):
            if k < first_piece:
                seen["documents"] += len(texts)
                report(True)
                continue
            yield k, texts

    shard: ShardWriter | None = None
    try:
        for k, (ids, lengths, n_bytes) in encoded(work(), encoder, workers):
            ends = np.cumsum(lengths)
            pos = skip if k == first_piece else 0
            while pos < len(ids):
                if shard is None:
                    shard = ShardWriter(out, split, len(entries), layout, dtype)
                take = min(shard_tokens - shard.size, len(ids) - pos)
                sel = (ends > pos) & (ends <= pos + take)
                shard.add(ids[pos : pos + take], ends[sel] - pos, int(n_bytes[sel].sum()))
                pos += take
                if os.environ.get(FAIL_ENV) == str(len(entries)):
                    shard.f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                if shard.size == shard_tokens:
                    nxt = [k, pos] if pos < len(ids) else [k + 1, 0]
                    entries.append(shard.finish(nxt))
                    shard = None
                    write_json_atomic(out / INDEX, index)
            seen["documents"] += len(lengths)
            seen["tokens"] += len(ids) - (skip if k == first_piece else 0)
            seen["bytes"] += int(n_bytes.sum())
            report(False)
        if shard is not None:
            entries.append(shard.finish(None))
            shard = None
            report(False)
    finally:
        if shard is not None:
            shard.abort()
    if not entries:
        raise LlmkitError(f"data prepare: the {split} split has no text")
    state["done"] = True
    _totals(state)
    write_json_atomic(out / INDEX, index)
    return True


def _totals(state: dict[str, Any]) -> None:
    entries = state["shards"]
    for key in ("tokens", "documents", "n_bytes_text"):
        state[key] = sum(int(e[key]) for e in entries)
