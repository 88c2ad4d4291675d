"""Causal sliding-window attention, O(L·W) time and O(L·D) memory.

A query at absolute position p attends the W keys at positions p−W+1 … p (local attention as
in Longformer, Beltagy et al. 2020, and Mistral 7B, Jiang et al. 2023).

The component runs the Triton kernel :mod:`llmkit.kernels.sliding_window` (same O(L·W) band)
when :func:`llmkit.kernels.runtime.use_triton` allows it. Otherwise CPU tensors (fp32, fp16,
bf16; head dims a multiple of the vector step) without key padding or dropout take the
compiled C kernel :mod:`llmkit.kernels.window_native`, where a C compiler builds it, and
everything else the block-local PyTorch implementation :mod:`llmkit.kernels.block_local`:
float64, key padding, dropout in training, other head dims, no compiler. The block-local
function is also the kernels' test reference.

Packed documents (``document_ids``): a query attends the keys of its window that are in its
own document. The Triton kernel takes them (varlen, as ``flash``); elsewhere the call leaves
the O(L·W) paths (C and block-local) for a masked PyTorch one, :func:`llmkit.ops.sdpa_attention`
with the window and the documents as one boolean mask (O(L²) scores; with dropout,
:func:`llmkit.ops.reference_attention`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from llmkit.components.attention.options import SlidingWindowOptions
from llmkit.contracts import AttentionKernel, BuildContext, DistanceBias
from llmkit.kernels import runtime, window_native
from llmkit.kernels.block_local import block_local_attention, default_chunk
from llmkit.ops import check_document_ids, check_shapes, reference_attention, sdpa_attention

__all__ = [
    "NAME",
    "SlidingWindowAttention",
    "SlidingWindowOptions",
    "default_chunk",
    "sliding_window_attention",
]

#: Component name used in runtime notices.
NAME = "attention.sliding_window"


def sliding_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    *,
    bias: DistanceBias | None = None,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    chunk: int | None = None,
    document_ids: Tensor | None = None,
) -> Tensor:
    """Causal attention of each query over its last ``window`` keys (itself included).

    Same contract as :class:`~llmkit.contracts.AttentionKernel`: q (B, Hq, Tq, D),
    k/v (B, Hkv, Tk, D), query i at key position Tk−Tq+i, ``key_padding_mask`` (B, Tk) True
    where a key may be attended, ``bias`` a per-head distance bias (its slopes get no
    gradient). Scores, softmax and the gradients' accumulation are fp32 (fp64 for fp64 inputs;
    fp16/bf16 inputs are upcast and the results cast back). ``chunk`` sets the query block
    size (default :func:`default_chunk`). A query left with no key (only padding in its window)
    returns zeros, with zero gradients. Block-local, see
    :mod:`llmkit.kernels.block_local`; with ``document_ids`` (B, Tk) the masked path of the
    module docstring (``chunk`` then has no effect).
    """
    groups = check_shapes(q, k, v)
    if window < 1:
        raise ValueError(f"window must be ≥ 1, got {window}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be ≥ 1, got {chunk}")
    if q.shape[2] == 0:
        return q.clone()
    if document_ids is not None:
        check_document_ids(document_ids, q.shape[0], k.shape[2])
        kw = {"bias": bias, "key_padding_mask": key_padding_mask, "document_ids": document_ids}
        if dropout_p > 0.0:
            return reference_attention(q, k, v, window=window, dropout_p=dropout_p, **kw)
        return sdpa_attention(q, k, v, window=window, **kw)
    if chunk is None and window_native.supports(q, k, v, key_padding_mask, dropout_p):
        slopes = None if bias is None else bias.slopes
        return window_native.window_attention_native(q, k, v, window, groups, slopes)
    return block_local_attention(
        q,
        k,
        v,
        window,
        groups,
        bias=bias,
        key_padding_mask=key_padding_mask,
        dropout_p=dropout_p,
        chunk=chunk,
    )


class SlidingWindowAttention(AttentionKernel):
    """Causal sliding-window attention (Beltagy et al. 2020; Jiang et al. 2023), O(L·W).

    A KV cache only needs the last ``window`` keys (``cache_window``).
    """

    Options = SlidingWindowOptions
    full_causal = True
    supports_document_mask = True

    def __init__(self, options: SlidingWindowOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.window = options.window
        self.dropout = options.dropout
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
        if not causal:
            raise ValueError("sliding_window attention is causal only; got causal=False")
        dropout_p = self.dropout if self.training else 0.0
        if dropout_p == 0.0 and runtime.use_triton(q, k, v):
            # Imported lazily: only calls that run the kernel load it.
            from llmkit.kernels import sliding_window as kernel

            if kernel.supported(q, k, v):
                return kernel.sliding_window_attention_triton(
                    q,
                    k,
                    v,
                    self.window,
                    slopes=None if bias is None else bias.slopes,
                    key_padding_mask=key_padding_mask,
                    document_ids=document_ids,
                )
        elif dropout_p == 0.0 and not window_native.supports(q, k, v, key_padding_mask, 0.0):
            runtime.announce_reference(NAME)
        return sliding_window_attention(
            q,
            k,
            v,
            self.window,
            bias=bias,
            key_padding_mask=key_padding_mask,
            dropout_p=dropout_p,
            document_ids=document_ids,
        )

    @classmethod
    def runtime_backend(cls) -> str:
        """Which path this component takes on this machine (``llmkit show``)."""
        return (
            f"{runtime.describe_backend(NAME)}; CPU tensors without key padding or dropout: "
            f"{window_native.describe()}"
        )

    def extra_repr(self) -> str:
        return f"window={self.window}, dropout={self.dropout}"
