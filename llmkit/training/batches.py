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
    **kw: Any,
) -> Any:
    """The sampler of ``data.sampling`` over the training tokens; for a mixture, a
    :class:`MixtureSampler` over one such sampler per source."""
    if not data.parts:
        return make_sampler(sampling, data.train, block_size, seed, **kw)
    samplers = [
        make_sampler(sampling, p.train, block_size, (seed * SEED_STRIDE + i) % 2**63, **kw)
        for i, p in enumerate(data.parts)
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


def token_counts(data: PreparedData) -> tuple[int, int]:
    """Training and validation tokens over every source."""
    if not data.parts:
        return len(data.train), len(data.validation)
    return sum(len(p.train) for p in data.parts), sum(len(p.validation) for p in data.parts)


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
