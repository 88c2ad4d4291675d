"""Muon: MomentUm Orthogonalized by Newton–Schulz (Jordan et al. 2024, "Muon: An optimizer
for hidden layers in neural networks").

Hidden 2-D weight matrices get Muon updates; embeddings, the output head and 1-D parameters
(norms, biases) get AdamW (Loshchilov & Hutter 2019) inside the same optimizer object, so
``state_dict``/``load_state_dict`` and lr schedules see one optimizer. Groups are tagged
``use_muon``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from llmkit.components.optimizer.options import MuonOptions as Options
from llmkit.optim import EagerOptimizer, embedding_like, param_groups_for, set_initial_lr

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: Tensor, steps: int = 5, *, dtype: torch.dtype | None = None) -> Tensor:
    """Approximately orthogonalize a matrix (≈ U Vᵀ of its SVD) by a quintic Newton–Schulz
    iteration; singular values land roughly in [0.7, 1.2].

    Runs in ``dtype`` (default: bfloat16 on CUDA, float32 elsewhere) and returns that dtype.
    """
    if g.ndim != 2:
        raise ValueError(f"newton_schulz expects a matrix, got shape {tuple(g.shape)}")
    a, b, c = NS_COEFFICIENTS
    if dtype is None:
        dtype = torch.bfloat16 if g.is_cuda else torch.float32
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        A = x @ x.mT
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.mT if tall else x


class Muon(EagerOptimizer):
    """Muon for groups with ``use_muon=True`` (2-D parameters only), AdamW for the others.

    Muon step: ``m ← μ·m + (1−μ)·g``; ``u = (1−μ)·g + μ·m`` if nesterov else ``m``;
    ``p ← p·(1 − lr·wd) − lr·√max(1, rows/cols)·NS(u)``.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "weight_decay": weight_decay,
            "betas": betas,
            "eps": eps,
            "use_muon": False,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon groups may only hold 2-D parameters")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1.0 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            ortho = newton_schulz(update, group["ns_steps"]).to(p.dtype)
            scale = max(1.0, p.size(0) / p.size(1)) ** 0.5
            if wd != 0:
                p.mul_(1.0 - lr * wd)
            p.add_(ortho, alpha=-lr * scale)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t = state["step"]
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.lerp_(grad, 1.0 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            bias1 = 1.0 - beta1**t
            bias2 = 1.0 - beta2**t
            denom = (exp_avg_sq / bias2).sqrt_().add_(eps)
            if wd != 0:
                p.mul_(1.0 - lr * wd)
            p.addcdiv_(exp_avg, denom, value=-lr / bias1)


def build(model: nn.Module, options: Options) -> torch.optim.Optimizer:
    """:class:`Muon` with hidden 2-D weights on Muon and everything embedding-like
    (embeddings, ``lm_head``) or not 2-D on AdamW; weight decay follows
    :func:`llmkit.optim.param_groups` for both."""
    embeddings = embedding_like(model)
    adamw_lr = options.adamw_lr if options.adamw_lr is not None else options.lr
    groups: list[dict[str, Any]] = []
    for base in param_groups_for(model, options):
        hidden = [p for p in base["params"] if p.ndim == 2 and id(p) not in embeddings]
        other = [p for p in base["params"] if not (p.ndim == 2 and id(p) not in embeddings)]
        for use_muon, params in ((True, hidden), (False, other)):
            if params:
                groups.append(
                    {
                        **base,
                        "params": params,
                        "use_muon": use_muon,
                        "lr": options.lr if use_muon else adamw_lr,
                    }
                )
    optimizer = Muon(
        groups,
        lr=options.lr,
        momentum=options.momentum,
        nesterov=options.nesterov,
        ns_steps=options.ns_steps,
        weight_decay=options.weight_decay,
        betas=options.adamw_betas,
        eps=options.adamw_eps,
    )
    return set_initial_lr(optimizer)
