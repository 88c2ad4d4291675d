"""Dense attention: explicit ``softmax(q kᵀ / √d + bias + mask) v`` in plain PyTorch.

The reference kernel (scaled dot-product attention, Vaswani et al. 2017, "Attention Is All You
Need"), with grouped-query attention (Ainslie et al. 2023, "GQA") and bottom-right causal
alignment for KV-cache decoding, an optional causal window and score soft-capping (Gemma 2
Team 2024): the component form of :func:`llmkit.ops.reference_attention`,
which every other kernel is tested against.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from torch import Tensor

from llmkit.contracts import AttentionKernel, BuildContext, ComponentOptions, DistanceBias
from llmkit.ops import reference_attention


class DenseAttentionOptions(ComponentOptions):
    """Options of the dense reference kernel."""

    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on attention probabilities (training only)."
    )
    window: int | None = Field(
        None,
        ge=1,
        description="Causal sliding window: keys each query attends, counting itself "
        "(positions p−W+1 … p); unset attends every earlier key.",
    )
    softcap: float | None = Field(
        None,
        gt=0.0,
        description="Soft-cap the scaled scores to (−c, c) as c·tanh(s/c) before masking "
        "(Gemma 2's attention logit soft-capping).",
    )

    training_only: ClassVar[frozenset[str]] = frozenset({"dropout"})


class DenseAttention(AttentionKernel):
    """Explicit softmax attention (Vaswani et al. 2017), the reference every kernel must match."""

    Options = DenseAttentionOptions
    full_causal = True

    def __init__(self, options: DenseAttentionOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.dropout = options.dropout
        self.window = options.window
        self.softcap = options.softcap
        self.cache_window = options.window

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = True,
        bias: DistanceBias | None = None,
        key_padding_mask: Tensor | None = None,
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
        )
