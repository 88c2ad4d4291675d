"""llmkit.testing's position check fails on schemes that break the contract."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

from llmkit.contracts import NoOptions, PositionalScheme
from llmkit.testing import check_component
from tests.testing.fakes import fake


class _Position(PositionalScheme):
    Options = NoOptions


class ShiftPosition(_Position):
    """A correct relative scheme: rotates feature pairs by an angle ∝ position (RoPE-like)."""

    acts_on: ClassVar[frozenset[str]] = frozenset({"qk"})

    def rotate(self, q, k, positions):
        return self._rot(q, positions), self._rot(k, positions)

    @staticmethod
    def _rot(x, positions):
        h = x.shape[-1] // 2
        angle = positions.float()[..., None] * 0.3  # (T, 1) or (B, T, 1)
        if angle.dim() == 3:
            angle = angle[:, None]
        x1, x2 = x[..., :h].float(), x[..., h:].float()
        cos, sin = angle.cos(), angle.sin()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype)


class MislabelledPosition(ShiftPosition):
    """Its class says qk; the registration below says embedding."""


class AbsoluteQKPosition(_Position):
    """Scales q/k by their absolute position: scores depend on where, not how far."""

    acts_on: ClassVar[frozenset[str]] = frozenset({"qk"})

    def rotate(self, q, k, positions):
        scale = (1.0 + positions.float() / 10.0)[..., None]
        if scale.dim() == 3:
            scale = scale[:, None]
        return (q * scale).to(q.dtype), (k * scale).to(k.dtype)


class SneakyEmbedPosition(ShiftPosition):
    """Declares only qk but also changes the embeddings."""

    def embed(self, x, positions):
        return x + 0.1


class ConstantEmbedPosition(_Position):
    """Declares embedding but adds the same vector at every position."""

    acts_on: ClassVar[frozenset[str]] = frozenset({"embedding"})

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.vec = nn.Parameter(torch.randn(ctx.d_model) * 0.02)

    def embed(self, x, positions):
        return x + self.vec.to(x.dtype)


class WrongBiasPosition(_Position):
    """Declares score_bias but returns a plain tensor."""

    acts_on: ClassVar[frozenset[str]] = frozenset({"score_bias"})

    def score_bias(self):
        return torch.zeros(self.ctx.n_heads)


class NoBatchPositions(ShiftPosition):
    """Ignores per-row (B, T) positions, using the first row for all."""

    def rotate(self, q, k, positions):
        if positions.dim() == 2:
            positions = positions[0]
        return super().rotate(q, k, positions)


class AbsoluteIndexPosition(_Position):
    """Embeds with ``arange(T)`` instead of the positions it is given: wrong for a KV cache."""

    acts_on: ClassVar[frozenset[str]] = frozenset({"embedding"})

    def embed(self, x, positions):
        t = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        return x + torch.sin(t)[:, None].to(x.dtype)


def test_a_good_scheme_passes():
    check_component(fake("position", ShiftPosition, capabilities={"acts_on": ["qk"]}))


@pytest.mark.parametrize(
    ("target", "acts_on", "match"),
    [
        (MislabelledPosition, ["embedding"], "acts_on"),
        (AbsoluteQKPosition, ["qk"], "relative position"),
        (SneakyEmbedPosition, ["qk"], "acts_on lacks 'embedding'"),
        (ConstantEmbedPosition, ["embedding"], "same token at every position"),
        (WrongBiasPosition, ["score_bias"], "not a DistanceBias"),
        (NoBatchPositions, ["qk"], r"\(B, T\) positions"),
        (AbsoluteIndexPosition, ["embedding"], "one token at position"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else None,
)
def test_broken_position_fails(target, acts_on, match):
    with pytest.raises(AssertionError, match=match):
        check_component(fake("position", target, capabilities={"acts_on": acts_on}))
