"""The contract of the ``loss`` kind, and helpers its components share.

A loss is an ``nn.Module`` built as ``Loss(options)`` from its pydantic ``Options`` (extra
keys forbidden; a subclass of :class:`~llmkit_losses.options.LossOptions`, kept in the
torch-free :mod:`llmkit_losses.options`). ``forward(logits, targets)`` takes logits (..., V) in
any float dtype and integer targets (...) of the same leading shape, and returns a 0-dim float32
tensor: the mean over every target that is not ``options.ignore_index`` (so it does not depend
on the batch size; 0 with a zero gradient when every target is ignored). Logits at ignored
positions do not affect it. It may report metrics through llmkit's ``SideOutputs``
(``self.report_metric``), e.g. the parts of a composite objective.

The kind's conformance check is :func:`llmkit_losses.conformance.check_loss`, named in its
``register_kinds`` record.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmkit import SideOutputs
from llmkit_losses.options import IGNORE_INDEX, LossOptions

__all__ = ["IGNORE_INDEX", "Loss", "LossOptions", "flatten", "masked_mean"]


class Loss(SideOutputs, nn.Module):
    """Base of ``loss`` components: ``(logits (..., V), targets (...)) → scalar`` mean over
    non-ignored targets, computed in float32."""

    Options = LossOptions

    def __init__(self, options: LossOptions) -> None:
        super().__init__()
        self.options = options

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:  # pragma: no cover
        raise NotImplementedError

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options.model_dump().items())


def flatten(logits: Tensor, targets: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(logits (N, V) float32, targets (N,), keep (N,) bool)`` from any leading shape."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: "
            "expected logits (..., V) and targets (...)"
        )
    flat = logits.reshape(-1, logits.shape[-1]).float()
    tgt = targets.reshape(-1)
    return flat, tgt, tgt != ignore_index


def masked_mean(values: Tensor, keep: Tensor) -> Tensor:
    """Mean of ``values`` (N,) over ``keep``; 0 (with a zero gradient) when nothing is kept."""
    return torch.where(keep, values, 0.0).sum() / keep.sum().clamp(min=1)
