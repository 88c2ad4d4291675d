"""Linear warmup then linear decay to a floor."""

from __future__ import annotations

from collections.abc import Callable

from llmkit.optim import ScheduleOptions, check_steps, decay_curve, linear_warmup


class Options(ScheduleOptions):
    """Linear-decay schedule options."""


def build(options: Options, *, total_steps: int, base_lr: float = 1.0) -> Callable[[int], float]:
    """Return ``step -> base_lr · factor``: warmup, a straight line from 1 at
    ``warmup_steps`` to ``min_lr_ratio`` at ``total_steps``, then ``min_lr_ratio``."""
    check_steps(options.warmup_steps, total_steps, "linear")
    warmup, floor = options.warmup_steps, options.min_lr_ratio
    span = total_steps - warmup

    def factor(step: int) -> float:
        if step < warmup:
            return base_lr * linear_warmup(step, warmup)
        if step >= total_steps:
            return base_lr * floor
        progress = (step - warmup) / span
        return base_lr * (floor + (1.0 - floor) * decay_curve(progress, "linear"))

    return factor
