"""Batches from token files: packed blocks in a seeded per-epoch order, i.i.d. windows, padded
rows of one document each, and the fixed validation batches; each sampler's position is a
few integers (exact resume).

Data with a loss mask (:attr:`TokenFile.mask`, chat data) gets targets of -100 wherever the
mask is 0, and no row is ever drawn without a trained target, so no batch, and no rank's
share of one, is wholly ignored. Data without one takes exactly the plain paths."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from llmkit.data.tokens import TokenFile
from llmkit.errors import LlmkitError

if TYPE_CHECKING:
    import torch


#: The target value the loss ignores.
IGNORE = -100


def _as_array(data: TokenFile | np.ndarray) -> np.ndarray:
    return data.array if isinstance(data, TokenFile) else np.asarray(data)


def _blocks(
    array: np.ndarray, starts: np.ndarray, block_size: int, pin: bool = False
) -> tuple[Any, Any]:
    """Inputs and targets of the blocks of ``block_size + 1`` tokens at ``starts``: one
    gather of the stored ids, each half widened to int64 straight into its tensor (in
    page-locked memory when ``pin``, for a copy to a GPU that the host does not wait for)."""
    import torch

    index = starts[:, None] + np.arange(block_size + 1)[None, :]
    block = np.asarray(array[index])
    x = torch.empty((len(starts), block_size), dtype=torch.int64, pin_memory=pin)
    y = torch.empty((len(starts), block_size), dtype=torch.int64, pin_memory=pin)
    x.numpy()[...] = block[:, :-1]
    y.numpy()[...] = block[:, 1:]
    return x, y


def _masked_blocks(
    array: np.ndarray, mask: np.ndarray, starts: np.ndarray, block_size: int, pin: bool = False
) -> tuple[Any, Any]:
    """As :func:`_blocks`, with -100 for the targets the mask leaves out."""
    import torch

    index = starts[:, None] + np.arange(block_size + 1)[None, :]
    block = array[index].astype(np.int64)
    y = np.where(mask[index[:, 1:]] != 0, block[:, 1:], IGNORE)
    x = torch.from_numpy(np.ascontiguousarray(block[:, :-1]))
    return _pinned(x, pin), _pinned(torch.from_numpy(y), pin)


def _pinned(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """``t``, in page-locked memory when ``pin``."""
    return t.pin_memory() if pin else t


def _mask_of(data: TokenFile | np.ndarray, mask: np.ndarray | None) -> np.ndarray | None:
    """The loss mask: ``mask`` if given, else the token file's (None: every target)."""
    if mask is None:
        return data.mask if isinstance(data, TokenFile) else None
    mask = np.asarray(mask)
    if len(mask) != len(data):
        raise ValueError(f"the mask has {len(mask)} entries for {len(data)} tokens")
    return mask


def _bounds_of(data: TokenFile | np.ndarray, bounds: Any, what: str) -> np.ndarray:
    """Document offsets: ``bounds`` if given, else the token file's, else after each EOS
    of a plain token file; an error when none are known."""
    if bounds is not None:
        return np.asarray(bounds, np.int64)
    if isinstance(data, TokenFile):
        docs = data.doc_bounds
        if docs is not None:
            return np.asarray(docs)
        eos = data.meta.get("eos_id")
        if eos is not None:
            ends = np.flatnonzero(data.array == eos) + 1
            out = np.concatenate([[0], ends]).astype(np.int64)
            return out if out[-1] == len(data) else np.append(out, len(data))
    raise LlmkitError(
        f"{what}: data.sampling = 'padded' needs document boundaries (a chat dataset, or "
        "documents separated by the tokenizer's EOS)"
    )


def trainable_blocks(mask: np.ndarray, offset: int, n_blocks: int, block_size: int) -> np.ndarray:
    """Indices of the blocks ``[offset + i·B, offset + i·B + B + 1)`` that hold at least one
    trained target."""
    targets = np.asarray(mask[offset + 1 : offset + 1 + n_blocks * block_size])
    return np.flatnonzero(targets.reshape(n_blocks, block_size).any(axis=1))


def padded_examples(
    bounds: np.ndarray, mask: np.ndarray | None, block_size: int
) -> tuple[np.ndarray, int, int]:
    """For one document per row of ``block_size``: the documents that keep a trained target
    once cut to ``block_size + 1`` tokens, how many documents are cut, and how many are
    left out (none of their targets within the row is trained, or under 2 tokens)."""
    starts, ends = bounds[:-1], bounds[1:]
    lengths = ends - starts
    cut = np.minimum(lengths, block_size + 1)
    keep = cut >= 2
    kept = np.flatnonzero(keep)
    if mask is not None and len(kept):
        # the targets of row j are mask[lo_j:hi_j]; one reduceat over [lo_0, hi_0, lo_1, ...]
        # (strictly increasing) gives every row's maximum at the even places
        edges = np.empty(2 * len(kept), np.int64)
        edges[0::2] = starts[kept] + 1
        edges[1::2] = starts[kept] + cut[kept]
        if edges[-1] >= len(mask):  # the last row runs to the end of the mask anyway
            edges = edges[:-1]
        keep[kept] = np.maximum.reduceat(np.asarray(mask), edges)[0::2] > 0
    used = np.flatnonzero(keep)
    return used, int((lengths > block_size + 1).sum()), int(len(lengths) - len(used))


def _padded_rows(
    array: np.ndarray,
    mask: np.ndarray | None,
    bounds: np.ndarray,
    docs: np.ndarray,
    block_size: int,
    pad_id: int,
    pin: bool = False,
) -> tuple[Any, Any]:
    """One document per row (its first ``block_size + 1`` tokens), padded on the right with
    ``pad_id`` inputs and ignored targets."""
    import torch

    x = np.full((len(docs), block_size), pad_id, np.int64)
    y = np.full((len(docs), block_size), IGNORE, np.int64)
    for row, doc in enumerate(docs):
        s = int(bounds[doc])
        e = min(int(bounds[doc + 1]), s + block_size + 1)
        ids = array[s:e].astype(np.int64)
        n = len(ids) - 1
        x[row, :n] = ids[:-1]
        y[row, :n] = ids[1:] if mask is None else np.where(mask[s + 1 : e] != 0, ids[1:], IGNORE)
    return _pinned(torch.from_numpy(x), pin), _pinned(torch.from_numpy(y), pin)


def _pad_id(data: TokenFile | np.ndarray) -> int:
    eos = data.meta.get("eos_id") if isinstance(data, TokenFile) else None
    return int(eos) if eos is not None else 0


def _shard(perm: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s share: every ``world_size``-th entry from ``rank`` on, all shares of
    one size."""
    used = len(perm) // world_size * world_size
    return perm[rank:used:world_size]


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
    """What every training sampler holds: the tokens, their loss mask (None: all targets
    trained), the block size, the seed and this rank's place; construction fails clearly
    for a bad rank or a corpus under one block."""

    def __init__(
        self,
        data: TokenFile | np.ndarray,
        block_size: int,
        seed: int = 0,
        *,
        rank: int = 0,
        world_size: int = 1,
        name: str = "train",
        mask: np.ndarray | None = None,
        bounds: np.ndarray | None = None,
        pin_memory: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.data = data
        self.block_size = block_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.mask = _mask_of(data, mask)
        self._bounds = bounds
        #: Batches are built in page-locked memory (for a CUDA device: copied without the
        #: host waiting); needs a CUDA build of torch.
        self.pin_memory = pin_memory
        self.n_blocks = self._count(name)
        self._start(name)

    def _count(self, name: str) -> int:
        """How many blocks the data holds."""
        return count_blocks(len(self.data), self.block_size, f"{name} split")

    @abstractmethod
    def _start(self, name: str) -> None:
        """What a sampler adds to the shared state (its position), set up at construction."""


class BlockSampler(_Sampler):
    """Packed training blocks: block ``i`` is tokens ``[s + i·B, s + i·B + B + 1)`` for
    ``B = block_size`` (x = block[:-1], y = block[1:]), visited in a permutation seeded by
    ``(seed, epoch)``; the grid offset ``s`` is 0 in the first epoch and a seeded shift
    within the spare tokens afterwards. With ``world_size > 1`` rank ``r`` takes every
    ``world_size``-th block of the permutation from ``r`` on: disjoint shares of equal size,
    and one step of N ranks reads exactly the blocks one process reads with an N× batch.
    With a loss mask, an epoch visits only the blocks of its grid holding a trained target
    (so its length may differ from epoch to epoch by a few blocks)."""

    def _start(self, name: str) -> None:
        ws = self.world_size
        self._shifts: dict[int, int] = {}  # each epoch's grid offset, once computed
        if self.n_blocks >= 2 * ws:  # keep a block spare so epochs can shift the grid
            self.n_blocks -= 1
        self.spare = len(self.data) - 1 - self.n_blocks * self.block_size
        self._share(name, f"block(s) of {self.block_size} tokens")
        if self.mask is not None:
            self.blocks_per_rank = len(self.order(0))

    def _share(self, name: str, units: str) -> None:
        """Deal the ``n_blocks`` units out to the ranks (an error when a rank would get none)
        and start at the beginning of epoch 0."""
        self.blocks_per_rank = self.n_blocks // self.world_size
        if self.blocks_per_rank == 0:
            raise LlmkitError(
                f"{name} split: {self.n_blocks} {units} cannot be shared by {self.world_size} ranks"
            )
        self.epoch = 0
        self.index = 0
        self._order_epoch = -1
        self._order = np.zeros(0, np.int64)
        self._name = name

    def order(self, epoch: int) -> np.ndarray:
        """This rank's block indices for ``epoch``."""
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed % 2**63, epoch])
            if self.mask is None:
                perm = rng.permutation(self.n_blocks)
            else:
                offset = self.shift(epoch)
                valid = trainable_blocks(self.mask, offset, self.n_blocks, self.block_size)
                if len(valid) < self.world_size:
                    raise LlmkitError(
                        f"{self._name} split: {len(valid)} block(s) of {self.block_size} tokens "
                        f"hold a trained target; too few for {self.world_size} rank(s)"
                    )
                perm = valid[rng.permutation(len(valid))]
            self._order = _shard(perm, self.rank, self.world_size)
            self._order_epoch = epoch
        return self._order

    def _next(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The next block indices and the epoch each belongs to."""
        blocks, epochs = [], []
        need = batch_size
        while need:
            if self.index >= len(self.order(self.epoch)):
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
        known = self._shifts
        if epoch not in known:
            rng = np.random.default_rng([self.seed % 2**63, epoch, 1])
            offset = int(rng.integers(self.spare + 1))
            if self.mask is not None:  # a grid with too few trained blocks: epoch 0's grid
                valid = trainable_blocks(self.mask, offset, self.n_blocks, self.block_size)
                offset = offset if len(valid) >= self.world_size else 0
            known[epoch] = offset
        return known[epoch]

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, LongTensors of shape (batch_size, block_size)."""
        blocks, epochs = self._next(batch_size)
        shifts = np.array([self.shift(int(e)) for e in epochs], dtype=np.int64)
        starts = blocks * self.block_size + shifts
        pin, array = self.pin_memory, _as_array(self.data)
        if self.mask is not None:
            return _masked_blocks(array, self.mask, starts, self.block_size, pin)
        return _blocks(array, starts, self.block_size, pin)

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
        per_rank = len(self.order(epoch)) if epoch >= 0 else 0
        if epoch < 0 or not 0 <= index <= per_rank:
            raise LlmkitError(
                f"sampler state {state!r} does not fit this data ({per_rank} blocks per rank)"
            )
        self.epoch, self.index = epoch, index


class PaddedSampler(BlockSampler):
    """One document per row: its first ``block_size + 1`` tokens (longer ones are cut), the
    rest of the row padded with ignored targets. Documents are visited in a permutation
    seeded by ``(seed, epoch)`` and shared out across ranks as :class:`BlockSampler`'s
    blocks (same state, same exact resume); documents without a trained target within the
    row are left out. ``truncated`` and ``skipped`` count the documents cut and left out."""

    def _count(self, name: str) -> int:
        self.bounds = _bounds_of(self.data, self._bounds, f"{name} split")
        if len(self.bounds) < 1 or int(self.bounds[-1]) != len(self.data):
            raise ValueError("document bounds do not cover the tokens")
        self.examples, self.truncated, self.skipped = padded_examples(
            self.bounds, self.mask, self.block_size
        )
        if len(self.examples) == 0:
            raise LlmkitError(
                f"{name} split: no document has a trained token within its first "
                f"{self.block_size + 1} tokens (data.block_size)"
            )
        return len(self.examples)

    def _start(self, name: str) -> None:
        self.spare = 0
        self._share(name, "document(s)")
        self._pad = _pad_id(self.data)

    def order(self, epoch: int) -> np.ndarray:
        """This rank's document indices for ``epoch``."""
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed % 2**63, epoch])
            perm = self.examples[rng.permutation(self.n_blocks)]
            self._order = _shard(perm, self.rank, self.world_size)
            self._order_epoch = epoch
        return self._order

    def shift(self, epoch: int) -> int:
        return 0

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, LongTensors of shape (batch_size, block_size)."""
        docs = self._next(batch_size)[0]
        array = _as_array(self.data)
        return _padded_rows(
            array, self.mask, self.bounds, docs, self.block_size, self._pad, self.pin_memory
        )


class RandomWindowSampler(_Sampler):
    """Windows of ``block_size + 1`` tokens starting anywhere, drawn i.i.d. (nanoGPT's
    ``get_batch``). Batch ``n`` is a function of ``(seed, rank, n)`` alone, so the state is
    one counter and a resumed run draws exactly the batches an uninterrupted one would.
    With a loss mask, windows without a trained target are drawn again."""

    #: With a mask: candidate windows drawn per batch row before giving up.
    max_tries = 1000

    def _start(self, name: str) -> None:
        self.draws = 0
        if self.mask is not None and not np.any(self.mask[1:]):
            raise LlmkitError(f"{name} split: no token is a trained target")

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed % 2**63, self.rank, self.draws, 2])
        self.draws += 1
        high = len(self.data) - self.block_size  # last valid start + 1
        if self.mask is None:
            starts = rng.integers(0, high, size=batch_size)
            return _blocks(_as_array(self.data), starts, self.block_size, self.pin_memory)
        starts = self._trained_starts(rng, high, batch_size)
        array = _as_array(self.data)
        return _masked_blocks(array, self.mask, starts, self.block_size, self.pin_memory)

    def _trained_starts(self, rng: np.random.Generator, high: int, n: int) -> np.ndarray:
        found: list[np.ndarray] = []
        have = 0
        width = np.arange(1, self.block_size + 1)
        for _ in range(self.max_tries):
            cand = rng.integers(0, high, size=n)
            ok = cand[np.asarray(self.mask[cand[:, None] + width[None, :]]).any(axis=1)]
            found.append(ok)
            have += len(ok)
            if have >= n:
                return np.concatenate(found)[:n]
        raise LlmkitError(
            f"no window of {self.block_size} tokens with a trained target in "
            f"{self.max_tries} tries; use data.sampling = 'packed'"
        )

    def state_dict(self) -> dict[str, int]:
        return {"draws": int(self.draws)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.draws = int(state["draws"])
        except (KeyError, TypeError, ValueError) as exc:
            raise LlmkitError(f"bad sampler state {state!r}") from exc


SAMPLERS: dict[str, type[_Sampler]] = {
    "packed": BlockSampler,
    "random": RandomWindowSampler,
    "padded": PaddedSampler,
}


def make_sampler(
    kind: str, data: TokenFile | np.ndarray, block_size: int, seed: int, **kw: Any
) -> BlockSampler | RandomWindowSampler:
    """The training sampler named by ``data.sampling``."""
    cls = SAMPLERS.get(kind, BlockSampler)
    return cls(data, block_size, seed, **kw)  # type: ignore[return-value]


def _spread(items: np.ndarray, want: int) -> np.ndarray:
    """``want`` entries of ``items`` evenly spaced (all of them if there are no more)."""
    if len(items) <= want:
        return items
    return items[np.round(np.linspace(0, len(items) - 1, want)).astype(np.int64)]


def eval_rows(
    token_file: TokenFile | np.ndarray,
    block_size: int,
    *,
    layout: str | None = None,
    mask: np.ndarray | None = None,
    bounds: np.ndarray | None = None,
) -> np.ndarray:
    """What evaluation may use, in file order: the blocks (packed layout; with a mask, those
    holding a trained target) or documents (padded layout, those keeping a trained target
    in their row). A one-line error when there is none."""
    mask = _mask_of(token_file, mask)
    if (layout or getattr(token_file, "layout", "packed")) == "padded":
        docs_bounds = _bounds_of(token_file, bounds, "validation split")
        examples = padded_examples(docs_bounds, mask, block_size)[0]
        if len(examples) == 0:
            raise LlmkitError(
                "validation split: no document has a trained token within its first "
                f"{block_size + 1} tokens (data.block_size)"
            )
        return examples
    avail = count_blocks(len(token_file), block_size, "validation split")
    if mask is None:
        return np.arange(avail)
    blocks = trainable_blocks(mask, 0, avail, block_size)
    if len(blocks) == 0:
        raise LlmkitError(
            f"validation split: no block of {block_size} tokens holds a trained target"
        )
    return blocks


def eval_batches(
    token_file: TokenFile | np.ndarray,
    block_size: int,
    batch_size: int,
    n_batches: int,
    *,
    layout: str | None = None,
    mask: np.ndarray | None = None,
    bounds: np.ndarray | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` batches of blocks evenly spaced over the file — the same blocks every
    time. A file with fewer blocks gives each block once (the last batch may be short).

    ``layout`` (default: the token file's) ``"padded"`` gives one document per row, evenly
    spaced over the documents. With a loss mask, targets outside it are -100 and only
    blocks or documents holding a trained target are used (:func:`eval_rows`)."""
    array = _as_array(token_file)
    mask = _mask_of(token_file, mask)
    layout = layout or getattr(token_file, "layout", "packed")
    if layout == "padded":
        bounds = _bounds_of(token_file, bounds, "validation split")
    found = eval_rows(token_file, block_size, layout=layout, mask=mask, bounds=bounds)
    rows = _spread(found, batch_size * n_batches)
    if layout == "padded":
        pad = _pad_id(token_file)
        for i in range(0, len(rows), batch_size):
            yield _padded_rows(array, mask, bounds, rows[i : i + batch_size], block_size, pad)
        return
    cut = _blocks if mask is None else partial(_masked_blocks, mask=mask)
    for i in range(0, len(rows), batch_size):
        yield cut(array, starts=rows[i : i + batch_size] * block_size, block_size=block_size)
