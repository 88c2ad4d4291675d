"""SwiGLU feed-forward block (Shazeer 2020, "GLU Variants Improve Transformer"), as in LLaMA."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from llmkit.components.ffn.gated import GatedFFN
from llmkit.components.ffn.options import SwiGLUOptions


class SwiGLU(GatedFFN):
    """``out_proj(silu(gate_proj(x)) * up_proj(x))`` (Shazeer 2020; Touvron et al. 2023)."""

    Options = SwiGLUOptions

    def activate(self, gate: Tensor, up: Tensor) -> Tensor:
        """The gated activation ``silu(gate) * up`` (``swiglu_triton`` fuses it)."""
        return F.silu(gate) * up
