"""Sandwich norms (Ding et al. 2021, CogView; Gemma 2): each sublayer is normalized on the way
in and on the way out, inside the residual: x + post(attn(pre(x))), then the same for ffn."""

from __future__ import annotations

from torch import Tensor

from llmkit.contracts import AttentionInputs, Block, BlockParts, BuildContext, NoOptions


class SandwichBlock(Block):
    """``h = x + attn_post_norm(attn(norm1(x)))``; ``out = h + ffn_post_norm(ffn(norm2(h)))``."""

    Options = NoOptions

    def __init__(self, options: NoOptions, ctx: BuildContext, parts: BlockParts) -> None:
        super().__init__(options, ctx, parts)
        self.norm1 = parts.norm()
        self.attn = parts.attention
        self.attn_post_norm = parts.norm()
        self.norm2 = parts.norm()
        self.ffn = parts.ffn
        self.ffn_post_norm = parts.norm()

    def forward(self, x: Tensor, inputs: AttentionInputs) -> Tensor:
        x = x + self.dropout(self.attn_post_norm(self.attn(self.norm1(x), inputs)))
        return x + self.dropout(self.ffn_post_norm(self.ffn(self.norm2(x))))
