"""Lion: EvoLved Sign Momentum (Chen et al. 2023, "Symbolic Discovery of Optimization
Algorithms")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from llmkit.components.optimizer.options import LionOptions as Options
from llmkit.optim import EagerOptimizer, param_groups_for, set_initial_lr


class Lion(EagerOptimizer):
    """Lion with decoupled weight decay.

    Per step: ``u = sign(β1·m + (1−β1)·g)``; ``p ← p − lr·(u + wd·p)``;
    ``m ← β2·m + (1−β2)·g``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be ≥ 0, got {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                grad = p.grad
                update = exp_avg.lerp(grad, 1.0 - beta1).sign_()
                if wd != 0:
                    p.mul_(1.0 - lr * wd)
                p.add_(update, alpha=-lr)
                exp_avg.lerp_(grad, 1.0 - beta2)
        return loss


def build(model: nn.Module, options: Options) -> torch.optim.Optimizer:
    """:class:`Lion` over the model's decay / no-decay groups."""
    optimizer = Lion(
        param_groups_for(model, options),
        lr=options.lr,
        betas=options.betas,
        weight_decay=options.weight_decay,
    )
    return set_initial_lr(optimizer)
