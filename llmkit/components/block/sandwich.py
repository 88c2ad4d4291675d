"""Sandwich norms (Ding et al. 2021, CogView; Gemma 2): each sublayer is normalized on the way
in and on the way out, inside the residual: x + post(attn(pre(x))), then the same for ffn.

Without the input norms (``input_norms = false``) only the sublayer's output is normalized,
x + norm(attn(x)) (OLMo 2, OLMo et al. 2024: "norms after the sublayer")."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from llmkit.components.block.options import SandwichOptions
from llmkit.contracts import AttentionInputs, Block, BlockParts, BuildContext


class SandwichBlock(Block):
    """``h = x + attn_post_norm(attn(norm1(x)))``; ``out = h + ffn_post_norm(ffn(norm2(h)))``;
    ``norm1`` and ``norm2`` are identities without input norms."""

    Options = SandwichOptions

    def __init__(self, options: SandwichOptions, ctx: BuildContext, parts: BlockParts) -> None:
        super().__init__(options, ctx, parts)
        inputs = options.input_norms
        self.norm1 = parts.norm() if inputs else nn.Identity()
        self.attn = parts.attention
        self.attn_post_norm = parts.norm()
        self.norm2 = parts.norm() if inputs else nn.Identity()
        self.ffn = parts.ffn
        self.ffn_post_norm = parts.norm()

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism: no weights of its own (its parts declare theirs)."""
        return {}

    def forward(self, x: Tensor, inputs: AttentionInputs) -> Tensor:
        x = x + self.dropout(self.attn_post_norm(self.attn(self.norm1(x), inputs)))
        return x + self.dropout(self.ffn_post_norm(self.ffn(self.norm2(x))))
