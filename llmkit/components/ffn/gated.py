"""Gated feed-forward blocks (Shazeer 2020, "GLU Variants Improve Transformer"): the
projections and forward pass that ``swiglu`` and ``geglu`` share (their options:
:class:`~llmkit.components.ffn.options.GatedFFNOptions`).

``out_proj(act(gate_proj(x)) * up_proj(x))``: two bias-optional projections d → hidden
(``gate_proj``, ``up_proj``), an elementwise gated activation, and a projection hidden → d
(``out_proj``). A variant names its activation by overriding :meth:`GatedFFN.activate`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import Tensor, nn

from llmkit.components.ffn.options import GatedFFNOptions
from llmkit.contracts import BuildContext


class GatedFFN(nn.Module, ABC):
    """``out_proj(activate(gate_proj(x), up_proj(x)))``; subclasses define :meth:`activate`."""

    Options = GatedFFNOptions

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism: the hidden units split (gate and up alike; Megatron-LM)."""
        from llmkit.parallel.tensor import check_divides, column, row

        check_divides("the gated ffn's hidden size", self.up_proj.out_features, tp)
        return {"gate_proj": column(), "up_proj": column(), "out_proj": row()}

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
