"""LoRA: a trainable low-rank update of a frozen weight, W + (α/r)·B·A (Hu et al. 2021).

A (r × in) starts as Kaiming-uniform noise and B (out × r) at zero, so an adapted model
starts exactly as its base. ``rank_stabilized`` scales by α/√r instead (rsLoRA, Kalajdzievski
2023), which keeps updates of the same size as the rank grows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from llmkit.components.adapter.options import LoRAOptions
from llmkit.contracts import WeightAdapter

Options = LoRAOptions  # the name this module has always given them


def lora_scale(options: Options) -> float:
    r = options.rank
    return options.alpha / (math.sqrt(r) if options.rank_stabilized else r)


class LoRA(WeightAdapter):
    """W + s·B·A for one weight (out × in)."""

    Options = Options

    def __init__(self, options: Options, weight: Tensor) -> None:
        super().__init__(options, weight)
        r = min(options.rank, self.out_features, self.in_features)
        self.A = nn.Parameter(torch.empty(r, self.in_features, dtype=weight.dtype))
        self.B = nn.Parameter(torch.zeros(self.out_features, r, dtype=weight.dtype))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.scale = lora_scale(options)

    def delta(self) -> Tensor:
        """The update s·B·A (out × in)."""
        return (self.B @ self.A) * self.scale

    def forward(self, weight: Tensor) -> Tensor:
        return weight + self.delta().to(weight.dtype)
