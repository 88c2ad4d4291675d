"""REX schedule (Chen, Wolfe & Kyrillidis 2022, "REX: Revisiting Budgeted Training with an
Improved Schedule").

After a linear warmup, with progress p from 0 to 1 over the remaining steps:

    factor = min_lr_ratio + (1 − min_lr_ratio) · (1 − p) / (½ + ½·(1 − p))

The profile stays above a linear decay early (0.67 at half way, against 0.5) and drops
steeply at the end; the paper finds it matches or beats linear, cosine and step schedules
across budgets, most clearly for short ones. It decays to zero by default, as in the paper.
"""

from __future__ import annotations

from collections.abc import Callable

from llmkit import check_steps, linear_warmup
from llmkit_extras.options import RexOptions as Options


def rex(progress: float) -> float:
    """The REX curve: 1 at progress 0, 0 at progress 1 (clamped outside [0, 1])."""
    r = 1.0 - min(max(progress, 0.0), 1.0)
    return r / (0.5 + 0.5 * r)


def build(options: Options, *, total_steps: int, base_lr: float = 1.0) -> Callable[[int], float]:
    """Return ``step -> base_lr · factor``: warmup, then the REX decay from 1 at
    ``warmup_steps`` to ``min_lr_ratio`` at ``total_steps``, then ``min_lr_ratio``."""
    check_steps(options.warmup_steps, total_steps, "rex")
    warmup, floor = options.warmup_steps, options.min_lr_ratio
    span = max(total_steps - warmup, 1)

    def factor(step: int) -> float:
        if step < warmup:
            return base_lr * linear_warmup(step, warmup)
        return base_lr * (floor + (1.0 - floor) * rex((step - warmup) / span))

    return factor
