"""DoRA: weight-decomposed low-rank adaptation (Liu et al. 2024).

The weight is split into a magnitude per output feature and a direction; the direction gets
a LoRA update and is renormalised, the magnitude trains on its own:
W' = m · (W + s·B·A) / ‖W + s·B·A‖, the norm taken over each output row. m starts at the
rows' norms of W and B at zero, so an adapted model starts exactly as its base. As in the
paper (section 4.3), the norm is treated as a constant in backward, which saves memory and
changes the gradient little.
"""

from __future__ import annotations

from torch import Tensor, nn

from llmkit.components.adapter.lora import LoRA
from llmkit.components.adapter.options import DoRAOptions

Options = DoRAOptions  # the name this module has always given them


class DoRA(LoRA):
    """m · (W + s·B·A) / ‖W + s·B·A‖ (row norms) for one weight."""

    Options = Options

    def __init__(self, options: Options, weight: Tensor) -> None:
        super().__init__(options, weight)
        self.m = nn.Parameter(weight.detach().float().norm(dim=1).to(weight.dtype))

    def forward(self, weight: Tensor) -> Tensor:
        direction = weight + self.delta().to(weight.dtype)
        norm = direction.float().norm(dim=1, keepdim=True).detach().clamp_min(1e-12)
        return (self.m.float()[:, None] * direction.float() / norm).to(weight.dtype)
