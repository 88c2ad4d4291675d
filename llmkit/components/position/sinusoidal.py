"""Fixed sinusoidal position encodings added to the embeddings.

Vaswani et al. 2017, "Attention Is All You Need": PE[p, 2i] = sin(p / base^(2i/d)),
PE[p, 2i+1] = cos(p / base^(2i/d)).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from llmkit.components.position.options import SinusoidalOptions
from llmkit.contracts import BuildContext, PositionalScheme


def sinusoidal_table(positions: Tensor, dim: int, base: float) -> Tensor:
    """Encodings (..., dim) for positions (...) with sin/cos interleaved; dtype of ``positions``."""
    half = (dim + 1) // 2
    exponent = torch.arange(half, dtype=positions.dtype, device=positions.device) * (2.0 / dim)
    angles = positions[..., None] / base**exponent
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[..., :dim]


class SinusoidalPosition(PositionalScheme):
    """Fixed sin/cos encodings (Vaswani et al. 2017); a fp64-built table up to max_seq_len,
    computed on the fly beyond it."""

    Options = SinusoidalOptions
    acts_on: ClassVar[frozenset[str]] = frozenset({"embedding"})

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism: nothing to split (acts before the sequence is split, or on
        the rank's heads)."""
        return {}

    def __init__(self, options: SinusoidalOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.dim = ctx.features
        self.base = options.base
        table = sinusoidal_table(
            torch.arange(ctx.max_seq_len, dtype=torch.float64), self.dim, self.base
        )
        self.register_buffer("table", table.float(), persistent=False)

    def encodings(self, positions: Tensor) -> Tensor:
        """(..., d_model) fp32 encodings for integer positions (...)."""
        n = self.table.shape[0]
        cached = self.table[positions.clamp(0, n - 1)]
        # Positions outside the table (no host sync to find out which): computed in fp32.
        fresh = sinusoidal_table(
            positions.to(self.table.device, torch.float32), self.dim, self.base
        )
        inside = ((positions >= 0) & (positions < n))[..., None]
        return torch.where(inside, cached, fresh)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return x + self.encodings(positions).to(x.dtype)
