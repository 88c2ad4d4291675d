"""GeGLU feed-forward block (Shazeer 2020, "GLU Variants Improve Transformer")."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from llmkit.components.ffn.gated import GatedFFN
from llmkit.components.ffn.options import GeGLUOptions
from llmkit.contracts import BuildContext


class GeGLU(GatedFFN):
    """``out_proj(gelu(gate_proj(x)) * up_proj(x))`` (Shazeer 2020)."""

    Options = GeGLUOptions

    def __init__(self, options: GeGLUOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.approximate = options.approximate

    def activate(self, gate: Tensor, up: Tensor) -> Tensor:
        """The gated activation ``gelu(gate) * up``, exact or tanh-approximated."""
        return F.gelu(gate, approximate=self.approximate) * up
