"""Attention through ``torch.nn.functional.scaled_dot_product_attention``.

PyTorch dispatches to FlashAttention (Dao et al. 2022), memory-efficient attention
(Rabe & Staats 2021, xFormers) or its math backend. The call itself is
:func:`llmkit.ops.sdpa_attention`: plain causal attention without a bias or padding takes the
``is_causal`` fast path (flash-eligible); anything else passes an explicit
bottom-right-aligned mask. In training with ``dropout > 0`` on a CPU, where SDPA
would leave its fused kernel for the math path, :mod:`llmkit.kernels.attention_dropout` runs
instead (same contract, a cheaper dropout mask).
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor

from llmkit.contracts import AttentionKernel, BuildContext, ComponentOptions, DistanceBias
from llmkit.kernels import attention_dropout
from llmkit.ops import sdpa_attention


class SDPAttentionOptions(ComponentOptions):
    """Options of the SDPA kernel."""

    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on attention probabilities (training only)."
    )


class SDPAttention(AttentionKernel):
    """PyTorch fused scaled dot-product attention (FlashAttention, Dao et al. 2022, and kin)."""

    Options = SDPAttentionOptions

    def __init__(self, options: SDPAttentionOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.dropout = options.dropout

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
        dropout_p = self.dropout if self.training else 0.0
        # On a CPU, SDPA with dropout runs its math path, its mask costing more than the
        # product: llmkit.kernels.attention_dropout draws it from 16 bits an element.
        run = (
            attention_dropout.dropout_attention
            if attention_dropout.applies(q, dropout_p)
            else sdpa_attention
        )
        return run(
            q,
            k,
            v,
            causal=causal,
            bias=bias,
            key_padding_mask=key_padding_mask,
            dropout_p=dropout_p,
        )
