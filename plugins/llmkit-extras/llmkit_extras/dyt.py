"""Dynamic Tanh (Zhu, Chen, He, LeCun & Liu 2025, "Transformers without Normalization").

``DyT(x) = weight · tanh(α · x) + bias`` with one learned scalar α: an element-wise
replacement for LayerNorm/RMSNorm that needs no statistics over the features. The paper
observes that trained LayerNorms map activations through an S-shaped, tanh-like curve and
reproduces that directly.

Initialization matters: α starts at ``alpha_init`` (0.5 in the paper for most models). For
LLMs the paper tunes it by width and by place — smaller for wider models, larger in the
attention block's norm than in the feed-forward and final norms — so treat ``alpha_init``
as a hyperparameter (a per-layer override can set different values).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmkit import BuildContext
from llmkit_extras.options import DyTOptions


class DynamicTanh(nn.Module):
    """``weight · tanh(α·x) + bias`` over the last dimension (Zhu et al. 2025).

    Computed in float32 and cast back to the input dtype; weight starts at 1, bias at 0.
    """

    Options = DyTOptions

    def __init__(self, options: DyTOptions, ctx: BuildContext) -> None:
        super().__init__()
        self.options = options
        self.features = ctx.features
        self.alpha = nn.Parameter(torch.full((1,), float(options.alpha_init)))
        self.weight = nn.Parameter(torch.ones(self.features))
        use_bias = ctx.bias if options.bias is None else options.bias
        self.bias = nn.Parameter(torch.zeros(self.features)) if use_bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.alpha.float() * x.float()) * self.weight.float()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"{self.features}, alpha_init={self.options.alpha_init}, bias={bias}"
