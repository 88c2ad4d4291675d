"""Where a run's batches come from: the training sampler for its prepared data (one source,
or a mixture's samplers, one per source) and the validation sets it is evaluated on."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmkit.data import PreparedData, TokenFile, eval_rows, make_sampler
from llmkit.data.mixture import MixtureSampler

#: Seeds of a mixture's per-source samplers are ``seed * SEED_STRIDE + i``, so no two
#: sources draw the same permutation from equal seeds.
SEED_STRIDE = 1_000_003


@dataclass
class ValidationSet:
    """One set the run is evaluated on: a mixture's source (``name``) or the only one."""

    name: str | None
    weight: float
    tokens: TokenFile


def training_sampler(
    data: PreparedData,
    sampling: str,
    block_size: int,
    seed: int,
    *,
    stream_workers: int = 0,
    **kw: Any,
) -> Any:
    """The sampler of ``data.sampling`` over the training tokens (a
    :class:`~llmkit.data.streaming.StreamSampler` for a streamed source, reading with
    ``stream_workers`` DataLoader workers); for a mixture, a :class:`MixtureSampler` over
    one such sampler per source."""

    def one(train: Any, stream: Any, seed: int) -> Any:
        if stream is None:
            return make_sampler(sampling, train, block_size, seed, **kw)
        from llmkit.data.stream_prepare import held_out
        from llmkit.data.streaming import StreamSampler

        return StreamSampler(
            stream["train"],
            fmt=stream["format"],
            text_field=stream["text_field"],
            tokenizer=data.tokenizer,
            block_size=block_size,
            seed=seed,
            rank=kw.get("rank", 0),
            world_size=kw.get("world_size", 1),
            num_workers=stream_workers,
            pin_memory=kw.get("pin_memory", False),
            held_out=held_out(stream),
        )

    if not data.parts:
        return one(data.train, data.stream, seed)
    samplers = [
        one(p.train, p.stream, (seed * SEED_STRIDE + i) % 2**63) for i, p in enumerate(data.parts)
    ]
    return MixtureSampler([p.name for p in data.parts], [p.weight for p in data.parts], samplers)


def validation_sets(data: PreparedData) -> list[ValidationSet]:
    """The validation sets: each source of a mixture with its weight, else the one."""
    if not data.parts:
        return [ValidationSet(None, 1.0, data.validation)]
    return [ValidationSet(p.name, p.weight, p.validation) for p in data.parts]


def check_validation(data: PreparedData, block_size: int) -> None:
    """Each validation set holds at least one block (fails now, not at the first
    evaluation)."""
    for v in validation_sets(data):
        eval_rows(v.tokens, block_size)


def token_counts(data: PreparedData) -> str:
    """``N train / M val tokens`` over every source (a streamed one's training tokens are
    not counted before they are read)."""
    parts = data.parts or [data]
    trains = [p.train for p in parts]
    val = sum(len(p.validation) for p in parts)
    if any(t is None for t in trains):
        known = sum(len(t) for t in trains if t is not None)
        return f"streamed{f' + {known:,}' if known else ''} train / {val:,} val tokens"
    return f"{sum(len(t) for t in trains):,} train / {val:,} val tokens"


def gathered_state(sampler: Any, strategy: Any) -> dict[str, Any]:
    """The sampler's position for a checkpoint. A streamed source's position differs per
    rank: with several ranks every rank's is kept (``{"ranks": [...]}``); the others are the
    same on every rank and kept once."""
    state = sampler.state_dict()
    if not strategy.distributed or not _per_rank(sampler):
        return state
    import torch.distributed as dist

    states: list[Any] = [None] * strategy.world_size
    dist.all_gather_object(states, (strategy.data_rank, state))
    # one per data-parallel rank (its tensor/context/pipeline peers read the same rows)
    kept: dict[int, Any] = {}
    for data_rank, s in states:
        kept.setdefault(data_rank, s)
    return {"ranks": [kept[r] for r in range(strategy.data_world)]}


def rank_state(state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's part of a position :func:`gathered_state` kept."""
    ranks = state.get("ranks") if isinstance(state, dict) else None
    if not isinstance(ranks, list):
        return state
    if len(ranks) != world_size:
        from llmkit.errors import LlmkitError

        raise LlmkitError(
            f"resume: the checkpoint's streamed data position is of {len(ranks)} "
            f"data-parallel ranks; resume it with {len(ranks)}, not {world_size}"
        )
    return ranks[rank]


def _per_rank(sampler: Any) -> bool:
    from llmkit.data.streaming import StreamSampler

    inner = getattr(sampler, "sampler", sampler)  # a traced sampler's
    parts = getattr(inner, "samplers", [inner])
    return any(isinstance(s, StreamSampler) for s in parts)


def close(sampler: Any) -> None:
    """Stop a sampler's worker processes (streamed sources), if it has any."""
    inner = getattr(sampler, "sampler", sampler)
    for s in getattr(inner, "samplers", [inner]):
        stop = getattr(s, "close", None)
        if callable(stop):
            stop()


#: ``LLMKIT_DATA_TRACE=DIR`` makes every rank append a line per training batch to
#: ``DIR/rank-<N>.jsonl`` (the step and a hash of each row's input ids): a test aid that
#: shows which rows each rank read.
TRACE_ENV = "LLMKIT_DATA_TRACE"


class TracedSampler:
    """A sampler whose batches are written down as they are drawn (:data:`TRACE_ENV`)."""

    def __init__(self, sampler: Any, path: Path) -> None:
        self.sampler, self.path = sampler, path
        path.parent.mkdir(parents=True, exist_ok=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)

    def next_batch(self, batch_size: int) -> Any:
        batch = self.sampler.next_batch(batch_size)
        rows = [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in batch[0].cpu()]
        with self.path.open("a") as f:
            f.write(json.dumps({"rows": rows}) + "\n")
        return batch


def traced(sampler: Any, rank: int) -> Any:
    """``sampler``, traced when :data:`TRACE_ENV` names a directory."""
    where = os.environ.get(TRACE_ENV)
    return TracedSampler(sampler, Path(where) / f"rank-{rank}.jsonl") if where else sampler
