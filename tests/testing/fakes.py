"""Fake plugins for the conformance-suite tests: a registry with kinds of their own, and
components that pass."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from llmkit.components import builtin
from llmkit.contracts import BuildContext, NoOptions
from llmkit.hookspecs import hookimpl
from llmkit.registry import Registry

#: The check of the fake plugin's ``gadget`` kind.
GADGET_CHECK = "tests.testing.fakes:check_gadget"


def fake_registry(*components: dict[str, Any]) -> Registry:
    """A fresh registry: the built-in plugin, then a fake plugin declaring two kinds of its own,
    ``widget`` (no check) and ``gadget`` (checked by :func:`check_gadget`), and registering
    ``components`` (each the keyword arguments of ``register``)."""

    class FakePlugin:
        @hookimpl
        def register_kinds(self, register):
            register("widget", "A kind only the fake plugin knows")
            register("gadget", "A kind with a check of its own", check=GADGET_CHECK)

        @hookimpl
        def register_components(self, register):
            for c in components:
                c = dict(c)
                register(c.pop("kind"), c.pop("name"), c.pop("target"), **c)

    reg = Registry()
    reg.add_plugin(builtin, "builtin", "llmkit", "0")
    info = reg.add_plugin(FakePlugin(), "fake", "llmkit-fake", "0.0.1")
    assert info.error is None, info.error
    return reg


def fake(kind: str, target: Any, **extra: Any):
    """Register ``target`` as ``kind.fake`` in a fresh registry and return its record."""
    reg = fake_registry({"kind": kind, "name": "fake", "target": target, **extra})
    return reg.get(kind, "fake")


#: (name, options, device) of every call of :func:`check_gadget`.
GADGET_CALLS: list[tuple[str, Any, Any]] = []


def check_gadget(record: Any, options: Any = None, *, device: Any = None) -> None:
    """The ``gadget`` kind's check: its target, called, must answer 42."""
    GADGET_CALLS.append((record.name, options, device))
    answer = record.load()()
    if answer != 42:
        raise AssertionError(f"gadget {record.name!r}: answered {answer!r}, must answer 42")


class Pointwise(nn.Module):
    """A position-wise block with one projection; subclasses define forward."""

    Options = NoOptions

    def __init__(self, options: Any, ctx: BuildContext) -> None:
        super().__init__()
        self.proj = nn.Linear(ctx.d_model, ctx.d_model)


class GoodFFN(Pointwise):
    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.proj(x))


class MixingFFN(Pointwise):
    """Leaks information across positions through a running sum."""

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x.cumsum(dim=1))
