"""Adafactor: factored second-moment estimates (Shazeer & Stern 2018), via torch's own."""

from __future__ import annotations

import torch
from pydantic import Field, field_validator
from torch import nn

from llmkit.optim import Adafactor, OptimizerOptions, param_groups_for, set_initial_lr


class Options(OptimizerOptions):
    """Adafactor options (``torch.optim.Adafactor``)."""

    lr: float = Field(
        1e-2, gt=0, description="Upper bound of the relative step size ρ_t = min(lr, 1/√t)"
    )
    beta2_decay: float = Field(
        -0.8, le=0.0, description="Exponent of the second-moment decay β2_t = 1 − t^beta2_decay"
    )
    eps: tuple[float | None, float] = Field(
        (None, 1e-3),
        description="(ε1 added to squared gradients, None: dtype eps; ε2 floor of param RMS)",
    )
    d: float = Field(1.0, ge=1.0, description="Update clipping threshold")

    @field_validator("eps")
    @classmethod
    def _eps_non_negative(cls, eps: tuple[float | None, float]) -> tuple[float | None, float]:
        if (eps[0] is not None and eps[0] < 0) or eps[1] < 0:
            raise ValueError("eps values must be ≥ 0")
        return eps


def build(model: nn.Module, options: Options) -> torch.optim.Optimizer:
    """``torch.optim.Adafactor`` over the model's decay / no-decay groups.

    Weight decay is decoupled: ``p ← p·(1 − lr·weight_decay)``.
    """
    optimizer = Adafactor(
        param_groups_for(model, options),
        lr=options.lr,
        beta2_decay=options.beta2_decay,
        eps=options.eps,
        d=options.d,
        weight_decay=options.weight_decay,
    )
    return set_initial_lr(optimizer)
