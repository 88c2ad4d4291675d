"""Learned absolute position embeddings added to the token embeddings.

As in GPT (Radford et al. 2018) and GPT-2 (Radford et al. 2019); the table is ``wpe``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from llmkit.contracts import BuildContext, NoOptions, PositionalScheme


class LearnedPosition(PositionalScheme):
    """A trained (max_seq_len, d_model) table ``wpe`` added to the embeddings (GPT-2)."""

    Options = NoOptions
    acts_on: ClassVar[frozenset[str]] = frozenset({"embedding"})

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism: nothing to split (acts before the sequence is split, or on
        the rank's heads)."""
        return {}

    def __init__(self, options: NoOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.max_seq_len = ctx.max_seq_len
        self.wpe = nn.Embedding(ctx.max_seq_len, ctx.features)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        # The range is checked where reading it costs nothing: on a GPU the host would wait
        # for the device every forward (twice), and the embedding's own bounds check (a
        # device-side assertion) still stops an out-of-range position there.
        if positions.numel() and positions.device.type == "cpu":
            lo, hi = int(positions.min()), int(positions.max())
            if lo < 0 or hi >= self.max_seq_len:
                raise ValueError(
                    f"learned position embeddings cover positions 0..{self.max_seq_len - 1} "
                    f"(max_seq_len={self.max_seq_len}); got positions {lo}..{hi}"
                )
        return x + self.wpe(positions).to(x.dtype)
