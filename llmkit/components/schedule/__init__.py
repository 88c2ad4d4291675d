"""Built-in learning-rate schedules.

Each module has an ``Options`` model and ``build(options, *, total_steps)`` returning the lr
factor (1.0 = the optimizer's base lr, reached at the end of warmup) for a 0-based step.
The options are in :mod:`llmkit.components.schedule.options`; like the schedules themselves
(and this package), they import no torch, so a spec's schedule is checked without it.
"""

from __future__ import annotations

from collections.abc import Callable

from llmkit.options import ScheduleOptions, check_steps, decay_curve, linear_warmup


def warmup_then_decay(
    options: ScheduleOptions, total_steps: int, base_lr: float, shape: str, schedule: str
) -> Callable[[int], float]:
    """``step -> base_lr · factor``: linear warmup, then a ``shape`` decay
    (:func:`~llmkit.options.decay_curve`) from 1 at ``warmup_steps`` to ``min_lr_ratio`` at
    ``total_steps``, then ``min_lr_ratio`` (the cosine and linear schedules)."""
    check_steps(options.warmup_steps, total_steps, schedule)
    warmup, floor = options.warmup_steps, options.min_lr_ratio
    span = total_steps - warmup

    def factor(step: int) -> float:
        if step < warmup:
            return base_lr * linear_warmup(step, warmup)
        if step >= total_steps:
            return base_lr * floor
        progress = (step - warmup) / span
        return base_lr * (floor + (1.0 - floor) * decay_curve(progress, shape))

    return factor
