"""SwiGLU feed-forward block (Shazeer 2020, "GLU Variants Improve Transformer"), as in LLaMA."""

from __future__ import annotations

import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from llmkit.contracts import BuildContext, ComponentOptions, ffn_hidden


class SwiGLUOptions(ComponentOptions):
    """Options of the SwiGLU block."""

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


class SwiGLU(nn.Module):
    """``out_proj(silu(gate_proj(x)) * up_proj(x))`` (Shazeer 2020; Touvron et al. 2023)."""

    Options = SwiGLUOptions

    def __init__(self, options: SwiGLUOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        d = ctx.features
        hidden = ffn_hidden(d, options.hidden, options.multiplier, options.multiple_of)
        bias = ctx.bias if options.bias is None else options.bias
        self.gate_proj = nn.Linear(d, hidden, bias=bias)
        self.up_proj = nn.Linear(d, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, d, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_proj(self.activate(self.gate_proj(x), self.up_proj(x)))

    def activate(self, gate: Tensor, up: Tensor) -> Tensor:
        """The gated activation ``silu(gate) * up`` (``swiglu_triton`` fuses it)."""
        return F.silu(gate) * up
