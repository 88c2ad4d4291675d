"""Linear warmup then inverse-square-root decay (Vaswani et al. 2017)."""

from __future__ import annotations

import math
from collections.abc import Callable

from llmkit.components.schedule.options import InverseSqrtOptions as Options
from llmkit.options import check_steps, linear_warmup


def build(options: Options, *, total_steps: int, base_lr: float = 1.0) -> Callable[[int], float]:
    """Return ``step -> base_lr · factor``: warmup, then ``√(τ / (step − warmup_steps + τ))``
    (1.0 at the end of warmup; ``√(warmup_steps / step)`` for the default τ), never below
    ``min_lr_ratio``. Same form as Hugging Face's ``get_inverse_sqrt_schedule``."""
    check_steps(options.warmup_steps, total_steps, "inverse_sqrt")
    warmup, floor = options.warmup_steps, options.min_lr_ratio
    tau = options.timescale or warmup or 1

    def factor(step: int) -> float:
        if step < warmup:
            return base_lr * linear_warmup(step, warmup)
        return base_lr * max(floor, math.sqrt(tau / (step - warmup + tau)))

    return factor
