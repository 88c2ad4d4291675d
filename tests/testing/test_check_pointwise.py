"""llmkit.testing's ffn and norm checks fail on blocks that break the contract."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from llmkit.contracts import BuildContext
from llmkit.testing import check_component
from tests.testing.fakes import GoodFFN, MixingFFN, Pointwise, fake


def test_a_good_ffn_passes():
    check_component(fake("ffn", GoodFFN))


class BatchMixingFFN(Pointwise):
    """Normalizes over the batch: rows influence each other."""

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x - x.mean(dim=0, keepdim=True))


class UnusedParamFFN(Pointwise):
    def __init__(self, options: Any, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.gate = nn.Linear(ctx.d_model, ctx.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


class DropoutInEvalFFN(Pointwise):
    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.dropout(self.proj(x), 0.5, training=True)


class InPlaceFFN(Pointwise):
    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x.mul_(2.0))


class Float32Norm(Pointwise):
    """Computes in float32 and forgets to cast back."""

    def forward(self, x: Tensor) -> Tensor:
        y = self.proj(x).float()
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


class ShapeChangingFFN(Pointwise):
    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)[..., :-1]


@pytest.mark.parametrize(
    ("kind", "target", "match"),
    [
        ("ffn", MixingFFN, "mixes positions"),
        ("ffn", BatchMixingFFN, "mixes positions"),
        ("ffn", UnusedParamFFN, "no gradient reaches parameter 'gate.weight'"),
        ("ffn", DropoutInEvalFFN, "not deterministic"),
        ("ffn", InPlaceFFN, "in place"),
        ("ffn", ShapeChangingFFN, "shape"),
        ("norm", Float32Norm, "dtype torch.float32"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else x,
)
def test_broken_pointwise_fails(kind, target, match):
    with pytest.raises(AssertionError, match=match):
        check_component(fake(kind, target))


def test_position_wise_false_skips_only_the_mixing_check():
    check_component(fake("ffn", MixingFFN, capabilities={"position_wise": False}))
    with pytest.raises(AssertionError, match="no gradient"):
        check_component(fake("ffn", UnusedParamFFN, capabilities={"position_wise": False}))
