"""The file readers of streamed data (:mod:`llmkit.data.streaming`): where a file's records
start, how a corpus is cut into shards and a held-out tail, and the texts of a shard read
from any position, never the whole file at once.

Positions are *units*: bytes for JSONL and text files, rows for parquet. A position is
always a boundary of the format (a line start; a cut point of a text; a row), so a reader
started there reads exactly what an uninterrupted reader read from it.

* JSONL: one document per line (field ``text_field``); a shard owns the lines that start in
  it. Blank lines, and records whose text is empty or null, give no document; a line that
  is not a JSON object with a string ``text_field`` is a one-line error naming file:line.
* Text: one document per file, as the ``text`` source reads it. A file is read in pieces of
  at most :data:`PIECE_BYTES`, each cut right before a space that follows a printable ASCII
  character, or before a tab or line break that follows an ASCII letter or digit (points
  no usual pre-tokenizer spans, see :mod:`llmkit.data.long_text`), so a piece's ids are
  those of the whole text there. A file longer than a shard is cut into shards at such
  points; each shard is read as a document (it ends with the EOS).
* Parquet: one document per row of the ``text_field`` column; shards lie within one row
  group and are read in batches of :data:`PARQUET_BATCH` rows.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmkit.errors import LlmkitError
from llmkit.files import parse_json

#: The file formats read.
FORMATS = ("jsonl", "text", "parquet")
#: The format of a ``datasets.IterableDataset`` source.
DATASET = "dataset"
#: The largest shard of a JSONL or text file (bytes) before it is cut further.
SHARD_BYTES = 64 << 20
#: Shards are not cut below this many bytes to make more of them.
MIN_SHARD_BYTES = 512
#: The most bytes of a text file read (and tokenized) as one piece.
PIECE_BYTES = 1 << 15
#: Parquet rows decoded at a time.
PARQUET_BATCH = 256
#: How far (bytes) a text cut point is looked for before cutting at any character.
_SEARCH = 1 << 16
#: Cut points of a text (bytes): before a space after a printable ASCII character, or
#: before a tab or line break after an ASCII letter or digit.
_CUT = re.compile(rb"(?<=[\x21-\x7e]) |(?<=[0-9A-Za-z])[\t\n\r]")


@dataclass(frozen=True)
class Range:
    """Units ``[start, end)`` of file ``file`` (an index into the file list); ``start`` and
    ``end`` are boundaries of the format."""

    file: int
    start: int
    end: int


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise LlmkitError(f"streamed data: unknown format {fmt!r} (known: {', '.join(FORMATS)})")


def size_of(path: Path, fmt: str) -> int:
    """A file's length in units: bytes, or rows for parquet."""
    if fmt == "parquet":
        return sum(_row_groups(path))
    try:
        return os.path.getsize(path)
    except OSError as exc:
        raise LlmkitError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def _parquet(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(str(path))
    except Exception as exc:  # pyarrow's errors carry no common base
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LlmkitError(f"{path}: cannot read as parquet: {msg}") from exc


def _row_groups(path: Path) -> list[int]:
    md = _parquet(path).metadata
    return [md.row_group(i).num_rows for i in range(md.num_row_groups)]


def boundary(path: Path, fmt: str, pos: int, size: int) -> int:
    """The first boundary at or after ``pos``: a line start (JSONL), a cut point (text; the
    first character start at or after ``pos`` when none is within :data:`_SEARCH` bytes), the row
    itself (parquet); ``size`` at or past the end."""
    if pos <= 0 or pos >= size or fmt == "parquet":
        return max(0, min(pos, size))
    with open(path, "rb") as f:
        if fmt == "jsonl":
            f.seek(pos - 1)
            at = pos - 1
            while True:
                chunk = f.read(1 << 16)
                if not chunk:
                    return size
                i = chunk.find(b"\n")
                if i >= 0:
                    return at + i + 1
                at += len(chunk)
        f.seek(pos - 1)
        window = f.read(_SEARCH + 1)
    found = _CUT.search(window, 1)
    if found is not None:
        return pos - 1 + found.start()
    i = 1
    while i < len(window) and window[i] & 0xC0 == 0x80:  # a UTF-8 continuation byte
        i += 1
    return min(pos - 1 + i, size)


def split_held_out(
    paths: Sequence[Path], fmt: str, fraction: float, max_bytes: int
) -> tuple[list[Range], list[Range]]:
    """The training and held-out ranges of ``paths``: the held-out part is the tail of the
    corpus in file order, ``fraction`` of its units but at most ``max_bytes`` bytes (for
    parquet, that many bytes' worth of rows at the files' mean row size), starting at the
    first boundary at or after that point. ``fraction`` 0: nothing held out."""
    sizes = [size_of(p, fmt) for p in paths]
    whole = [Range(i, 0, s) for i, s in enumerate(sizes) if s > 0]
    if fraction <= 0:
        return whole, []
    total = sum(sizes)
    cap = max_bytes
    if fmt == "parquet":
        metas = [_parquet(p).metadata for p in paths]
        n_bytes = sum(
            m.row_group(g).total_byte_size for m in metas for g in range(m.num_row_groups)
        )
        cap = max(1, int(max_bytes * total / max(n_bytes, 1)))
    cut = total - min(math.ceil(total * fraction), cap)
    train: list[Range] = []
    val: list[Range] = []
    before = 0
    for i, size in enumerate(sizes):
        if before + size <= cut:
            train.append(Range(i, 0, size))
        elif before >= cut:
            val.append(Range(i, 0, size))
        else:
            at = boundary(paths[i], fmt, cut - before, size)
            train.append(Range(i, 0, at))
            val.append(Range(i, at, size))
        before += size
    train = [r for r in train if r.end > r.start]
    val = [r for r in val if r.end > r.start]
    if not train or not val:
        names = ", ".join(str(p) for p in paths[:3])
        raise LlmkitError(
            f"streamed data ({names}): too little data to hold out {fraction:g} of it for "
            "validation; give val_paths"
        )
    return train, val


def plan_shards(
    paths: Sequence[Path],
    fmt: str,
    ranges: Sequence[Range],
    want: int,
    shard_bytes: int = SHARD_BYTES,
) -> list[Range]:
    """``ranges`` cut into shards: at most ``shard_bytes`` each (parquet: its row groups),
    then the largest cut in halves until there are ``want`` (while a half would keep
    :data:`MIN_SHARD_BYTES`, or a row for parquet). Cuts are moved to boundaries and empty
    shards dropped; the result is in file order, the same for the same files."""
    pieces: list[tuple[int, int, int]] = []
    for r in ranges:
        if fmt == "parquet":
            start = 0
            for n in _row_groups(paths[r.file]):
                lo, hi = max(start, r.start), min(start + n, r.end)
                if hi > lo:
                    pieces.append((r.file, lo, hi))
                start += n
        else:
            n = max(1, math.ceil((r.end - r.start) / shard_bytes))
            cuts = [r.start + (r.end - r.start) * k // n for k in range(n + 1)]
            pieces.extend((r.file, a, b) for a, b in itertools.pairwise(cuts))
    least = 2 if fmt == "parquet" else 2 * MIN_SHARD_BYTES
    heap = [(-(b - a), f, a, b) for f, a, b in pieces]
    heapq.heapify(heap)
    while heap and len(heap) < want and -heap[0][0] >= least:
        _, f, a, b = heapq.heappop(heap)
        mid = (a + b) // 2
        heapq.heappush(heap, (-(mid - a), f, a, mid))
        heapq.heappush(heap, (-(b - mid), f, mid, b))
    sizes = {r.file: size_of(paths[r.file], fmt) for r in ranges}
    exact = {(r.file, x) for r in ranges for x in (r.start, r.end)}  # boundaries already

    def moved(f: int, x: int) -> int:
        return x if (f, x) in exact else boundary(paths[f], fmt, x, sizes[f])

    out: list[Range] = []
    for _, f, a, b in sorted(heap, key=lambda t: (t[1], t[2])):
        lo, hi = moved(f, a), moved(f, b)
        if hi > lo:
            out.append(Range(f, lo, hi))
    return out


# -- reading ---------------------------------------------------------------------------------

#: One text to tokenize: (text, its start, the position after it, whether a document ends).
Piece = tuple[str, int, int, bool]


def read_pieces(path: Path, fmt: str, shard: Range, pos: int, field: str) -> Iterator[Piece]:
    """The texts of ``shard`` of ``path`` from position ``pos`` (a boundary within it) on."""
    if fmt == "jsonl":
        return _jsonl(path, pos, shard.end, field)
    if fmt == "text":
        return _text(path, pos, shard.end)
    return _parquet_rows(path, shard, pos, field)


def _line_number(path: Path, pos: int) -> int:
    """The 1-based number of the line starting at byte ``pos``."""
    n = 1
    with open(path, "rb") as f:
        while pos > 0:
            chunk = f.read(min(pos, 1 << 20))
            if not chunk:
                break
            n += chunk.count(b"\n")
            pos -= len(chunk)
    return n


def record_text(line: bytes, field: str, where: Any) -> str | None:
    """The text of one JSONL line (None: no document); ``where()`` names the line."""
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LlmkitError(
            f"{where()}: not UTF-8 ({exc.reason} at byte {exc.start} of the line)"
        ) from None
    try:
        record = json.loads(decoded)
    except (ValueError, RecursionError):
        parse_json(decoded, where())  # raises the one-line error naming the line
        raise
    if not isinstance(record, dict):
        raise LlmkitError(f"{where()}: not a JSON object")
    if field not in record:
        have = ", ".join(list(record)[:8]) or "none"
        raise LlmkitError(f"{where()}: no field {field!r} (fields: {have}); set text_field")
    text = record[field]
    if text is not None and not isinstance(text, str):
        raise LlmkitError(f"{where()}: field {field!r} holds {type(text).__name__}, not text")
    return text or None


def _jsonl(path: Path, pos: int, end: int, field: str) -> Iterator[Piece]:
    with open(path, "rb") as f:
        f.seek(pos)
        while pos < end:
            line = f.readline()
            if not line:
                return
            start, pos = pos, pos + len(line)
            if line.strip():
                # (the line number is counted only for an error)
                text = record_text(line, field, lambda at=start: f"{path}:{_line_number(path, at)}")
                if text:
                    yield text, start, pos, True


def _text(path: Path, pos: int, end: int) -> Iterator[Piece]:
    with open(path, "rb") as f:
        f.seek(pos)
        while pos < end:
            raw = f.read(min(PIECE_BYTES, end - pos))
            if not raw:
                return
            if pos + len(raw) < end:
                raw = raw[: _piece_end(raw)]
                f.seek(pos + len(raw))
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                where = pos + exc.start
                raise LlmkitError(
                    f"{path}: not UTF-8 text ({exc.reason} at byte {where})"
                ) from None
            start, pos = pos, pos + len(raw)
            if text:
                yield text, start, pos, pos >= end


def _piece_end(raw: bytes) -> int:
    """Where a piece of ``raw`` (not the shard's last) ends: its last cut point in the second
    half, else in the first, else the last character start."""
    half = len(raw) // 2
    last = None
    for last in _CUT.finditer(raw, half):  # noqa: B007 (the last one)
        pass
    if last is None:
        for last in _CUT.finditer(raw, 1):  # noqa: B007
            pass
    if last is not None and last.start() > 0:
        return last.start()
    i = len(raw) - 1
    while i > 0 and raw[i] & 0xC0 == 0x80:
        i -= 1
    return i if i > 0 else len(raw)


def check_parquet_field(path: Path, field: str) -> None:
    """A one-line error unless ``path`` has a text column ``field``."""
    import pyarrow as pa

    schema = _parquet(path).schema_arrow
    if field not in schema.names:
        have = ", ".join(schema.names[:8]) or "none"
        raise LlmkitError(f"{path}: no column {field!r} (columns: {have}); set text_field")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise LlmkitError(f"{path}: column {field!r} holds {kind}, not text")


def _parquet_rows(path: Path, shard: Range, pos: int, field: str) -> Iterator[Piece]:
    check_parquet_field(path, field)
    pf = _parquet(path)
    first = 0
    group = 0
    for n in _row_groups(path):
        if first <= shard.start < first + n:
            break
        first, group = first + n, group + 1
    row = first
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH, row_groups=[group], columns=[field]):
        texts = batch.column(0).to_pylist()
        for text in texts:
            if row >= shard.end:
                return
            if row >= pos and text:
                yield text, row, row + 1, True
            row += 1


# -- datasets ---------------------------------------------------------------------------------


def resumes_by_state(ds: Any) -> bool:
    """Whether ``ds`` (a ``datasets.IterableDataset``) has ``state_dict``/``load_state_dict``
    (datasets ≥ 2.18); else it is resumed by skipping examples."""
    return hasattr(ds, "state_dict") and hasattr(ds, "load_state_dict")


def dataset_pieces(
    ds: Any, epoch: int, pos: int, snapshot: Any, text_field: str
) -> Iterator[tuple[Any, ...]]:
    """A ``datasets.IterableDataset``'s texts of ``epoch`` from example ``pos`` on: resumed
    from its ``state_dict()`` taken before that example where the installed datasets has
    one, else by skipping ``pos`` examples. Each piece carries that state."""
    stateful = resumes_by_state(ds)
    ds.set_epoch(epoch)
    if stateful and pos and snapshot is not None:
        ds.load_state_dict(snapshot)
        examples = iter(ds)
    else:
        examples = itertools.islice(iter(ds), pos, None)
    before, n = snapshot if pos else None, pos
    for example in examples:
        text = example.get(text_field) if isinstance(example, dict) else None
        if text is None and (not isinstance(example, dict) or text_field not in example):
            have = ", ".join(list(example)[:8]) if isinstance(example, dict) else "none"
            raise LlmkitError(
                f"streamed dataset: example {n} of epoch {epoch} has no field "
                f"{text_field!r} (fields: {have}); set text_field"
            )
        if text is not None and not isinstance(text, str):
            raise LlmkitError(
                f"streamed dataset: example {n} of epoch {epoch}: field {text_field!r} "
                f"holds {type(text).__name__}, not text"
            )
        after = ds.state_dict() if stateful else None
        if text:
            yield text, n, n + 1, True, before
        n, before = n + 1, after
