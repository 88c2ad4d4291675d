"""The training step: one optimizer step exactly as the trainer takes it.

:class:`TrainStep` is public so that the training benchmarks time this same function
(:mod:`llmkit.bench.training`): the learning-rate factor, ``grad_accum`` micro-batches of
forward and backward under autocast (a grad scaler for fp16; gradients all-reduced only on
the last micro-batch; each micro-batch weighted by its share of the step's trained
targets), gradient clipping, the reported values averaged over ranks in one transfer, and
the optimizer step — unless the loss or the gradient is not finite, in which case the
update is dropped and the result says so (the caller decides to stop or skip).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from llmkit import hardware
from llmkit.optim import set_lr_factor
from llmkit.spec import ResolvedSpec
from llmkit.training.objective import Objective
from llmkit.training.strategy import ParallelStrategy

#: The target id that trains nothing (``ignore_index`` of the cross-entropy).
IGNORE = -100


def resolve_precision(
    requested: str, device: torch.device, rs: ResolvedSpec, tokens: int | None
) -> str:
    """``train.precision`` for a step of ``tokens`` tokens a micro-batch: ``auto`` goes by
    the hardware and, on a CPU with fast bf16, by the model's feed-forward product (``tokens``
    × d_model × 4·d_model; :func:`llmkit.hardware.choose_precision`), the measurement kept
    beside the CPU's peaks. ``tokens=None`` decides by the hardware alone (no measurement)."""
    from llmkit.data.store import PEAKS_FILE, store_root

    if tokens is None:
        return hardware.choose_precision(requested, device)
    d = rs.model.d_model
    cache = store_root() / PEAKS_FILE
    return hardware.choose_precision(requested, device, (tokens, d, 4 * d), cache)


@dataclass
class StepResult:
    """What one step did: the objective (mean over micro-batches and ranks), the gradient
    norm before clipping, every auxiliary loss and metric as ``aux/<path>`` and
    ``metric/<path>``, and whether the update was applied."""

    loss: float
    grad_norm: float
    reported: dict[str, float] = field(default_factory=dict)
    applied: bool = True


def _detached(value: Any) -> Any:
    """A reported value as a detached scalar (tensor or float), without a device sync."""
    if isinstance(value, torch.Tensor):
        return value.detach().float().mean()
    return float(value)


class TrainStep:
    """One optimizer step of ``model``: call it with a function returning the next
    ``(inputs, targets)`` micro-batch (called ``grad_accum`` times) and, optionally, the
    learning-rate factor of this step.

    ``wrapped`` is what the strategy made of ``model`` (a DDP wrapper, or ``model`` sharded
    in place) and ``forward`` what is called (``wrapped``, or ``torch.compile`` of it);
    without a ``strategy`` the step runs on one process on the model's device. The grad
    scaler (fp16) is ``scaler``; the trainer saves and restores its state.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        objective: Objective | None = None,
        strategy: ParallelStrategy | None = None,
        precision: str = "fp32",
        grad_accum: int = 1,
        grad_clip: float | None = None,
        wrapped: nn.Module | None = None,
        forward: Callable[..., Any] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        if strategy is None:  # one process, on the model's device
            strategy = ParallelStrategy.single(next(model.parameters()).device)
        self.strategy = strategy
        self.device = self.strategy.device
        self.objective = (objective or Objective()).to(self.device)
        self.precision = precision
        self.grad_accum = grad_accum
        self.clip = grad_clip if grad_clip is not None else math.inf
        self.wrapped = wrapped if wrapped is not None else model
        self.forward = forward if forward is not None else self.wrapped
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None

    def _target_weights(self, targets: list[Tensor]) -> list[float]:
        """Each micro-batch's share of the step's trained targets (those not -100) over
        every micro-batch and rank, times the number of ranks (data-parallel gradients are
        averaged over ranks): the step's objective is then the mean over all its trained
        targets, however unevenly masks and padding spread them. A micro-batch with none
        adds only its auxiliary losses; a step with none keeps 1/n each (the objective's
        value for no targets, not finite for the model's cross-entropy, decides)."""
        counts = [int((y != IGNORE).sum()) for y in targets]
        total = sum(counts)
        if self.strategy.distributed:
            total = int(self.strategy.sum([float(total)])[0])
        if total == 0:
            return [1.0 / len(targets)] * len(targets)
        return [self.strategy.world_size * c / total for c in counts]

    def __call__(
        self, next_batch: Callable[[], tuple[Tensor, Tensor]], lr_factor: float | None = None
    ) -> StepResult:
        if lr_factor is not None:
            set_lr_factor(self.optimizer, lr_factor)
        if not self.model.training:  # (a recursive call: ≈ 0.5 ms a step on a small model)
            self.model.train()
        n = self.grad_accum
        batches = [next_batch() for _ in range(n)]
        weights = self._target_weights([y for _, y in batches])
        loss_sum = torch.zeros((), device=self.device)
        aux_sums: dict[str, Any] = {}
        metric_sums: dict[str, Any] = {}
        for micro, ((x, y), weight) in enumerate(zip(batches, weights, strict=True)):
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            with self.strategy.grad_sync(self.wrapped, micro == n - 1):  # all-reduce once
                with hardware.autocast(self.device, self.precision):
                    out = self.objective(self.forward, x, y)
                    # A micro-batch without trained targets has weight 0 (its mean, NaN for
                    # the cross-entropy, zeroed): its backward still runs, and all-reduces.
                    loss = (out.loss if weight else out.loss.nan_to_num(0.0)) * weight
                    for value in out.aux_losses.values():
                        loss = loss + value / n
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
            if weight:
                loss_sum += out.loss.detach().float() * weight
            for k, v in out.aux_losses.items():
                aux_sums[k] = aux_sums.get(k, 0.0) + _detached(v) / n
            for k, v in out.metrics.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + _detached(v) / n
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        grad_norm = self.strategy.full_tensor(grad_norm)
        # Everything reported, averaged over ranks, in one transfer (one sync).
        names = [f"aux/{k}" for k in aux_sums] + [f"metric/{k}" for k in metric_sums]
        loss_value, *values = self.strategy.mean(
            [loss_sum, *aux_sums.values(), *metric_sums.values()]
        )
        result = StepResult(loss_value, float(grad_norm), dict(zip(names, values)))
        # Without a scaler any non-finite value drops the update. With one (fp16), gradients
        # that overflow are the scaler's business (it skips the update and lowers the
        # scale); a non-finite loss is not, and is reported like any other.
        finite = math.isfinite(loss_value) and (
            self.scaler is not None or math.isfinite(result.grad_norm)
        )
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler is not None:
                self.scaler.update()  # closes this step's unscale_; the scale drops too
            result.applied = False
            return result
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return result
