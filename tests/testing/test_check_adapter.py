"""llmkit.testing's adapter check: the built-in adapters pass, adapters that break the
WeightAdapter contract fail naming what they broke."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmkit.contracts import AdapterOptions, ComponentOptions, WeightAdapter
from llmkit.testing import check_component, conformance_params
from tests.testing.fakes import fake


class GoodAdapter(WeightAdapter):
    """A correct adapter: W + B·A with B at zero."""

    Options = AdapterOptions

    def __init__(self, options, weight):
        super().__init__(options, weight)
        self.A = nn.Parameter(torch.empty(2, self.in_features, dtype=weight.dtype))
        self.B = nn.Parameter(torch.zeros(self.out_features, 2, dtype=weight.dtype))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))

    def delta(self) -> Tensor:
        return self.B @ self.A

    def forward(self, weight):
        return weight + self.delta().to(weight.dtype)


class PlainOptions(ComponentOptions):
    """Options without targets/also_train."""


class NotAdapterOptions(GoodAdapter):
    Options = PlainOptions


class NotAWeightAdapter(nn.Module):
    """An nn.Module that does not subclass WeightAdapter."""

    Options = AdapterOptions

    def __init__(self, options, weight):
        super().__init__()
        self.B = nn.Parameter(torch.zeros_like(weight))

    def forward(self, weight):
        return weight + self.B


class TransposedAdapter(GoodAdapter):
    def forward(self, weight):
        return (weight + self.delta().to(weight.dtype)).t()


class Float32Adapter(GoodAdapter):
    """Returns float32 whatever the weight's dtype."""

    def forward(self, weight):
        return weight.float() + self.delta().float()


class NonZeroInitAdapter(GoodAdapter):
    def __init__(self, options, weight):
        super().__init__(options, weight)
        with torch.no_grad():
            self.B.normal_()


class FrozenAdapter(GoodAdapter):
    def __init__(self, options, weight):
        super().__init__(options, weight)
        self.requires_grad_(False)


class IneffectiveAdapter(GoodAdapter):
    """Its parameters never reach the adapted weight."""

    def forward(self, weight):
        return weight + 0.0 * self.delta().to(weight.dtype)


class DeadFactorAdapter(GoodAdapter):
    """A third parameter is never used: no gradient reaches it."""

    def __init__(self, options, weight):
        super().__init__(options, weight)
        self.unused = nn.Parameter(torch.zeros(3))


class DropoutAdapter(GoodAdapter):
    def forward(self, weight):
        return weight + F.dropout(self.delta(), 0.5, self.training).to(weight.dtype)


class CountingAdapter(GoodAdapter):
    """Counts its calls in a buffer: state that changes in forward."""

    def __init__(self, options, weight):
        super().__init__(options, weight)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, weight):
        self.calls += 1
        return super().forward(weight)


class HiddenStateAdapter(GoodAdapter):
    """Keeps a random projection as a plain attribute: its state_dict cannot restore it."""

    def __init__(self, options, weight):
        super().__init__(options, weight)
        self.proj = torch.randn(2, 2, dtype=weight.dtype)

    def _apply(self, fn, recurse=True):
        self.proj = fn(self.proj)
        return super()._apply(fn, recurse)

    def delta(self):
        return self.B @ self.proj.to(self.B.dtype) @ self.A


class WeightMutatingAdapter(GoodAdapter):
    def __init__(self, options, weight):
        super().__init__(options, weight)
        with torch.no_grad():
            weight.mul_(0.5)


BUILTIN = conformance_params("adapter")


def test_the_builtin_adapters_are_found():
    assert {p.values[0].name for p in BUILTIN} >= {"lora", "dora"}


@pytest.mark.parametrize("record", BUILTIN)
def test_builtin_adapters_pass(record):
    check_component(record)


@pytest.mark.parametrize("options", [{"rank": 2, "rank_stabilized": True}, {"rank": 64}])
def test_lora_passes_with_options(options):
    from llmkit.registry import get_registry

    check_component(get_registry().get("adapter", "lora"), options)


def test_a_good_adapter_passes():
    check_component(fake("adapter", GoodAdapter))


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (NotAdapterOptions, "does not subclass llmkit.AdapterOptions"),
        (NotAWeightAdapter, "not a WeightAdapter"),
        (TransposedAdapter, "wrong shape"),
        (Float32Adapter, "wrong dtype"),
        (NonZeroInitAdapter, "at initialization the adapted weight differs"),
        (FrozenAdapter, "no trainable parameters"),
        (IneffectiveAdapter, "does not change the adapted weight"),
        (DeadFactorAdapter, "no gradient reaches parameter 'unused'"),
        (DropoutAdapter, "not deterministic"),
        (CountingAdapter, "forward changes its state"),
        (HiddenStateAdapter, "state_dict"),
        (WeightMutatingAdapter, "modified the base weight"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else None,
)
def test_broken_adapter_fails(target, match):
    with pytest.raises(AssertionError, match=match):
        check_component(fake("adapter", target))
