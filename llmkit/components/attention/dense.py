"""Dense attention: explicit ``softmax(q kᵀ / √d + bias + mask) v`` in plain PyTorch.

The reference kernel (scaled dot-product attention, Vaswani et al. 2017, "Attention Is All You
Need"), with grouped-query attention (Ainslie et al. 2023, "GQA") and bottom-right causal
alignment for KV-cache decoding. Every other kernel is tested against it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from llmkit.contracts import AttentionKernel, BuildContext, ComponentOptions, DistanceBias


class DenseAttentionOptions(ComponentOptions):
    """Options of the dense reference kernel."""

    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on attention probabilities (training only)."
    )


def check_shapes(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Validate the kernel contract's shapes; return the GQA group size Hq // Hkv."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects 4-D (B, H, T, D) tensors, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, hq, tq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match q {tuple(q.shape)}"
        )
    hkv, tk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if tk < tq:
        raise ValueError(f"fewer keys ({tk}) than queries ({tq})")
    return hq // hkv


def attention_mask(
    tq: int,
    tk: int,
    *,
    causal: bool,
    key_padding_mask: Tensor | None,
    device: torch.device,
) -> tuple[Tensor | None, Tensor | None]:
    """Boolean mask (B or 1, 1, Tq, Tk), True = may attend, and the rows that attend to nothing.

    Queries are aligned to the last ``tq`` of ``tk`` keys (query i sits at key position
    ``tk - tq + i``). Rows left with no key at all (a query on left padding) are re-opened to
    every key so that softmax stays finite; the second result, (B or 1, 1, Tq, 1) True where a
    row is empty, tells the caller to zero those outputs. Returns ``(None, None)`` when nothing
    is masked.
    """
    mask: Tensor | None = None
    if causal and tq > 1:  # a single query sits on the last key and sees them all
        qpos = torch.arange(tk - tq, tk, device=device)[:, None]
        mask = (torch.arange(tk, device=device)[None, :] <= qpos)[None, None]
    if key_padding_mask is not None:
        pad = key_padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
        mask = pad if mask is None else mask & pad
    if mask is None:
        return None, None
    empty = ~mask.any(dim=-1, keepdim=True)
    if key_padding_mask is None:  # causal alone never empties a row
        return mask, None
    return mask | empty, empty


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    bias: DistanceBias | None = None,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Reference attention; scores, softmax and the weighted sum run in fp32.

    Heads are grouped without copying K/V: query head ``h`` reads key/value head
    ``h // (Hq // Hkv)`` (the ``repeat_interleave`` convention of SDPA's ``enable_gqa``).
    """
    groups = check_shapes(q, k, v)
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    qf = q.float().reshape(b, hkv, groups * tq, d)
    scores = torch.matmul(qf, k.float().transpose(-1, -2)) * (1.0 / math.sqrt(d))
    scores = scores.view(b, hkv, groups, tq, tk)
    if bias is not None:
        scores = scores + bias.dense(tq, tk, causal=causal).to(scores.device).view(
            hkv, groups, tq, tk
        )
    mask, empty = attention_mask(
        tq, tk, causal=causal, key_padding_mask=key_padding_mask, device=q.device
    )
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if empty is not None:
        probs = probs.masked_fill(empty[:, :, None], 0.0)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    out = torch.matmul(probs.view(b, hkv, groups * tq, tk), v.float())
    return out.view(b, hq, tq, d).to(q.dtype)


class DenseAttention(AttentionKernel):
    """Explicit softmax attention (Vaswani et al. 2017), the reference every kernel must match."""

    Options = DenseAttentionOptions

    def __init__(self, options: DenseAttentionOptions, ctx: BuildContext) -> None:
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
        return dense_attention(
            q,
            k,
            v,
            causal=causal,
            bias=bias,
            key_padding_mask=key_padding_mask,
            dropout_p=self.dropout if self.training else 0.0,
        )
