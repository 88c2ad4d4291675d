"""Streamed training data: documents read from JSONL, text or parquet files (or a
``datasets.IterableDataset``) and tokenized on the fly in DataLoader worker processes,
never held whole, with an exact-resume position of a few integers per reader.

**Work division.** The training part of the files is cut into shards (byte ranges at line
starts or text cut points; parquet row ranges within a row group; see
:mod:`llmkit.data.stream_readers`), at least ``world_size × readers × lanes`` where the
data allows. A seeded permutation of the shards deals them out, every ``n``-th to reader
``g = rank · readers + worker`` (``readers = max(num_workers, 1)``), so every
(rank, worker) pair reads its own disjoint share. A ``datasets.IterableDataset`` is split by
``datasets.distributed.split_dataset_by_node`` per rank and by its own DataLoader worker
split per worker.

**Epochs.** Each reader goes through its share over and over: epoch ``e`` visits its shards
in a permutation seeded by ``(seed, g, e)``, and the documents of a shard in file order. A
reader keeps ``lanes`` shards open at once (lane ``j`` takes the next shard of the epoch
order when its own runs out) and deals its rows to the lanes in turn, so one batch mixes
that many places of the corpus. Epochs are per reader: shares differ in size.

**Packing.** Each lane's documents are tokenized, each followed by the EOS (as in the
packed token files), and cut into rows of ``block_size + 1`` tokens, a row's last token
being the next row's first (``x = row[:-1]``, ``y = row[1:]``): every token is a target
once. A batch is ``batch_size`` rows of one reader, and the readers' batches take turns
(reader 0, 1, ...): workers send theirs a few at a time (:data:`ITEM_TOKENS`), the
DataLoader hands them out worker by worker, and the sampler keeps that order across a
resume.

**State.** Per reader: the epoch order's next shard and next lane, and per lane its shard
(epoch, index), the position of the piece its next row starts in and how many of that
piece's tokens came before it; every batch carries its reader's state after it. A resume
reads that piece again and skips those tokens, so the batches after ``load_state_dict(s)``
are those an uninterrupted sampler gave after ``s`` was taken. State from another world
size, worker count, seed, lane count or other files is refused (one line).

**Validation** is small and held whole (:func:`validation_ids`): the start of ``val_paths``,
or the held-out tail of the training files (``held_out``), which training never reads.

The readers at work are in :mod:`llmkit.data.stream_packing`; the file formats, shards
and held-out tail in :mod:`llmkit.data.stream_readers`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmkit.data.stream_packing import ENCODE_PIECES, Encoder, ReaderStream, StreamPlan
from llmkit.data.stream_readers import (
    DATASET,
    SHARD_BYTES,
    Range,
    check_format,
    check_parquet_field,
    dataset_pieces,
    plan_shards,
    read_pieces,
    split_held_out,
)
from llmkit.errors import LlmkitError, first_line

if TYPE_CHECKING:
    import torch

    from llmkit.data.tokenizer import Tokenizer

#: The most held out (bytes of the files) for validation, and read of ``val_paths``.
HELD_OUT_MAX_BYTES = 8 << 20
#: Shards a reader keeps open at once (rows of a batch come from that many places).
LANES = 8
STATE_VERSION = 1
#: Tokens a worker sends at once (a DataLoader item costs ~1–2 ms whatever its size).
ITEM_TOKENS = 1 << 16
#: ... and at most this many batches.
ITEM_BATCHES = 32


_DATASET_CLASS: Any = None


def _dataset_class() -> Any:
    """The torch IterableDataset of the workers (made on first use, so importing this
    module costs no torch): worker ``w`` yields reader ``w``'s batches forever, in items of
    several batches (:data:`ITEM_TOKENS`): (xs, ys, w, the state after each batch, None);
    or once (None, None, w, None, error)."""
    global _DATASET_CLASS
    if _DATASET_CLASS is not None:
        return _DATASET_CLASS
    import torch
    from torch.utils.data import IterableDataset, get_worker_info

    class _StreamDataset(IterableDataset):  # type: ignore[type-arg]
        def __init__(self, plan: StreamPlan, states: list[Any], batch_size: int) -> None:
            self.plan, self.states, self.batch_size = plan, states, batch_size
            per_batch = batch_size * plan.block_size
            self.per_item = min(ITEM_BATCHES, max(1, -(-ITEM_TOKENS // per_batch)))

        def __iter__(self) -> Iterator[tuple[Any, ...]]:
            info = get_worker_info()
            w = info.id if info is not None else 0
            if info is not None:  # the workers are the parallelism
                os.environ["TOKENIZERS_PARALLELISM"] = "false"
            n, shape = self.per_item, (self.per_item, self.batch_size, self.plan.block_size)
            try:
                stream = ReaderStream(self.plan, w, self.states[w])
                while True:
                    xs = torch.empty(shape, dtype=torch.int64)
                    ys = torch.empty(shape, dtype=torch.int64)
                    states = []
                    for j in range(n):
                        rows = stream.rows(self.batch_size)
                        xs[j].numpy()[...] = rows[:, :-1]
                        ys[j].numpy()[...] = rows[:, 1:]
                        states.append(stream.state())
                    yield xs, ys, w, states, None
            except (LlmkitError, OSError) as exc:  # one line in the main process
                yield None, None, w, None, first_line(exc)

    _StreamDataset.__module__ = __name__
    _StreamDataset.__qualname__ = "_StreamDataset"
    _DATASET_CLASS = _StreamDataset
    return _StreamDataset


def __getattr__(name: str) -> Any:
    if name == "_StreamDataset":  # what a spawned worker unpickles
        return _dataset_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _split(torch: Any, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))
    return x, torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))


def _tokenizer_json(tokenizer: Tokenizer | str, eos_id: int | None) -> tuple[str, int | None]:
    if isinstance(tokenizer, str):
        if eos_id is None:
            from llmkit.data.tokenizer import Tokenizer

            eos_id = Tokenizer.from_str(tokenizer).eos_id
        return tokenizer, eos_id
    return tokenizer.to_str(), tokenizer.eos_id if eos_id is None else eos_id


def _paths(files: Any, fmt: str, text_field: str) -> list[Path]:
    check_format(fmt)
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    if not all(isinstance(f, (str, os.PathLike)) for f in files):
        raise LlmkitError(f"streamed data: fmt {fmt!r} reads files; name them by path")
    paths = [Path(f) for f in files]
    if not paths:
        raise LlmkitError("streamed data: no files to read")
    for p in paths:
        if not p.is_file():
            raise LlmkitError(f"streamed data: file not found: {p}")
        if fmt == "parquet":
            check_parquet_field(p, text_field)
    return paths


class StreamSampler:
    """Batches of streamed, packed documents with the protocol of
    :mod:`llmkit.data.samplers`: ``next_batch(batch_size) -> (x, y)`` (int64, (B,
    block_size)), ``state_dict()`` / ``load_state_dict()`` for an exact resume, one share of
    the data per rank and worker. See the module docstring.

    ``files``: paths (``fmt`` ``"jsonl"``, ``"text"`` or ``"parquet"``), or a
    ``datasets.IterableDataset`` (``fmt="dataset"``). ``held_out``: the share of the files'
    tail kept for validation (:func:`validation_ids` reads it), at most
    ``held_out_max_bytes``. ``tokenizer``: a :class:`Tokenizer` or its JSON;
    ``eos_id`` defaults to its EOS. ``num_workers`` 0 tokenizes in this process;
    ``prefetch`` is the batches each worker keeps ready. Call :meth:`close` when done."""

    def __init__(
        self,
        files: Sequence[str | os.PathLike[str]] | Any,
        *,
        fmt: str,
        tokenizer: Tokenizer | str,
        block_size: int,
        text_field: str = "text",
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch: int = 2,
        lanes: int = LANES,
        held_out: float = 0.0,
        held_out_max_bytes: int = HELD_OUT_MAX_BYTES,
        shard_bytes: int = SHARD_BYTES,
        eos_id: int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if block_size < 1 or num_workers < 0 or lanes < 1 or prefetch < 1:
            raise ValueError("block_size, lanes and prefetch must be positive, num_workers ≥ 0")
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.pin_memory, self.prefetch = pin_memory, prefetch
        self.readers = max(num_workers, 1)
        n = world_size * self.readers
        tok_json, eos = _tokenizer_json(tokenizer, eos_id)
        first = rank * self.readers
        if fmt == DATASET:
            import datasets
            from datasets.distributed import split_dataset_by_node

            if not isinstance(files, datasets.IterableDataset):
                raise LlmkitError("streamed data: fmt 'dataset' needs a datasets.IterableDataset")
            ds = split_dataset_by_node(files, rank=rank, world_size=world_size)
            if num_workers > ds.num_shards:
                raise LlmkitError(
                    f"streamed dataset: {ds.num_shards} shard(s) per rank cannot feed "
                    f"{num_workers} DataLoader workers (datasets splits by shard)"
                )
            paths, shards, shares, lanes = [], [Range(0, 0, 0)], [[0]] * self.readers, 1
            sizes: list[int] = []
        else:
            ds, found = None, _paths(files, fmt, text_field)
            train = split_held_out(found, fmt, held_out, held_out_max_bytes)[0]
            shards = plan_shards(found, fmt, train, n * lanes, shard_bytes)
            if len(shards) < n:
                raise LlmkitError(
                    f"streamed data: {len(shards)} shard(s) cannot be shared by {world_size} "
                    f"rank(s) × {self.readers} reader(s); use fewer workers or more data"
                )
            perm = np.random.default_rng([seed % 2**63, 3]).permutation(len(shards))
            shares = [
                sorted(int(i) for i in perm[g::n]) for g in range(first, first + self.readers)
            ]
            paths, sizes = [str(p) for p in found], [os.path.getsize(p) for p in found]
        key = json.dumps([fmt, paths, sizes, [list(vars(s).values()) for s in shards], seed,
                          world_size, self.readers, lanes, block_size, text_field])  # fmt: skip
        self._plan = StreamPlan(
            fmt, paths, ds, text_field, shards, shares, first, lanes, seed, block_size,
            tok_json, eos, hashlib.sha256(key.encode()).hexdigest()[:16],
        )  # fmt: skip
        self._next = 0  # the reader whose batch comes next
        self._states: list[Any] = [None] * self.readers
        self._local: ReaderStream | None = None
        self._loader: Any = None
        self._batch_size = 0
        self._held: dict[int, deque[tuple[Any, ...]]] = {}

    # -- batches ---------------------------------------------------------------------------

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, LongTensors of shape (batch_size, block_size)."""
        import torch

        if self.num_workers == 0:
            if self._local is None:
                self._local = ReaderStream(self._plan, 0, self._states[0])
            x, y = _split(torch, self._local.rows(batch_size))
            self._states[0] = None  # the live stream holds the state
            return (x.pin_memory(), y.pin_memory()) if self.pin_memory else (x, y)
        if batch_size != self._batch_size:
            self._start(batch_size)
        reader = self._next
        held = self._held.setdefault(reader, deque())
        while not held:  # items come from the workers in turn; a resume may start elsewhere
            xs, ys, w, states, error = next(self._loader)
            if error is not None:
                self.close()
                raise LlmkitError(error)
            queue = self._held.setdefault(int(w), deque())
            queue.extend((xs[j], ys[j], state) for j, state in enumerate(states))
        x, y, self._states[reader] = held.popleft()
        self._next = (reader + 1) % self.readers
        return x, y

    def _start(self, batch_size: int) -> None:
        """(Re)start the workers from the current state."""
        from torch.utils.data import DataLoader

        self.close()
        states = list(self._states)
        loader = DataLoader(
            _dataset_class()(self._plan, states, batch_size),
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch,
            # forked workers would share the parent's open files, the run's lock among them:
            # a killed run would stay locked until its workers noticed; forkserver's do not
            multiprocessing_context="forkserver" if self.num_workers else None,
        )
        self._loader, self._batch_size, self._held = iter(loader), batch_size, {}

    def close(self) -> None:
        """Stop the workers (a later batch starts them again from the current state)."""
        loader, self._loader, self._batch_size, self._held = self._loader, None, 0, {}
        shutdown = getattr(loader, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (at interpreter shutdown)
            self.close()

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: plain ints, strings and lists (a ``datasets`` source adds
        its own state dicts). A checkpoint of several ranks keeps each rank's, or all of
        them merged by :func:`merge_rank_states`."""
        streams = list(self._states)
        if self._local is not None:
            streams[0] = self._local.state()
        for i, s in enumerate(streams):
            if s is None:  # a reader that has not started
                streams[i] = ReaderStream(self._plan, i, None).state()
        return {
            "version": STATE_VERSION,
            "format": self._plan.fmt,
            "key": self._plan.key,
            "rank": self.rank,
            "world_size": self.world_size,
            "workers": self.num_workers,
            "next": self._next,
            "streams": streams,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (this rank's, or :func:`merge_rank_states`' of all)."""
        if isinstance(state, dict) and "ranks" in state:
            ranks = state["ranks"]
            if len(ranks) != self.world_size:
                raise LlmkitError(
                    f"streamed data: the checkpoint has {len(ranks)} rank(s), this run "
                    f"{self.world_size}; resume with the same number of ranks"
                )
            state = ranks[self.rank]
        try:
            version, key, world = state["version"], state["key"], state["world_size"]
            workers, nxt, streams = state["workers"], int(state["next"]), list(state["streams"])
        except (KeyError, TypeError, ValueError) as exc:
            raise LlmkitError(f"bad streamed-data state: {first_line(exc, typed=True)}") from exc
        if version != STATE_VERSION:
            raise LlmkitError(f"streamed-data state version {version} is not {STATE_VERSION}")
        if world != self.world_size or workers != self.num_workers:
            raise LlmkitError(
                f"streamed data was saved by {world} rank(s) × {workers} worker(s), this run "
                f"has {self.world_size} × {self.num_workers}; resume with the same numbers"
            )
        if key != self._plan.key:
            raise LlmkitError(
                "streamed data: the files, their sizes, the seed, block size or lanes changed "
                "since the checkpoint; its position cannot be resumed"
            )
        if len(streams) != self.readers or not 0 <= nxt < self.readers:
            raise LlmkitError("bad streamed-data state: wrong number of readers")
        self.close()
        self._states, self._next, self._local = streams, nxt, None


def merge_rank_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One state for all ranks (``states[r]``: rank ``r``'s :meth:`StreamSampler.state_dict`);
    every rank's :meth:`~StreamSampler.load_state_dict` takes its own part."""
    ranks = sorted(states, key=lambda s: int(s["rank"]))
    if [int(s["rank"]) for s in ranks] != list(range(len(ranks))):
        raise LlmkitError("streamed data: a merged state needs exactly one state per rank")
    return {"ranks": ranks}


def validation_ids(
    files: Sequence[str | os.PathLike[str]] | Any,
    *,
    fmt: str,
    tokenizer: Tokenizer | str,
    text_field: str = "text",
    held_out: float | None = None,
    max_bytes: int = HELD_OUT_MAX_BYTES,
    eos_id: int | None = None,
) -> np.ndarray:
    """The validation tokens (int32, each document followed by the EOS) of a streamed source.

    ``held_out`` None: ``files`` are validation files (``val_paths``, or a
    ``datasets.IterableDataset``), read from their start up to ``max_bytes`` of text.
    ``held_out`` a fraction: the tail of the training ``files`` that a
    :class:`StreamSampler` with the same ``held_out`` and ``held_out_max_bytes=max_bytes``
    never reads (see :func:`~llmkit.data.stream_readers.split_held_out`)."""
    tok_json, eos = _tokenizer_json(tokenizer, eos_id)
    if fmt == DATASET:
        pieces: Iterator[tuple[Any, ...]] = dataset_pieces(files, 0, 0, None, text_field)
        where = "the validation dataset"
    else:
        paths = _paths(files, fmt, text_field)
        if held_out is None:
            ranges = split_held_out(paths, fmt, 0.0, max_bytes)[0]
        else:
            ranges = split_held_out(paths, fmt, held_out, max_bytes)[1]
        pieces = (
            p for r in ranges for p in read_pieces(paths[r.file], fmt, r, r.start, text_field)
        )
        where = ", ".join(str(p) for p in paths[:3])
    encode, out, group, n_bytes = Encoder(tok_json, eos), [], [], 0
    for piece in pieces:  # up to the piece that reaches max_bytes
        group.append(piece)
        n_bytes += len(piece[0].encode("utf-8"))
        if len(group) == ENCODE_PIECES or n_bytes >= max_bytes:
            out.extend(encode(group))
            group = []
        if n_bytes >= max_bytes:
            break
    out.extend(encode(group) if group else [])
    if not out:
        raise LlmkitError(f"streamed data: no validation text in {where}")
    return np.concatenate(out).astype(np.int32)
