"""Worker threads for block-local attention (:mod:`llmkit.kernels.block_local`).

A large CPU call splits its work into *parts* (runs of whole (batch, kv head) pairs).
:func:`run_parts` lets the calling thread and a few pool threads take parts one after the
other, each worker with its share of torch's intra-op threads (one on a 2-core machine).
Each op then runs on one core, so no op waits at an OpenMP barrier for a thread the OS has
descheduled; a slow worker only holds up its last part. On a shared machine this keeps
thousands of small matmuls from losing most of their time at barriers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

#: Calls computing at least this many attention scores use worker threads.
PARALLEL_SCORES = 1 << 20
#: At most this many workers (each then runs ``torch.get_num_threads() // workers`` torch
#: threads): beyond a few, Python's lock would serialize the ops' dispatch.
MAX_WORKERS = 8

#: A part's work: ``work(p0, p1, state)``, ``state`` a worker's own buffers, reused.
Work = Callable[[int, int, dict[str, Tensor]], None]

_POOL: tuple[ThreadPoolExecutor, int] | None = None  # the pool and its size
_POOL_LOCK = threading.Lock()


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist there."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def workers_for(device: torch.device, scores: int, heads: int) -> int:
    """Workers for a call: on a CPU, torch's intra-op thread count (at most
    :data:`MAX_WORKERS`, at most one per head) if the call computes at least
    :data:`PARALLEL_SCORES` scores; else 1 (the ops then use torch's own threads)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads < 2 or scores < PARALLEL_SCORES or heads < 2:
        return 1
    return min(threads, heads, MAX_WORKERS)


def _pool(size: int) -> ThreadPoolExecutor:
    """The module's thread pool, grown to at least ``size`` threads."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[1] < size:
            _POOL = (ThreadPoolExecutor(size, thread_name_prefix="llmkit-attention"), size)
        return _POOL[0]


def run_parts(parts: Sequence[tuple[int, int]], workers: int, work: Work) -> None:
    """Run ``work`` on every part.

    One worker (or one part): in this thread, on torch's intra-op threads. Several: this
    thread and ``workers − 1`` pool threads, each with ``torch.get_num_threads() // workers``
    torch threads and grad mode off, take the next part when done. This thread's torch
    thread count is restored afterwards; an exception in any worker reaches the caller."""
    if workers < 2 or len(parts) < 2:
        state: dict[str, Tensor] = {}
        for p0, p1 in parts:
            work(p0, p1, state)
        return
    queue = iter(parts)
    lock = threading.Lock()
    threads = torch.get_num_threads()
    inner = max(1, threads // workers)

    def drain() -> None:
        torch.set_num_threads(inner)
        try:
            state: dict[str, Tensor] = {}
            with torch.no_grad():
                while True:
                    with lock:
                        part = next(queue, None)
                    if part is None:
                        return
                    work(*part, state)
        finally:
            torch.set_num_threads(threads)

    futures = [_pool(workers - 1).submit(drain) for _ in range(workers - 1)]
    try:
        drain()
    finally:
        for future in futures:
            future.result()
