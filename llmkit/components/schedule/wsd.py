"""Warmup-stable-decay (Hu et al. 2024, MiniCPM; Hägele et al. 2024 for the 1−√ cooldown)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field

from llmkit.optim import ScheduleOptions, check_steps, decay_curve, linear_warmup


class Options(ScheduleOptions):
    """WSD schedule options."""

    decay_fraction: float = Field(
        0.2, gt=0.0, le=1.0, description="Fraction of total_steps spent in the final decay"
    )
    decay_shape: Literal["linear", "cosine", "sqrt"] = Field(
        "linear", description="Decay curve: linear, cosine, or 1−√(progress) (sqrt)"
    )

    def stable_end(self, max_steps: int) -> int:
        """Where the decay of a run of ``max_steps`` steps starts (:func:`stable_end`)."""
        return stable_end(max_steps, self.decay_fraction)


def stable_end(total_steps: int, decay_fraction: float) -> int:
    """The last step of the stable phase: the decay takes the last
    ``max(1, round(decay_fraction · total_steps))`` steps. A shorter run branched off a
    longer one's stable phase there is that shorter run exactly (``branch_budgets``)."""
    return total_steps - max(1, round(decay_fraction * total_steps))


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
