"""Loss and perplexity, per token and per byte."""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.model import Transformer


@dataclass
class EvalResult:
    loss: float  # mean nats per predicted token
    tokens: int
    text_bytes: int | None = None

    @property
    def ppl(self) -> float:
        return math.exp(min(self.loss, 80.0))

    @property
    def nats_per_byte(self) -> float | None:
        if not self.text_bytes:
            return None
        return self.loss * self.tokens / self.text_bytes

    @property
    def bits_per_byte(self) -> float | None:
        npb = self.nats_per_byte
        return None if npb is None else npb / math.log(2)

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "loss": self.loss,
            "ppl": self.ppl,
            "tokens": self.tokens,
            "bytes": self.text_bytes,
            "bits_per_byte": self.bits_per_byte,
        }


@torch.no_grad()
def evaluate_batches(
    model: Transformer,
    batches: Iterable[tuple[Tensor, Tensor]],
    device: torch.device,
    amp: AbstractContextManager | None = None,
) -> EvalResult:
    """Token-weighted mean cross-entropy over ``batches`` (the model is left as it was)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            with amp or nullcontext():
                out = model(x, y)
            n = int((y != -100).sum())
            total += float(out.loss) * n
            count += n
    finally:
        model.train(was_training)
    return EvalResult(total / max(count, 1), count)


def full_text_batches(
    tokens: Tensor, block_size: int, batch_size: int
) -> Iterable[tuple[Tensor, Tensor]]:
    """Every token of a sequence, in non-overlapping windows (the last one padded with
    ignored targets), so per-byte figures cover the whole text."""
    n = tokens.numel()
    starts = list(range(0, max(n - 1, 0), block_size))
    for i in range(0, len(starts), batch_size):
        xs, ys = [], []
        for s in starts[i : i + batch_size]:
            chunk = tokens[s : s + block_size + 1]
            x, y = chunk[:-1], chunk[1:]
            pad = block_size - x.numel()
            xs.append(torch.cat([x, x.new_zeros(pad)]))
            ys.append(torch.cat([y, y.new_full((pad,), -100)]))
        yield torch.stack(xs), torch.stack(ys)
