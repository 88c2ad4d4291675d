"""Attention through ``torch.nn.functional.scaled_dot_product_attention``.

PyTorch dispatches to FlashAttention (Dao et al. 2022), memory-efficient attention
(Rabe & Staats 2021, xFormers) or its math backend. The call itself is
:func:`llmkit.ops.sdpa_attention`: plain causal attention without a bias or padding takes the
``is_causal`` fast path (flash-eligible); anything else passes an explicit
bottom-right-aligned mask. In training with ``dropout > 0`` on a CPU, where SDPA
would leave its fused kernel for the math path, :mod:`llmkit.kernels.attention_dropout` runs
instead (same contract, a cheaper dropout mask). bf16 calls on a CPU with few keys or
narrow heads run widened to fp32 (:func:`widen_on_cpu`), where torch's fused CPU kernel is
faster in fp32 than in bf16. ``document_ids`` (packed rows) become one boolean block-diagonal
causal mask (:func:`llmkit.ops.sdpa_attention`), on every path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from llmkit.components.attention.options import SDPAttentionOptions
from llmkit.contracts import AttentionKernel, BuildContext, DistanceBias
from llmkit.kernels import attention_dropout
from llmkit.ops import check_document_ids, sdpa_attention

#: bf16 calls on a CPU are widened to fp32 up to this many keys, or at any length for
#: heads up to WIDEN_HEAD_DIM wide (:func:`widen_on_cpu`).
WIDEN_KEYS = 128
WIDEN_HEAD_DIM = 32


def widen_on_cpu(q: Tensor, k: Tensor) -> bool:
    """Whether a bf16 call runs faster widened to fp32: on a CPU, with few keys (a short
    sequence, never a long cache) or narrow heads. torch's fused CPU attention is no faster
    in bf16 than in fp32 and its bf16 backward is far slower on short blocks. Measured
    fwd+bwd on a 2-core EPYC with AVX512-BF16 (docs/benchmarks.md), (B, H, L, D):
    (12, 4, 64, 32) fp32 1.9 ms, bf16 7.2 ms, widened 2.5 ms; (8, 6, 256, 32) bf16 26 ms,
    widened 18 ms; (16, 6, 256, 64) bf16 54 ms, widened 67 ms (kept in bf16)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and (k.shape[2] <= WIDEN_KEYS or q.shape[3] <= WIDEN_HEAD_DIM)
    )


class SDPAttention(AttentionKernel):
    """PyTorch fused scaled dot-product attention (FlashAttention, Dao et al. 2022, and kin)."""

    Options = SDPAttentionOptions
    full_causal = True
    supports_document_mask = True

    def __init__(self, options: SDPAttentionOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.dropout = options.dropout

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
        dropout_p = self.dropout if self.training else 0.0
        # On a CPU, SDPA with dropout runs its math path, its mask costing more than the
        # product: llmkit.kernels.attention_dropout draws it from 16 bits an element.
        kw = {"causal": causal, "bias": bias, "key_padding_mask": key_padding_mask}
        if document_ids is not None:
            kw["document_ids"] = check_document_ids(document_ids, q.shape[0], k.shape[2])
        if attention_dropout.applies(q, dropout_p):
            return attention_dropout.dropout_attention(q, k, v, dropout_p=dropout_p, **kw)
        if widen_on_cpu(q, k):
            with torch.autocast("cpu", enabled=False):
                wide = sdpa_attention(q.float(), k.float(), v.float(), dropout_p=dropout_p, **kw)
            return wide.to(q.dtype)
        return sdpa_attention(q, k, v, dropout_p=dropout_p, **kw)
