"""Batches from token files: packed blocks in a seeded per-epoch order, i.i.d. windows, and
the fixed validation blocks; each sampler's position is a few integers (exact resume)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from llmkit.data.tokens import TokenFile
from llmkit.errors import LlmkitError

if TYPE_CHECKING:
    import torch


def _as_array(data: TokenFile | np.ndarray) -> np.ndarray:
    return data.array if isinstance(data, TokenFile) else np.asarray(data)


def _blocks(array: np.ndarray, starts: np.ndarray, block_size: int) -> tuple[Any, Any]:
    import torch

    index = starts[:, None] + np.arange(block_size + 1)[None, :]
    block = torch.from_numpy(array[index].astype(np.int64))
    return block[:, :-1].contiguous(), block[:, 1:].contiguous()


def count_blocks(n_tokens: int, block_size: int, what: str) -> int:
    """Whole blocks of ``block_size`` (+1 target) tokens in ``n_tokens``; an error naming
    ``what`` when there is not even one."""
    if block_size < 1:
        raise LlmkitError(f"block_size must be positive, got {block_size}")
    if n_tokens < block_size + 1:
        raise LlmkitError(
            f"{what}: corpus shorter than one block: {n_tokens} tokens < block_size+1 "
            f"({block_size + 1}); use more text or a smaller data.block_size"
        )
    return (n_tokens - 1) // block_size


class _Sampler(ABC):
    """What every training sampler holds: the tokens, the block size, the seed and this
    rank's place; construction fails clearly for a bad rank or a corpus under one block."""

    def __init__(
        self,
        data: TokenFile | np.ndarray,
        block_size: int,
        seed: int = 0,
        *,
        rank: int = 0,
        world_size: int = 1,
        name: str = "train",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.data = data
        self.block_size = block_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.n_blocks = count_blocks(len(data), block_size, f"{name} split")
        self._start(name)

    @abstractmethod
    def _start(self, name: str) -> None:
        """What a sampler adds to the shared state (its position), set up at construction."""


class BlockSampler(_Sampler):
    """Packed training blocks: block ``i`` is tokens ``[s + i·B, s + i·B + B + 1)`` for
    ``B = block_size`` (x = block[:-1], y = block[1:]), visited in a permutation seeded by
    ``(seed, epoch)``; the grid offset ``s`` is 0 in the first epoch and a seeded shift
    within the spare tokens afterwards. With ``world_size > 1`` rank ``r`` takes every
    ``world_size``-th block of the permutation from ``r`` on: disjoint shares of equal size,
    and one step of N ranks reads exactly the blocks one process reads with an N× batch."""

    def _start(self, name: str) -> None:
        ws = self.world_size
        if self.n_blocks >= 2 * ws:  # keep a block spare so epochs can shift the grid
            self.n_blocks -= 1
        self.spare = len(self.data) - 1 - self.n_blocks * self.block_size
        self.blocks_per_rank = self.n_blocks // ws
        if self.blocks_per_rank == 0:
            raise LlmkitError(
                f"{name} split: {self.n_blocks} block(s) of {self.block_size} tokens cannot be "
                f"shared by {ws} ranks"
            )
        self.epoch = 0
        self.index = 0
        self._order_epoch = -1
        self._order = np.zeros(0, np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """This rank's block indices for ``epoch``."""
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed % 2**63, epoch])
            perm = rng.permutation(self.n_blocks)
            used = self.blocks_per_rank * self.world_size
            self._order = perm[self.rank : used : self.world_size]
            self._order_epoch = epoch
        return self._order

    def _next(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The next block indices and the epoch each belongs to."""
        blocks, epochs = [], []
        need = batch_size
        while need:
            if self.index >= self.blocks_per_rank:
                self.epoch += 1
                self.index = 0
            take = self.order(self.epoch)[self.index : self.index + need]
            blocks.append(take)
            epochs.append(np.full(len(take), self.epoch))
            self.index += len(take)
            need -= len(take)
        return np.concatenate(blocks), np.concatenate(epochs)

    def next_indices(self, batch_size: int) -> np.ndarray:
        """The next ``batch_size`` block indices, moving to the next epoch as needed."""
        return self._next(batch_size)[0]

    def shift(self, epoch: int) -> int:
        """Where the block grid starts in ``epoch``: 0 in the first epoch, then a seeded
        offset, so later epochs cut the text at new places."""
        if epoch == 0 or self.spare == 0:
            return 0
        return int(np.random.default_rng([self.seed % 2**63, epoch, 1]).integers(self.spare + 1))

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, LongTensors of shape (batch_size, block_size)."""
        blocks, epochs = self._next(batch_size)
        shifts = np.array([self.shift(int(e)) for e in epochs], dtype=np.int64)
        return _blocks(_as_array(self.data), blocks * self.block_size + shifts, self.block_size)

    @property
    def tokens_per_epoch(self) -> int:
        """Tokens this rank sees per epoch (inputs only)."""
        return self.blocks_per_rank * self.block_size

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": int(self.epoch),
            "index": int(self.index),
            "world_size": int(self.world_size),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position; one saved by another number of ranks maps to the same place
        in the epoch (ranks move in lockstep, so ``index · world_size`` blocks are done)."""
        try:
            epoch, index = int(state["epoch"]), int(state["index"])
            saved_world = int(state.get("world_size", 1))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            msg = f"bad sampler state {state!r}: needs integer epoch and index"
            raise LlmkitError(msg) from exc
        if saved_world != self.world_size and saved_world > 0:
            index = index * saved_world // self.world_size
        if epoch < 0 or not 0 <= index <= self.blocks_per_rank:
            raise LlmkitError(
                f"sampler state {state!r} does not fit this data "
                f"({self.blocks_per_rank} blocks per rank)"
            )
        self.epoch, self.index = epoch, index


class RandomWindowSampler(_Sampler):
    """Windows of ``block_size + 1`` tokens starting anywhere, drawn i.i.d. (nanoGPT's
    ``get_batch``). Batch ``n`` is a function of ``(seed, rank, n)`` alone, so the state is
    one counter and a resumed run draws exactly the batches an uninterrupted one would."""

    def _start(self, name: str) -> None:
        self.draws = 0

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed % 2**63, self.rank, self.draws, 2])
        self.draws += 1
        high = len(self.data) - self.block_size  # last valid start + 1
        starts = rng.integers(0, high, size=batch_size)
        return _blocks(_as_array(self.data), starts, self.block_size)

    def state_dict(self) -> dict[str, int]:
        return {"draws": int(self.draws)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.draws = int(state["draws"])
        except (KeyError, TypeError, ValueError) as exc:
            raise LlmkitError(f"bad sampler state {state!r}") from exc


def make_sampler(
    kind: str, data: TokenFile | np.ndarray, block_size: int, seed: int, **kw: Any
) -> BlockSampler | RandomWindowSampler:
    """The training sampler named by ``data.sampling``."""
    cls = RandomWindowSampler if kind == "random" else BlockSampler
    return cls(data, block_size, seed, **kw)


def eval_batches(
    token_file: TokenFile | np.ndarray, block_size: int, batch_size: int, n_batches: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` batches of blocks evenly spaced over the file — the same blocks every
    time. A file with fewer blocks gives each block once (the last batch may be short)."""
    array = _as_array(token_file)
    avail = count_blocks(len(array), block_size, "validation split")
    want = batch_size * n_batches
    if avail <= want:
        blocks = np.arange(avail)
    else:
        blocks = np.round(np.linspace(0, avail - 1, want)).astype(np.int64)
    for i in range(0, len(blocks), batch_size):
        yield _blocks(array, blocks[i : i + batch_size] * block_size, block_size)
