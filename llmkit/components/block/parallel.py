"""Parallel attention and ffn (Wang & Komatsuzaki 2021, GPT-J; Black et al. 2022, GPT-NeoX;
Phi; Chowdhery et al. 2022, PaLM): both sublayers read the same block input,
x + attn(norm1(x)) + ffn(norm(x)), with one shared norm (GPT-J, Phi, PaLM) or two (NeoX)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from llmkit.components.block.options import ParallelOptions
from llmkit.contracts import AttentionInputs, Block, BlockParts, BuildContext


class ParallelBlock(Block):
    """``out = x + attn(norm1(x)) + ffn(norm2(x))``, ``norm2`` = ``norm1`` when shared."""

    Options = ParallelOptions

    def __init__(self, options: ParallelOptions, ctx: BuildContext, parts: BlockParts) -> None:
        super().__init__(options, ctx, parts)
        self.norm1 = parts.norm()
        self.attn = parts.attention
        self.norm2 = None if options.shared_norm else parts.norm()
        self.ffn = parts.ffn

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism: no weights of its own (its parts declare theirs)."""
        return {}

    def forward(self, x: Tensor, inputs: AttentionInputs) -> Tensor:
        h = self.norm1(x)
        g = h if self.norm2 is None else self.norm2(x)
        return x + self.dropout(self.attn(h, inputs)) + self.dropout(self.ffn(g))
