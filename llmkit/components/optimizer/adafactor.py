"""Adafactor: factored second-moment estimates (Shazeer & Stern 2018), via torch's own."""

from __future__ import annotations

import torch
from torch import nn

from llmkit.components.optimizer.options import AdafactorOptions as Options
from llmkit.optim import Adafactor, param_groups_for, set_initial_lr


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
