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
    offset: float = Field(
        0.0,
        description="The gain is offset + weight, weight starting at 1 − offset; Gemma's "
        "(1 + w) is offset 1 (weights then stored as w, starting at 0).",
    )


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · (offset + weight)`` over the last dimension (Zhang &
    Sennrich 2019).

    Computed in fp32 and cast back to the input dtype, as in LLaMA; the gain starts at 1.
    """

    Options = RMSNormOptions

    def __init__(self, options: RMSNormOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        self.features = ctx.features
        self.eps = options.eps
        self.offset = options.offset
        self.weight = nn.Parameter(torch.full((self.features,), 1.0 - self.offset))

    def forward(self, x: Tensor) -> Tensor:
        gain = self.weight.float()
        if self.offset:
            gain = gain + self.offset
        y = F.rms_norm(x.float(), (self.features,), gain, self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        offset = f", offset={self.offset:g}" if self.offset else ""
        return f"{self.features}, eps={self.eps}{offset}"
