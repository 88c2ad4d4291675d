"""Layer normalization (Ba et al. 2016, "Layer Normalization") with an optional bias."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.components.norm.options import LayerNormOptions
from llmkit.contracts import BuildContext


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension (Ba et al. 2016); weight starts at 1, bias at 0."""

    Options = LayerNormOptions

    def __init__(self, options: LayerNormOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        self.features = ctx.features
        self.eps = options.eps
        self.weight = nn.Parameter(torch.ones(self.features))
        use_bias = ctx.bias if options.bias is None else options.bias
        self.bias = nn.Parameter(torch.zeros(self.features)) if use_bias else None

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism: sequence-parallel (each rank's tokens, whole weights)."""
        from llmkit.parallel.tensor import sequence

        return {"": sequence()}

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (self.features,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.features}, eps={self.eps}, bias={self.bias is not None}"
