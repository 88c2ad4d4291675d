"""Stochastic gradient descent with optional (Nesterov) momentum (Sutskever et al. 2013)."""

from __future__ import annotations

import torch
from torch import nn

from llmkit.components.optimizer.options import SGDOptions as Options
from llmkit.optim import SGD, param_groups_for, set_initial_lr


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
