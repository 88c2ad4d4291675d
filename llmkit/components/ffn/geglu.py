"""GeGLU feed-forward block (Shazeer 2020, "GLU Variants Improve Transformer")."""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from llmkit.components.ffn.gated import GatedFFN, GatedFFNOptions
from llmkit.contracts import BuildContext


class GeGLUOptions(GatedFFNOptions):
    """Options of the GeGLU block."""

    approximate: Literal["none", "tanh"] = Field(
        "none", description="GELU form: exact (erf) or the tanh approximation."
    )


class GeGLU(GatedFFN):
    """``out_proj(gelu(gate_proj(x)) * up_proj(x))`` (Shazeer 2020)."""

    Options = GeGLUOptions

    def __init__(self, options: GeGLUOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.approximate = options.approximate

    def activate(self, gate: Tensor, up: Tensor) -> Tensor:
        """The gated activation ``gelu(gate) * up``, exact or tanh-approximated."""
        return F.gelu(gate, approximate=self.approximate) * up
