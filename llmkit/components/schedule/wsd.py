"""Warmup-stable-decay (Hu et al. 2024, MiniCPM; Hägele et al. 2024 for the 1−√ cooldown)."""

from __future__ import annotations

from collections.abc import Callable

from llmkit.components.schedule.options import WSDOptions as Options
from llmkit.components.schedule.options import stable_end as stable_end
from llmkit.options import check_steps, decay_curve, linear_warmup


def build(options: Options, *, total_steps: int, base_lr: float = 1.0) -> Callable[[int], float]:
    """Return ``step -> base_lr · factor``: warmup, 1.0 until the last
    ``decay_fraction · total_steps`` steps, then a decay reaching ``min_lr_ratio`` at
    ``total_steps``."""
    check_steps(options.warmup_steps, total_steps, "wsd")
    warmup, floor, shape = options.warmup_steps, options.min_lr_ratio, options.decay_shape
    decay_start = stable_end(total_steps, options.decay_fraction)
    decay_steps = total_steps - decay_start
    if decay_start < warmup:
        raise ValueError(
            f"schedule 'wsd': warmup_steps ({warmup}) + decay steps ({decay_steps} = "
            f"decay_fraction {options.decay_fraction} × total_steps) exceed "
            f"total_steps ({total_steps})"
        )

    def factor(step: int) -> float:
        if step < warmup:
            return base_lr * linear_warmup(step, warmup)
        if step < decay_start:
            return base_lr
        progress = (step - decay_start) / decay_steps
        return base_lr * (floor + (1.0 - floor) * decay_curve(progress, shape))

    return factor
