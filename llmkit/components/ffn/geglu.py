"""GeGLU feed-forward block (Shazeer 2020, "GLU Variants Improve Transformer")."""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from llmkit.contracts import BuildContext, ComponentOptions, ffn_hidden


class GeGLUOptions(ComponentOptions):
    """Options of the GeGLU block."""

    hidden: int | None = Field(
        None, ge=1, description="Hidden size; when unset, multiplier·d_model rounded up."
    )
    multiplier: float = Field(
        8 / 3,
        gt=0.0,
        description="Hidden size as a multiple of d_model (when hidden is unset); the default "
        "2/3·4 keeps the parameter count of a 4·d_model MLP.",
    )
    multiple_of: int = Field(
        1, ge=1, description="Round the derived hidden size up to a multiple of this."
    )
    approximate: Literal["none", "tanh"] = Field(
        "none", description="GELU form: exact (erf) or the tanh approximation."
    )
    bias: bool | None = Field(
        None, description="Biases on all projections; unset follows the model's bias setting."
    )


class GeGLU(nn.Module):
    """``out_proj(gelu(gate_proj(x)) * up_proj(x))`` (Shazeer 2020)."""

    Options = GeGLUOptions

    def __init__(self, options: GeGLUOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        d = ctx.features
        hidden = ffn_hidden(d, options.hidden, options.multiplier, options.multiple_of)
        bias = ctx.bias if options.bias is None else options.bias
        self.gate_proj = nn.Linear(d, hidden, bias=bias)
        self.up_proj = nn.Linear(d, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, d, bias=bias)
        self.approximate = options.approximate

    def forward(self, x: Tensor) -> Tensor:
        gate = F.gelu(self.gate_proj(x), approximate=self.approximate)
        return self.out_proj(gate * self.up_proj(x))
