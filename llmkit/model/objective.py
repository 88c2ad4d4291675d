"""The training objective: what a step minimizes and what evaluation reports as the loss.

The seam is the spec table ``train.loss`` (:data:`LOSS_SECTION`), not a kind name: a spec that
chooses a component there (``[train] loss = { name = ..., <options> }``; plugins/llmkit-losses
declares the ``loss`` kind with that section) trains on that loss of the model's logits and
the targets; without one, on the model's own cross-entropy. Either way every auxiliary
loss a component reports is added for the gradient. The objective knows no concrete loss:
a loss component is built as ``Loss(options)`` and called as ``loss(logits, targets)``,
returning the mean over targets that are not ignored (-100); what it reports through
``SideOutputs`` joins the model's side outputs under ``loss.<name>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

#: The spec table whose component, when a spec chooses one, is the training objective; the
#: contract it follows is :data:`llmkit.contracts.LOSS_CONTRACT`.
LOSS_SECTION = "train.loss"
#: Where a loss component's side outputs appear (``metric/loss.<name>``).
LOSS_PREFIX = "loss"


@dataclass
class ObjectiveOutput:
    """One forward's objective (a mean per target, without auxiliary losses), the auxiliary
    losses and metrics reported, the model's cross-entropy where it was computed, and the
    logits it was computed from."""

    loss: Tensor
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    cross_entropy: Tensor | None = None
    logits: Tensor | None = None

    @property
    def total(self) -> Tensor:
        """What the gradient is taken of: the objective plus every auxiliary loss."""
        total = self.loss
        for value in self.aux_losses.values():
            total = total + value
        return total


class Objective:
    """The model's cross-entropy (``loss`` None), or a ``loss`` component on its logits."""

    def __init__(self, loss: nn.Module | None = None, *, document_eos: int | None = None) -> None:
        self.loss = loss
        #: ``data.document_mask``: the tokenizer's EOS, after which a packed row's next
        #: document starts; the model then attends within documents only.
        self.document_eos = document_eos

    @classmethod
    def from_spec(cls, rs: Any, *, document_eos: int | None = None) -> Objective:
        """The objective a resolved spec chooses (``document_eos``: see the attribute)."""
        res = rs.components.get(LOSS_SECTION)
        return cls(res.build(res.options) if res is not None else None, document_eos=document_eos)

    def model_inputs(self, x: Tensor) -> dict[str, Tensor]:
        """Keyword arguments of the model beside the tokens: ``document_ids`` of packed
        rows under ``data.document_mask``, else none."""
        if self.document_eos is None:
            return {}
        from llmkit.model.documents import document_ids_from_eos

        return {"document_ids": document_ids_from_eos(x, self.document_eos)}

    @property
    def is_cross_entropy(self) -> bool:
        """True when the objective is the model's own cross-entropy."""
        return self.loss is None

    def to(self, device: torch.device | str) -> Objective:
        if self.loss is not None:
            self.loss.to(device)
        return self

    def __call__(
        self,
        forward: Callable[..., Any],
        x: Tensor,
        y: Tensor,
        *,
        cross_entropy: bool = False,
    ) -> ObjectiveOutput:
        """The objective of ``forward`` (the model, wrapped or compiled) on inputs ``x`` and
        targets ``y``. ``cross_entropy`` also returns the model's cross-entropy when the
        objective is another loss (evaluation reports both)."""
        kw = self.model_inputs(x)
        if self.loss is None:
            out = forward(x, y, **kw)
            return ObjectiveOutput(out.loss, out.aux_losses, out.metrics, out.loss, out.logits)
        out = forward(x, y, **kw) if cross_entropy else forward(x, **kw)
        value = self.loss(out.logits, y)
        aux, metrics = dict(out.aux_losses), dict(out.metrics)
        pop = getattr(self.loss, "pop_side_outputs", None)
        if pop is not None:
            losses, mets = pop()
            aux.update({f"{LOSS_PREFIX}.{k}": v for k, v in losses.items()})
            metrics.update({f"{LOSS_PREFIX}.{k}": v for k, v in mets.items()})
        return ObjectiveOutput(value, aux, metrics, out.loss, out.logits)
