"""The readers of streamed data at work (:mod:`llmkit.data.streaming`): each reader's
lanes, their shards in the seeded epoch order, tokenizing and packing into rows, and the
position that rebuilds all of it (:meth:`ReaderStream.state`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.data.stream_readers import DATASET, Range, dataset_pieces, read_pieces
from llmkit.errors import LlmkitError

#: Pieces tokenized in one call (at most :data:`ENCODE_CHARS` characters).
ENCODE_PIECES = 64
ENCODE_CHARS = 1 << 15


@dataclass
class StreamPlan:
    """What every reader of one rank needs (pickled into the workers)."""

    fmt: str
    paths: list[str]
    dataset: Any  # this rank's split of a datasets.IterableDataset (fmt "dataset")
    text_field: str
    shards: list[Range]
    shares: list[list[int]]  # per reader of this rank: its shard indices
    first: int  # global index of this rank's reader 0
    lanes: int
    seed: int
    block_size: int
    tokenizer_json: str
    eos: int | None
    key: str = field(default="")  # changes with anything a saved position depends on


class Encoder:
    """Token ids of pieces (int32, the EOS after a document's last piece); the tokenizer is
    built from its JSON on first use, in the process that uses it (a DataLoader worker)."""

    def __init__(self, tokenizer_json: str, eos: int | None) -> None:
        self.json, self.eos = tokenizer_json, eos
        self._tok: Any = None
        self._table: Any = None

    def __call__(self, pieces: list[tuple[Any, ...]]) -> list[np.ndarray]:
        if self._tok is None:
            from llmkit.data.tokenizer import Tokenizer

            self._tok = Tokenizer.from_str(self.json)
            self._table = self._tok.char_table()
        out: list[Any] = [None] * len(pieces)
        slow = []
        for i, piece in enumerate(pieces):
            out[i] = self._table.encode(piece[0]) if self._table is not None else None
            if out[i] is None:
                slow.append(i)
        if slow:
            for i, ids in zip(slow, self._tok.encode_batch([pieces[i][0] for i in slow])):
                out[i] = ids
        result = []
        for ids, piece in zip(out, pieces):
            arr = np.asarray(ids, dtype=np.int32)
            if piece[3] and self.eos is not None:
                arr = np.append(arr, np.int32(self.eos))
            result.append(arr)
        return result


class Lane:
    """One open shard: its place in the epoch order, its reader, and the tokenized pieces
    ahead (``queue[0]`` holds the next row's first token, at index ``k``)."""

    def __init__(self, epoch: int, index: int, offset: int, k: int, extra: Any = None) -> None:
        self.epoch, self.index, self.offset, self.k, self.extra = epoch, index, offset, k, extra
        self.reader: Iterator[tuple[Any, ...]] | None = None
        self.queue: deque[tuple[int, np.ndarray, Any]] = deque()
        self.found = False  # whether the open shard gave any text

    def state(self) -> list[Any]:
        start, _, extra = self.queue[0] if self.queue else (self.offset, None, self.extra)
        out: list[Any] = [self.epoch, self.index, int(start), int(self.k)]
        return [*out, extra] if extra is not None else out


class ReaderStream:
    """One reader's rows: its share of the shards, cycled epoch after epoch, read by its
    lanes in turn (see the module docstring)."""

    def __init__(self, plan: StreamPlan, reader: int, state: dict[str, Any] | None) -> None:
        self.plan, self.reader = plan, reader
        self.share = plan.shares[reader]
        self.encode = Encoder(plan.tokenizer_json, plan.eos)
        self._orders: dict[int, list[int]] = {}
        self._empty = 0
        if state is None:
            self.epoch, self.index, self.lane = 0, 0, 0
            self.lanes = []
            for _ in range(min(plan.lanes, len(self.share))):
                e, i = self._take()
                self.lanes.append(Lane(e, i, plan.shards[self._order(e)[i]].start, 0))
        else:
            self.epoch, self.index, self.lane = state["epoch"], state["index"], state["lane"]
            self.lanes = [Lane(*s) for s in state["lanes"]]

    def state(self) -> dict[str, Any]:
        lanes = [lane.state() for lane in self.lanes]
        return {"epoch": self.epoch, "index": self.index, "lane": self.lane, "lanes": lanes}

    def _order(self, epoch: int) -> list[int]:
        """The shards of epoch ``epoch``, in its seeded order."""
        if epoch not in self._orders:
            if len(self._orders) > 4:
                self._orders.pop(min(self._orders))
            g = self.plan.first + self.reader
            rng = np.random.default_rng([self.plan.seed % 2**63, g, epoch, 7])
            self._orders[epoch] = [self.share[i] for i in rng.permutation(len(self.share))]
        return self._orders[epoch]

    def _take(self) -> tuple[int, int]:
        """The next shard of the epoch order (epoch, index)."""
        out = (self.epoch, self.index)
        self.index += 1
        if self.index == len(self.share):
            self.epoch, self.index = self.epoch + 1, 0
        return out

    def _open(self, lane: Lane) -> Iterator[tuple[Any, ...]]:
        plan = self.plan
        if plan.fmt == DATASET:
            return dataset_pieces(
                plan.dataset, lane.epoch, lane.offset, lane.extra, plan.text_field
            )
        shard = plan.shards[self._order(lane.epoch)[lane.index]]
        path = Path(plan.paths[shard.file])
        return read_pieces(path, plan.fmt, shard, lane.offset, plan.text_field)

    def _fill(self, lane: Lane) -> None:
        """Tokenize the lane's next pieces, moving it to its next shard as needed."""
        while not lane.queue:
            if lane.reader is None:
                lane.reader, lane.found = self._open(lane), False
            group, chars = [], 0
            for piece in lane.reader:
                group.append(piece)
                chars += len(piece[0])
                if len(group) >= ENCODE_PIECES or chars >= ENCODE_CHARS:
                    break
            if group:
                lane.found, self._empty = True, 0
                extras = [p[4] if len(p) > 4 else None for p in group]
                for p, ids, extra in zip(group, self.encode(group), extras):
                    lane.queue.append((p[1], ids, extra))
                continue
            if not lane.found:
                self._empty += 1
                if self._empty > len(self.share) + len(self.lanes):
                    g = self.plan.first + self.reader
                    raise LlmkitError(
                        f"streamed data: reader {g} found no text in its {len(self.share)} "
                        "shard(s); use fewer ranks or workers"
                    )
            lane.epoch, lane.index = self._take()
            lane.offset = self.plan.shards[self._order(lane.epoch)[lane.index]].start
            lane.reader, lane.k, lane.extra = None, 0, None
            if self.plan.fmt == DATASET:
                lane.offset = 0

    def _row(self, lane: Lane, out: np.ndarray) -> None:
        need, at = len(out), 0
        while True:
            self._fill(lane)
            ids = lane.queue[0][1]
            take = min(need, len(ids) - lane.k)
            out[at : at + take] = ids[lane.k : lane.k + take]
            at, need, lane.k = at + take, need - take, lane.k + take
            if need == 0:
                break
            lane.queue.popleft()
            lane.k = 0
        lane.k -= 1  # the row's last token is the next row's first

    def rows(self, n: int) -> np.ndarray:
        """The next ``n`` rows of ``block_size + 1`` tokens."""
        out = np.empty((n, self.plan.block_size + 1), dtype=np.int64)
        for i in range(n):
            self._row(self.lanes[self.lane], out[i])
            self.lane = (self.lane + 1) % len(self.lanes)
        return out
