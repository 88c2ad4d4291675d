"""Dense attention: explicit ``softmax(q kᵀ / √d + bias + mask) v`` in plain PyTorch.

The reference kernel (scaled dot-product attention, Vaswani et al. 2017, "Attention Is All You
Need"), with grouped-query attention (Ainslie et al. 2023, "GQA") and bottom-right causal
alignment for KV-cache decoding, an optional causal window, score soft-capping (Gemma 2
Team 2024) and document masking (an explicit mask: a query sees only its own document's keys):
the component form of :func:`llmkit.ops.reference_attention`,
which every other kernel is tested against.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from llmkit.components.attention.options import DenseAttentionOptions
from llmkit.contracts import AttentionKernel, BuildContext, DistanceBias
from llmkit.ops import reference_attention


class DenseAttention(AttentionKernel):
    """Explicit softmax attention (Vaswani et al. 2017), the reference every kernel must match."""

    Options = DenseAttentionOptions
    full_causal = True
    supports_document_mask = True

    def __init__(self, options: DenseAttentionOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.dropout = options.dropout
        self.window = options.window
        self.softcap = options.softcap
        self.cache_window = options.window

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism: computes on the rank's heads; no weights to split."""
        return {}

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = True,
        bias: DistanceBias | None = None,
        key_padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        return reference_attention(
            q,
            k,
            v,
            causal=causal,
            bias=bias,
            key_padding_mask=key_padding_mask,
            dropout_p=self.dropout if self.training else 0.0,
            window=self.window,
            softcap=self.softcap,
            document_ids=document_ids,
        )
