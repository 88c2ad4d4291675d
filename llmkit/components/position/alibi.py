"""Attention with Linear Biases (Press et al. 2022, "Train Short, Test Long").

Each head h adds ``−m_h · (i − j)`` to the score of query i on key j; the slopes m_h form a
geometric sequence, so no position information enters the embeddings.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from llmkit.components.position.options import ALiBiOptions
from llmkit.contracts import BuildContext, DistanceBias, PositionalScheme


def alibi_slopes(n: int, max_bias: float = 8.0) -> list[float]:
    """The paper's head slopes.

    For n a power of two: 2^(−b/n), 2^(−2b/n), …, 2^(−b) with b = ``max_bias`` (8 in the
    paper; MPT's ``alibi_bias_max``): the geometric sequence starting at and with ratio
    2^(−b/n). Otherwise the slopes of the closest smaller power of two c,
    followed by every other slope of 2c until there are n (the reference implementation's rule).
    """
    if n < 1:
        raise ValueError(f"ALiBi needs at least one head, got {n}")

    def power_of_two(m: int) -> list[float]:
        start = 2.0 ** (-max_bias / m)
        return [start ** (i + 1) for i in range(m)]

    if n & (n - 1) == 0:
        return power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_two(closest) + alibi_slopes(2 * closest, max_bias)[0::2][: n - closest]


class ALiBi(PositionalScheme):
    """Linear distance biases on attention scores, one slope per query head (Press et al. 2022)."""

    Options = ALiBiOptions
    acts_on: ClassVar[frozenset[str]] = frozenset({"score_bias"})

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism: nothing to split (acts before the sequence is split, or on
        the rank's heads)."""
        return {}

    def __init__(self, options: ALiBiOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        slopes = torch.tensor(alibi_slopes(ctx.n_heads, options.max_bias), dtype=torch.float32)
        self.register_buffer("slopes", slopes, persistent=False)

    def score_bias(self) -> DistanceBias:
        return DistanceBias(self.slopes)
