"""Pre-LN block (Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture";
GPT-2, LLaMA): x + attn(norm1(x)), then + ffn(norm2(·))."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from llmkit.contracts import AttentionInputs, Block, BlockParts, BuildContext, NoOptions


class PreNormBlock(Block):
    """``h = x + attn(norm1(x))``; ``out = h + ffn(norm2(h))``."""

    Options = NoOptions
    pre_norm: ClassVar[bool] = True  # the placement ``model.norm_placement`` names

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
        x = x + self.dropout(self.attn(self.norm1(x), inputs))
        return x + self.dropout(self.ffn(self.norm2(x)))
