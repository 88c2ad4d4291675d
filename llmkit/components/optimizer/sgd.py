"""Stochastic gradient descent with optional (Nesterov) momentum (Sutskever et al. 2013)."""

from __future__ import annotations

from typing import Self

import torch
from pydantic import Field, model_validator
from torch import nn

from llmkit.optim import SGD, Beta, OptimizerOptions, param_groups_for, set_initial_lr


class Options(OptimizerOptions):
    """SGD options."""

    momentum: Beta = Field(0.9, description="Momentum coefficient (0: plain SGD)")
    nesterov: bool = Field(False, description="Use Nesterov momentum")
    dampening: float = Field(0.0, ge=0.0, le=1.0, description="Dampening of the momentum")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> Self:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov momentum requires momentum > 0 and dampening = 0")
        return self


def build(model: nn.Module, options: Options) -> torch.optim.Optimizer:
    """``torch.optim.SGD`` over the model's decay / no-decay groups.

    Weight decay is torch's coupled (L2) form, added to the gradient.
    """
    optimizer = SGD(
        param_groups_for(model, options),
        lr=options.lr,
        momentum=options.momentum,
        dampening=options.dampening,
        weight_decay=options.weight_decay,
        nesterov=options.nesterov,
    )
    return set_initial_lr(optimizer)
