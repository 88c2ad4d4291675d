"""AdamW: Adam with decoupled weight decay (Loshchilov & Hutter 2019)."""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from llmkit.optim import Beta, OptimizerOptions, param_groups_for, set_initial_lr


class Options(OptimizerOptions):
    """AdamW options."""

    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="Moment decay rates (β1, β2)")
    eps: float = Field(1e-8, gt=0, description="Denominator epsilon")
    fused: bool | None = Field(
        None, description="Use the fused kernel (None: torch's default implementation)"
    )


def build(model: nn.Module, options: Options) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` over the model's decay / no-decay groups."""
    optimizer = torch.optim.AdamW(
        param_groups_for(model, options),
        lr=options.lr,
        betas=options.betas,
        eps=options.eps,
        weight_decay=options.weight_decay,
        fused=options.fused,
    )
    return set_initial_lr(optimizer)
