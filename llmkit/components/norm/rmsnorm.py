"""Root-mean-square normalization (Zhang & Sennrich 2019, "Root Mean Square Layer
Normalization")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from llmkit.contracts import BuildContext, ComponentOptions


class RMSNormOptions(ComponentOptions):
    """Options of RMSNorm."""

    eps: float = Field(
        1e-6, gt=0.0, description="Added to the mean square for numerical stability."
    )


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · weight`` over the last dimension (Zhang & Sennrich 2019).

    Computed in fp32 and cast back to the input dtype, as in LLaMA; weight starts at 1.
    """

    Options = RMSNormOptions

    def __init__(self, options: RMSNormOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        self.features = ctx.features
        self.eps = options.eps
        self.weight = nn.Parameter(torch.ones(self.features))

    def forward(self, x: Tensor) -> Tensor:
        y = F.rms_norm(x.float(), (self.features,), self.weight.float(), self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.features}, eps={self.eps}"
