"""The options of the built-in schedules (torch-free, as the schedules are), each a
:class:`llmkit.options.WarmupOptions` or :class:`llmkit.options.ScheduleOptions`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from llmkit.options import ScheduleOptions, WarmupOptions


class ConstantOptions(WarmupOptions):
    """Constant schedule options (no floor: the lr never decays)."""


class CosineOptions(ScheduleOptions):
    """Cosine schedule options."""


class LinearOptions(ScheduleOptions):
    """Linear-decay schedule options."""


class WSDOptions(ScheduleOptions):
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


class InverseSqrtOptions(ScheduleOptions):
    """Inverse-sqrt schedule options."""

    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Floor of the lr as a fraction of the base lr"
    )
    timescale: int | None = Field(
        None, gt=0, description="Decay timescale in steps (None: warmup_steps, or 1)"
    )
