"""The training step: one optimizer step exactly as the trainer takes it.

:class:`TrainStep` is public so that the training benchmarks time this same function
(:mod:`llmkit.bench.training`): the learning-rate factor, ``grad_accum`` micro-batches of
forward and backward under autocast (a grad scaler for fp16; gradients all-reduced only on
the last micro-batch; each micro-batch weighted by its share of the step's trained
targets), gradient clipping, the reported values averaged over ranks in one transfer, and
the optimizer step — unless the loss or the gradient is not finite, in which case the
update is dropped and the result says so (the caller decides to stop or skip).

The host never waits for the device in a step whose optimizer takes torch's ``found_inf``
(the fused AdamW the ``adamw`` component builds on a CPU or a GPU, any optimizer with
``_step_supports_amp_scaling``): the non-finite check is a device tensor handed to the
optimizer, whose kernel then leaves weights, moments and step count as they were, and the
:class:`StepResult` is read only when asked (the trainer asks at its log, evaluation and
checkpoint steps). Any other optimizer, and fp16's grad scaler, read the check on the host
before stepping: one transfer a step (free on a CPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from llmkit import hardware
from llmkit.model.objective import Objective
from llmkit.optim import set_lr_factor
from llmkit.spec import ResolvedSpec
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


class StepResult:
    """What one step did: the objective (mean over micro-batches and ranks), the gradient
    norm before clipping, every auxiliary loss and metric as ``aux/<path>`` and
    ``metric/<path>``, whether the update was applied, and ``trained``: the step's trained
    targets (those not -100) over every micro-batch and rank (None when not counted).

    A step that left the non-finite check to the device returns its values as one device
    vector (:meth:`on_device`); the first attribute read copies it to the host, waiting for
    the step's kernels. :meth:`read_all` reads many results at one wait; :attr:`known`
    says whether reading costs a wait."""

    def __init__(
        self,
        loss: float,
        grad_norm: float,
        reported: dict[str, float] | None = None,
        applied: bool = True,
        trained: int | None = None,
    ) -> None:
        self._values: tuple[bool, float, float, dict[str, float], int | None] | None = (
            bool(applied),
            float(loss),
            float(grad_norm),
            dict(reported or {}),
            None if trained is None else int(trained),
        )
        self._packed: Tensor | None = None
        self._count: Tensor | None = None
        self._names: list[str] = []

    @classmethod
    def on_device(
        cls, packed: Tensor, names: Sequence[str], trained: Tensor | None = None
    ) -> StepResult:
        """A result still on the device: ``packed`` is the float vector ``[applied (1 or
        0), loss, grad_norm, *reported]``, ``names`` the reported values' names, ``trained``
        the step's count of trained targets (an integer scalar: exact at any size)."""
        result = cls.__new__(cls)
        result._values, result._packed, result._names = None, packed.detach(), list(names)
        result._count = None if trained is None else trained.detach().reshape(1)
        return result

    @property
    def known(self) -> bool:
        """Whether the values are on the host already (reading them waits for nothing)."""
        return self._values is not None

    def _fill(self, values: list[float], trained: int | None) -> None:
        applied, loss, grad_norm, *rest = values
        reported = dict(zip(self._names, rest, strict=True))
        self._values = (applied > 0.5, loss, grad_norm, reported, trained)
        self._packed = self._count = None

    def _read(self) -> tuple[bool, float, float, dict[str, float], int | None]:
        if self._values is None:
            StepResult.read_all([self])
        assert self._values is not None
        return self._values

    @staticmethod
    def read_all(results: Iterable[StepResult]) -> None:
        """Bring every result still on the device to the host (one wait: the counts of
        trained targets, integers, follow the values once those are read)."""
        pending = [r for r in results if r._values is None]
        if not pending:
            return
        assert all(r._packed is not None for r in pending)
        packs = [r._packed for r in pending]
        device = packs[0].device  # type: ignore[union-attr]
        flat = torch.cat([p.to(device) for p in packs]).tolist()  # type: ignore[union-attr]
        counted = [r._count.to(device) for r in pending if r._count is not None]
        counts = iter(torch.cat(counted).tolist() if counted else [])
        at = 0
        for r, p in zip(pending, packs, strict=True):
            n = p.numel()  # type: ignore[union-attr]
            r._fill(flat[at : at + n], int(next(counts)) if r._count is not None else None)
            at += n

    @property
    def applied(self) -> bool:
        return self._read()[0]

    @property
    def loss(self) -> float:
        return self._read()[1]

    @property
    def grad_norm(self) -> float:
        return self._read()[2]

    @property
    def reported(self) -> dict[str, float]:
        return self._read()[3]

    @property
    def trained(self) -> int | None:
        """The step's trained targets (not -100), all micro-batches and ranks; None when
        the step did not count them."""
        return self._read()[4]

    def __repr__(self) -> str:
        if self._values is None:
            return f"StepResult(<on {self._packed.device}, not read>)"  # type: ignore[union-attr]
        applied, loss, grad_norm, reported, trained = self._values
        return (
            f"StepResult(loss={loss!r}, grad_norm={grad_norm!r}, reported={reported!r}, "
            f"applied={applied!r}, trained={trained!r})"
        )


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` drops its own update when given ``found_inf``: torch's fused
    Adam/AdamW/SGD/Adagrad set ``_step_supports_amp_scaling`` (the flag the grad scaler
    goes by) and pass ``optimizer.found_inf`` to their kernel, which returns at once when
    it is nonzero — weights and moments untouched; the step count (Adam, AdamW, Adagrad),
    incremented before the kernel, is decremented by ``found_inf`` after it (torch 2.13:
    ``torch/optim/adam.py``, ``_fused_adam``). The host reads nothing."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


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
        #: The optimizer drops a non-finite step on the device (:func:`skips_on_device`).
        self.device_skip = skips_on_device(optimizer)
        self._pin = self.device.type == "cuda"

    def _target_weights(self, targets: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Each micro-batch's share of the step's trained targets (those not -100) over
        every micro-batch and rank, times the number of ranks (data-parallel gradients are
        averaged over ranks): the step's objective is then the mean over all its trained
        targets, however unevenly masks and padding spread them. A micro-batch with none
        adds only its auxiliary losses; a step with none keeps 1/n each (the objective's
        value for no targets, not finite for the model's cross-entropy, decides).

        A float32 vector on the step's device, counted there (the ranks' total by an
        all-reduce), and that total (int64: the step's trained targets): the host reads
        none of it."""
        counts = torch.stack([(y != IGNORE).sum() for y in targets])  # int64: exact
        total = self.strategy.sum_tensor(counts.sum())
        shares = counts.float() * self.strategy.world_size / total.float()
        trained = total // self.strategy.data_replicas  # tensor/pipeline peers count alike
        return torch.where(total > 0, shares, 1.0 / len(targets)), trained

    def _to_device(self, t: Tensor) -> Tensor:
        """A batch tensor on the step's device: a CPU tensor bound for a GPU is copied from
        page-locked memory (pinned here unless the sampler pinned it) without the host
        waiting (the pinned block is not reused before the copy is done: torch's host
        allocator records the copy)."""
        if self._pin and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _grad_norm(self) -> Tensor:
        """The gradients' total norm (before clipping), clipping them to ``grad_clip`` — a
        device scalar; neither reads it on the host (no ``error_if_nonfinite``)."""
        return self.strategy.clip_grad_norm(self.model.parameters(), self.clip)

    def __call__(
        self, next_batch: Callable[[], tuple[Tensor, Tensor]], lr_factor: float | None = None
    ) -> StepResult:
        if lr_factor is not None:
            set_lr_factor(self.optimizer, lr_factor)
        if not self.model.training:  # (a recursive call: ≈ 0.5 ms a step on a small model)
            self.model.train()
        n = self.grad_accum
        batches = [next_batch() for _ in range(n)]
        batches = [
            self.strategy.context_rows(self._to_device(x), self._to_device(y)) for x, y in batches
        ]
        weights, total = self._target_weights([y for _, y in batches])
        trained = weights != 0
        loss_sum = torch.zeros((), device=self.device)
        aux_sums: dict[str, Any] = {}
        metric_sums: dict[str, Any] = {}
        pipelined = self.strategy.pipelined
        for micro, (x, y) in enumerate(batches):
            weight, keep = weights[micro], trained[micro]
            if pipelined is not None:  # the schedule runs forward and backward
                with hardware.autocast(self.device, self.precision):
                    reported = pipelined.train(x, y, weight)
                # only the last stage's ranks have it: × pp, so that the mean over ranks is
                # the mean over the last stage's ranks
                loss_sum += reported * self.strategy.layout.pp
                continue
            with self.strategy.grad_sync(self.wrapped, micro == n - 1):  # all-reduce once
                with hardware.autocast(self.device, self.precision):
                    out = self.objective(self.forward, x, y)
                    # A micro-batch without trained targets has weight 0 (its mean, NaN for
                    # the cross-entropy, zeroed): its backward still runs, and all-reduces.
                    loss = torch.where(keep, out.loss, 0.0) * weight
                    for value in out.aux_losses.values():
                        loss = loss + value / n
                mean_loss, aux, metrics = out.loss.detach(), out.aux_losses, out.metrics
                del out  # its logits (batch × block × vocab): backward does not need them
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
            del loss
            loss_sum += torch.where(keep, mean_loss.float(), 0.0) * weight
            for k, v in aux.items():
                aux_sums[k] = aux_sums.get(k, 0.0) + _detached(v) / n
            for k, v in metrics.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + _detached(v) / n
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self._grad_norm()
        # Everything reported, averaged over ranks, in one all-reduce; [applied, loss,
        # grad_norm, *reported] in one device vector.
        names = [f"aux/{k}" for k in aux_sums] + [f"metric/{k}" for k in metric_sums]
        values = self.strategy.mean_tensor([loss_sum, *aux_sums.values(), *metric_sums.values()])
        grad_norm = grad_norm.detach().to(self.device, torch.float32).reshape(1)
        # Without a scaler any non-finite value drops the update. With one (fp16), gradients
        # that overflow are the scaler's business (it skips the update and lowers the
        # scale); a non-finite loss is not, and is reported like any other.
        finite = torch.isfinite(values[:1])
        if self.scaler is None:
            finite = finite & torch.isfinite(grad_norm)
        result = StepResult.on_device(
            torch.cat([finite.float(), values[:1], grad_norm, values[1:]]), names, total
        )
        if self.scaler is None and self.device_skip:
            # The optimizer's kernel reads the check: nothing waits for the device.
            self.optimizer.found_inf = (~finite).float().reshape(())  # type: ignore[attr-defined]
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf  # type: ignore[attr-defined]
            self.optimizer.zero_grad(set_to_none=True)
            return result
        if not result.applied:  # the host decides: one transfer
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler is not None:
                self.scaler.update()  # closes this step's unscale_; the scale drops too
            return result
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return result
