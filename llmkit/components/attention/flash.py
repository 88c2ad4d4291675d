"""Flash attention: the fused Triton kernel of :mod:`llmkit.kernels.flash_attention`.

Tiled online-softmax attention (FlashAttention-2, Dao 2023) that never builds the L×L score
matrix, with its own backward. Where Triton cannot run (CPU tensors without
``TRITON_INTERPRET=1``, or inputs the kernel does not take: fp64, head dim > 256, mixed
dtypes) it announces once and takes the PyTorch reference path
(:func:`~llmkit.kernels.flash_attention.flash_attention_reference`, i.e. SDPA). Packed
documents (``document_ids``) run in the kernel (varlen: each program skips the key blocks
of earlier documents) and as a block-diagonal mask on the reference path.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from llmkit.contracts import AttentionKernel, DistanceBias, NoOptions
from llmkit.kernels import runtime
from llmkit.ops import sdpa_attention

NAME = "attention.flash"


class FlashAttention(AttentionKernel):
    """Fused flash-attention Triton kernel (FlashAttention-2, Dao 2023); exact, no dropout."""

    Options = NoOptions
    full_causal = True
    supports_document_mask = True

    @classmethod
    def runtime_backend(cls) -> str:
        """Which path this component takes on this machine (printed by ``llmkit show``)."""
        return runtime.describe_backend(NAME)

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
        if runtime.use_triton(q, k, v):
            # Imported here: Triton loads only when a kernel runs.
            from llmkit.kernels import flash_attention as fa

            if fa.kernel_supports(q, k, v):
                return fa.flash_attention(
                    q,
                    k,
                    v,
                    causal=causal,
                    bias=bias,
                    key_padding_mask=key_padding_mask,
                    document_ids=document_ids,
                )
        runtime.announce_reference(NAME)
        # The reference path: what flash_attention_reference runs, without importing Triton.
        return sdpa_attention(
            q,
            k,
            v,
            causal=causal,
            bias=bias,
            key_padding_mask=key_padding_mask,
            document_ids=document_ids,
        )
