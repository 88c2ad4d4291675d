"""Tokenizing a store's documents: cut into pieces (the same whatever the number of workers),
each piece tokenized in this process or in a worker process with one thread.

A piece is :data:`PIECE_DOCS` documents or about :data:`PIECE_CHARS` characters, whichever
comes first; its result is its ids (an EOS after each document), the documents' lengths in
ids and their UTF-8 bytes."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any

import numpy as np

#: The most documents, and characters, in one piece of work.
PIECE_DOCS = 1024
PIECE_CHARS = 1 << 20


class PieceEncoder:
    """Texts -> (ids with an EOS after each document, document lengths, UTF-8 bytes of each
    document). Holds the tokenizer as JSON, so it pickles cheaply into workers."""

    def __init__(self, tokenizer_json: str, eos_id: int | None, dtype: str) -> None:
        self.tokenizer_json, self.eos_id, self.dtype = tokenizer_json, eos_id, np.dtype(dtype)
        self._tok: Any = None
        self._table: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None, "_table": None}

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        from llmkit.data.tokenizer import Tokenizer

        if self._tok is None:
            self._tok = Tokenizer.from_str(self.tokenizer_json)
            self._table = self._tok.char_table()
        fast = [self._table.encode(t) for t in texts] if self._table else [None] * len(texts)
        slow = [t for t, f in zip(texts, fast) if f is None]
        slow_ids = iter(self._tok.encode_batch(slow) if slow else [])
        ids = [f if f is not None else next(slow_ids) for f in fast]
        extra = 0 if self.eos_id is None else 1
        lengths = np.fromiter((len(x) + extra for x in ids), np.int64, count=len(ids))
        n_bytes = np.fromiter((len(t.encode("utf-8")) for t in texts), np.int64, count=len(texts))
        total = int(lengths.sum())
        bare = np.fromiter(chain.from_iterable(ids), self.dtype, count=total - extra * len(ids))
        if not extra:
            return bare, lengths, n_bytes
        out = np.empty(total, self.dtype)
        keep = np.ones(total, bool)
        keep[np.cumsum(lengths) - 1] = False
        out[keep] = bare
        out[~keep] = self.eos_id
        return out, lengths, n_bytes


_worker_encoder: PieceEncoder | None = None


def _init_worker(encoder: PieceEncoder, parent: int) -> None:
    """A worker tokenizes with one thread (the pieces are its parallelism) and ends when
    the process that started it is gone (a ``kill -9`` leaves no worker behind)."""
    global _worker_encoder
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_encoder = encoder
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    assert _worker_encoder is not None
    return _worker_encoder(texts)


def pieces(texts: Iterable[str]) -> Iterator[list[str]]:
    """The non-empty texts in pieces of at most :data:`PIECE_DOCS` documents and about
    :data:`PIECE_CHARS` characters (a longer document is a piece of its own)."""
    piece: list[str] = []
    chars = 0
    for text in texts:
        if not text:
            continue
        if piece and (len(piece) >= PIECE_DOCS or chars + len(text) > PIECE_CHARS):
            yield piece
            piece, chars = [], 0
        piece.append(text)
        chars += len(text)
    if piece:
        yield piece


def encoded(
    work: Iterator[tuple[int, list[str]]], encoder: PieceEncoder, workers: int
) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """``(k, encoder(texts))`` for each piece, in order: in this process for one worker,
    else in ``workers`` spawned processes with at most two pieces each in flight."""
    if workers <= 1:
        for k, texts in work:
            yield k, encoder(texts)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")  # a fork would copy tokenizers' thread pool
    pool = ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(encoder, os.getpid())
    )
    try:
        pending: deque[tuple[int, Any]] = deque()
        for k, texts in work:
            pending.append((k, pool.submit(_encode_in_worker, texts)))
            if len(pending) >= 2 * workers:
                k0, fut = pending.popleft()
                yield k0, fut.result()
        while pending:
            k0, fut = pending.popleft()
            yield k0, fut.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
