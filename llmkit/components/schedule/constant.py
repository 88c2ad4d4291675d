"""Constant learning rate after an optional linear warmup."""

from __future__ import annotations

from collections.abc import Callable

from llmkit.components.schedule.options import ConstantOptions as Options
from llmkit.options import check_steps, linear_warmup


def build(options: Options, *, total_steps: int, base_lr: float = 1.0) -> Callable[[int], float]:
    """Return ``step -> base_lr · factor``: linear warmup, then 1.0."""
    check_steps(options.warmup_steps, total_steps, "constant")
    warmup = options.warmup_steps

    def factor(step: int) -> float:
        return base_lr * linear_warmup(step, warmup)

    return factor
