"""Post-LN block of the original Transformer (Vaswani et al. 2017; BERT, GPT-1): each
sublayer's residual sum is normalized, norm1(x + attn(x)), then norm2(· + ffn(·))."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from llmkit.contracts import AttentionInputs, Block, BlockParts, BuildContext, NoOptions


class PostNormBlock(Block):
    """``h = norm1(x + attn(x))``; ``out = norm2(h + ffn(h))``."""

    Options = NoOptions
    pre_norm: ClassVar[bool] = False  # the placement ``model.norm_placement`` names

    def __init__(self, options: NoOptions, ctx: BuildContext, parts: BlockParts) -> None:
        super().__init__(options, ctx, parts)
        self.norm1 = parts.norm()
        self.attn = parts.attention
        self.norm2 = parts.norm()
        self.ffn = parts.ffn

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism: no weights of its own (its parts declare theirs)."""
        return {}

    def forward(self, x: Tensor, inputs: AttentionInputs) -> Tensor:
        x = self.norm1(x + self.dropout(self.attn(x, inputs)))
        return self.norm2(x + self.dropout(self.ffn(x)))
