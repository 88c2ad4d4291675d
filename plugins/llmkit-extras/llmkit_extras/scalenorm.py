"""ScaleNorm (Nguyen & Salazar 2019, "Transformers without Tears: Improving the
Normalization of Self-Attention").

``ScaleNorm(x) = g · x / max(‖x‖₂, eps)``: the vector is projected onto a sphere of learned
radius ``g`` (one scalar per norm, initialized to √d). One parameter instead of d (or 2d),
and the paper reports faster convergence than LayerNorm in low-resource translation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from llmkit import BuildContext
from llmkit_extras.options import ScaleNormOptions


class ScaleNorm(nn.Module):
    """``g · x / max(‖x‖, eps)`` over the last dimension with one learned scalar g
    (Nguyen & Salazar 2019). Computed in float32 and cast back to the input dtype."""

    Options = ScaleNormOptions

    def __init__(self, options: ScaleNormOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        self.features = ctx.features
        init = options.scale_init if options.scale_init is not None else math.sqrt(self.features)
        self.scale = nn.Parameter(torch.full((1,), float(init)))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        norm = xf.norm(dim=-1, keepdim=True).clamp(min=self.options.eps)
        return (self.scale.float() * xf / norm).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.features}, eps={self.options.eps}"
