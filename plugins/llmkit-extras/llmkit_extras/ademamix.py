"""AdEMAMix (Pagliardini, Ablin & Grangier 2024, "The AdEMAMix Optimizer: Better, Faster,
Older").

Adam's momentum is one EMA of the gradients with β1 ≈ 0.9, which forgets a gradient in ~10
steps. AdEMAMix adds a second, *slow* EMA (β3 ≈ 0.9999, a memory of ~10⁴ steps) and mixes it
into the numerator with weight α; old gradients stay useful for much longer than Adam
assumes, and the paper reports that a 1.3B-parameter model trained on 101B tokens with
AdEMAMix matches an AdamW model trained on 197B tokens. Per parameter, at step t:

    m1 ← β1·m1 + (1−β1)·g            (fast EMA, bias-corrected as in Adam)
    m2 ← β3·m2 + (1−β3)·g            (slow EMA, not bias-corrected)
    ν  ← β2·ν  + (1−β2)·g²
    p  ← p − lr·( (m̂1 + α·m2) / (√ν̂ + ε) + wd·p )

A large β3 from the first step destabilizes early training, so the paper warms α up linearly
from 0 and β3 up from β1 (linearly in half-life) over ``T_α,β3`` steps — which the paper
sets to the whole run. The optimizer does not know the run's length: set
``alpha_beta3_warmup`` to ``train.max_steps`` to follow the paper. Memory: one more state
tensor per parameter than AdamW (three in all).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from llmkit import param_groups_for, set_initial_lr
from llmkit_extras.options import AdEMAMixOptions as Options


def alpha_at(step: int, alpha: float, warmup: int | None) -> float:
    """α after ``step`` updates: linear from 0 to ``alpha`` over ``warmup`` steps."""
    if not warmup or step >= warmup:
        return alpha
    return alpha * step / warmup


def beta3_at(step: int, beta1: float, beta3: float, warmup: int | None) -> float:
    """β3 after ``step`` updates: from β1 to β3 over ``warmup`` steps, linear in the EMA's
    half-life (the paper's scheduler, ``exp(ln β1 · ln β3 / ((1−a)·ln β3 + a·ln β1))``)."""
    if not warmup or step >= warmup or beta3 <= beta1:
        return beta3
    a = step / warmup
    lb1, lb3 = math.log(beta1), math.log(beta3)
    return min(math.exp(lb1 * lb3 / ((1.0 - a) * lb3 + a * lb1)), beta3)


class AdEMAMix(torch.optim.Optimizer):
    """AdEMAMix with decoupled weight decay (Pagliardini et al. 2024); see the module doc."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        alpha_beta3_warmup: int | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if len(betas) != 3 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be three numbers in [0, 1), got {betas}")
        if alpha < 0:
            raise ValueError(f"alpha must be ≥ 0, got {alpha}")
        if alpha_beta3_warmup is not None and alpha_beta3_warmup < 1:
            raise ValueError(f"alpha_beta3_warmup must be ≥ 1, got {alpha_beta3_warmup}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "alpha": alpha,
            "alpha_beta3_warmup": alpha_beta3_warmup,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2, beta3_final = group["betas"]
            warmup = group["alpha_beta3_warmup"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("AdEMAMix does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg_fast"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_slow"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                alpha = alpha_at(t, group["alpha"], warmup)
                beta3 = beta3_at(t, beta1, beta3_final, warmup)
                fast, slow, sq = state["exp_avg_fast"], state["exp_avg_slow"], state["exp_avg_sq"]
                fast.lerp_(grad, 1.0 - beta1)
                slow.lerp_(grad, 1.0 - beta3)
                sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = (sq / (1.0 - beta2**t)).sqrt_().add_(eps)
                update = (fast / (1.0 - beta1**t)).add_(slow, alpha=alpha).div_(denom)
                if wd != 0:
                    update.add_(p, alpha=wd)
                p.add_(update, alpha=-lr)
        return loss


def build(model: nn.Module, options: Options) -> torch.optim.Optimizer:
    """:class:`AdEMAMix` over the model's decay / no-decay groups."""
    optimizer = AdEMAMix(
        param_groups_for(model, options),
        lr=options.lr,
        betas=options.betas,
        alpha=options.alpha,
        alpha_beta3_warmup=options.alpha_beta3_warmup,
        eps=options.eps,
        weight_decay=options.weight_decay,
    )
    return set_initial_lr(optimizer)
