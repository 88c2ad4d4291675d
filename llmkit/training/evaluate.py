"""Loss and perplexity, per token and per byte.

The loss is the training objective (:class:`~llmkit.training.objective.Objective`): the
model's cross-entropy, or the spec's ``loss`` component evaluated exactly as a training step
computes it. Perplexity and the per-byte figures always come from the cross-entropy, so they
compare across objectives and tokenizers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from llmkit.model import Transformer
from llmkit.training.objective import Objective


@dataclass
class EvalResult:
    """Token-weighted means: ``loss`` is the objective; ``cross_entropy`` is set when the
    objective is another loss than the model's cross-entropy."""

    loss: float  # mean objective per predicted token (nats for cross-entropy)
    tokens: int
    text_bytes: int | None = None
    cross_entropy: float | None = None

    @property
    def ce(self) -> float:
        """Mean cross-entropy per predicted token (nats)."""
        return self.loss if self.cross_entropy is None else self.cross_entropy

    @property
    def ppl(self) -> float:
        return math.exp(min(self.ce, 80.0))

    @property
    def nats_per_byte(self) -> float | None:
        if not self.text_bytes:
            return None
        return self.ce * self.tokens / self.text_bytes

    @property
    def bits_per_byte(self) -> float | None:
        npb = self.nats_per_byte
        return None if npb is None else npb / math.log(2)

    def as_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {
            "loss": self.loss,
            "ppl": self.ppl,
            "tokens": self.tokens,
            "bytes": self.text_bytes,
            "bits_per_byte": self.bits_per_byte,
        }
        if self.cross_entropy is not None:
            out["cross_entropy"] = self.cross_entropy
        return out


@torch.no_grad()
def evaluate_batches(
    model: Transformer,
    batches: Iterable[tuple[Tensor, Tensor]],
    device: torch.device,
    amp: AbstractContextManager | None = None,
    objective: Objective | None = None,
) -> EvalResult:
    """Token-weighted mean of ``objective`` (default: the model's cross-entropy) over
    ``batches``, and of the cross-entropy beside another objective; targets of -100 are not
    counted. The model is left in the mode it was in."""
    objective = objective or Objective()
    objective.to(device)
    was_training = model.training
    model.eval()
    total, total_ce, count = 0.0, 0.0, 0
    try:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            with amp or nullcontext():
                out = objective(model, x, y, cross_entropy=True)
            n = int((y != -100).sum())
            total += float(out.loss) * n
            if out.cross_entropy is not None and not objective.is_cross_entropy:
                total_ce += float(out.cross_entropy) * n
            count += n
    finally:
        model.train(was_training)
    ce = None if objective.is_cross_entropy else total_ce / max(count, 1)
    return EvalResult(total / max(count, 1), count, cross_entropy=ce)


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
