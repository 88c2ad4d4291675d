"""Gated feed-forward blocks (Shazeer 2020, "GLU Variants Improve Transformer"): the options,
projections and forward pass that ``swiglu`` and ``geglu`` share.

``out_proj(act(gate_proj(x)) * up_proj(x))``: two bias-optional projections d → hidden
(``gate_proj``, ``up_proj``), an elementwise gated activation, and a projection hidden → d
(``out_proj``). A variant names its activation by overriding :meth:`GatedFFN.activate`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from pydantic import Field
from torch import Tensor, nn

from llmkit.components.ffn.width import HiddenWidth
from llmkit.contracts import BuildContext, ComponentOptions


class GatedFFNOptions(HiddenWidth, ComponentOptions):
    """Options shared by the gated feed-forward blocks (their size: :class:`HiddenWidth`,
    three matrices)."""

    matrices: ClassVar[int] = 3

    hidden: int | None = Field(
        None, ge=1, description="Hidden size; when unset, multiplier·d_model rounded up."
    )
    multiplier: float = Field(
        8 / 3,
        gt=0.0,
        description="Hidden size as a multiple of d_model (when hidden is unset); the default "
        "2/3·4 keeps the parameter count of a 4·d_model MLP, as in LLaMA.",
    )
    multiple_of: int = Field(
        1, ge=1, description="Round the derived hidden size up to a multiple of this (LLaMA: 256)."
    )
    bias: bool | None = Field(
        None, description="Biases on all projections; unset follows the model's bias setting."
    )


class GatedFFN(nn.Module, ABC):
    """``out_proj(activate(gate_proj(x), up_proj(x)))``; subclasses define :meth:`activate`."""

    Options = GatedFFNOptions

    def __init__(self, options: GatedFFNOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        d = ctx.features
        hidden = options.hidden_size(d)
        bias = options.has_bias(ctx.bias)
        self.gate_proj = nn.Linear(d, hidden, bias=bias)
        self.up_proj = nn.Linear(d, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, d, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_proj(self.activate(self.gate_proj(x), self.up_proj(x)))

    @abstractmethod
    def activate(self, gate: Tensor, up: Tensor) -> Tensor:
        """The gated activation ``act(gate) * up`` of the two hidden projections."""
