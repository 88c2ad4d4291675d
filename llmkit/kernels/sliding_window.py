"""Causal sliding-window attention on the Triton flash kernels, forward and backward, O(L·W).

A query at absolute position p attends the keys p−W+1 … p (local attention: Longformer,
Beltagy et al. 2020; Mistral 7B, Jiang et al. 2023). Queries are aligned bottom-right: query
i of Tq sits at key position Tk−Tq+i, as a KV cache presents them.

There is no second kernel: the window is a runtime argument of the flash-attention kernels
(:mod:`llmkit.kernels.flash_attention`, FlashAttention-2 restricted to a band), compiled
once with ``HAS_WINDOW`` set. With it:

- the forward and dQ programs (one per block of BLOCK_M queries) visit only the key blocks
  that meet the window of some query of their block, the key range [p₀−W+1, p₀+BLOCK_M);
- the dK/dV program of a key block visits only the query blocks whose windows reach it,
  queries at key positions [n₀, n₀+BLOCK_N+W−1), summed over the GQA group in registers.

So compute is O(L·(W + BLOCK)) per head and memory O(L) beyond the inputs (output, row
log-sum-exp, δ). Windows share the compiled kernels (Triton specializes only the value 1
and multiples of 16). Everything else is the flash
kernels' contract: fp32 statistics and accumulation, IEEE fp32 dots for fp32 inputs (TF32
when PyTorch allows it), ALiBi slopes as score − slope·(p − j), a ``key_padding_mask`` in the
kernel (a query left with no key returns zeros and zero gradients), packed documents
(``document_ids``: window AND same document, the key blocks of earlier documents skipped), no
atomics (bit-identical gradients between runs). Dropout is not supported: the component uses
the reference path for it.

The PyTorch reference is
:func:`llmkit.components.attention.sliding_window.sliding_window_attention`.
"""

from __future__ import annotations

from torch import Tensor

from llmkit.contracts import DistanceBias
from llmkit.kernels import flash_attention as flash
from llmkit.ops import check_shapes

#: Input dtypes the kernel accepts.
DTYPES = flash.SUPPORTED_DTYPES
#: Largest head dimension the kernel accepts.
MAX_HEAD_DIM = flash.MAX_HEAD_DIM


def supported(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """True when the kernels handle these tensors (:func:`flash.kernel_supports`)."""
    return flash.kernel_supports(q, k, v)


def sliding_window_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    *,
    slopes: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    document_ids: Tensor | None = None,
) -> Tensor:
    """Causal sliding-window attention by the Triton kernels (differentiable).

    q (B, Hq, Tq, D); k, v (B, Hkv, Tk, D), Hq a multiple of Hkv, Tk ≥ Tq, query i at key
    position Tk−Tq+i; ``slopes`` (Hq,) ALiBi slopes (score − slope·distance);
    ``key_padding_mask`` (B, Tk) True where a key may be attended; ``document_ids`` (B, Tk)
    non-decreasing ids (a query sees only its own document). ``block_m``/``block_n``
    override the tile sizes of every kernel (powers of two ≥ 16).
    """
    check_shapes(q, k, v)  # the kernels index without bounds checks: validate first
    if window < 1:
        raise ValueError(f"window must be ≥ 1, got {window}")
    hq = q.shape[1]
    if slopes is not None and slopes.shape != (hq,):
        raise ValueError(f"slopes {tuple(slopes.shape)} must be ({hq},), one per query head")
    blocks = None
    if block_m is not None or block_n is not None:
        default = flash.block_config("fwd", q.shape[-1], q.dtype)
        blocks = (block_m or default.block_m, block_n or default.block_n)
    return flash.flash_attention(
        q,
        k,
        v,
        causal=True,
        bias=None if slopes is None else DistanceBias(slopes),
        key_padding_mask=key_padding_mask,
        window=window,
        blocks=blocks,
        document_ids=document_ids,
    )
