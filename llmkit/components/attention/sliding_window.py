"""Causal sliding-window attention, computed block-locally in O(L·W) memory and compute.

A query at absolute position p attends the W keys at positions p−W+1 … p (local attention as
in Longformer, Beltagy et al. 2020, and Mistral 7B, Jiang et al. 2023).

Block-local scheme: queries are cut into chunks of C consecutive positions. The keys any query
of a chunk can reach form one contiguous slice of C+W−1 keys, and inside that slice the window
is the same band for every chunk (local query a sees local keys a … a+W−1). So all chunks run
as one batched matmul over overlapping key slices (an ``unfold`` view), and the largest
intermediate is (B, H, L/C, C, C+W−1): O(L·(C+W)) with C ≤ 256, never L×L.

The component runs the Triton kernel :mod:`llmkit.kernels.sliding_window` (FlashAttention-2
style, same O(L·W) band) when :func:`llmkit.kernels.runtime.use_triton` allows it, and this
block-local function otherwise: CPU tensors without ``TRITON_INTERPRET=1``, dropout in
training, or inputs the kernel does not take (float64, head dim > 256, bf16 in the
interpreter). The block-local function is also the kernel's test reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from llmkit.components.attention.dense import check_shapes
from llmkit.components.base import AttentionKernel, BuildContext, ComponentOptions, DistanceBias
from llmkit.kernels import runtime

#: Component name used in runtime notices.
NAME = "attention.sliding_window"

#: Largest default query chunk; chunks are ``clamp(W, MIN_CHUNK, MAX_CHUNK)`` positions.
MAX_CHUNK = 256
MIN_CHUNK = 16


class SlidingWindowOptions(ComponentOptions):
    """Options of sliding-window attention."""

    window: int = Field(
        256, ge=1, description="Keys each query attends, counting itself (positions p−W+1 … p)."
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on attention probabilities (training only)."
    )


def default_chunk(window: int) -> int:
    """Query chunk size for a window: about W, kept within [MIN_CHUNK, MAX_CHUNK]."""
    return max(MIN_CHUNK, min(window, MAX_CHUNK))


def _pad_seq(x: Tensor, left: int, right: int, dim: int, value: bool | float = 0) -> Tensor:
    """Pad ``x`` along ``dim`` with ``value`` (works for bool tensors too)."""
    if left == 0 and right == 0:
        return x
    parts = []
    for n in (left, right):
        shape = list(x.shape)
        shape[dim] = n
        parts.append(x.new_full(shape, value))
    return torch.cat([parts[0], x, parts[1]], dim=dim)


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
) -> Tensor:
    """Causal attention of each query over its last ``window`` keys (itself included).

    Same contract as :class:`~llmkit.components.base.AttentionKernel`: q (B, Hq, Tq, D),
    k/v (B, Hkv, Tk, D), query i at key position Tk−Tq+i, ``key_padding_mask`` (B, Tk) True
    where a key may be attended, ``bias`` a per-head distance bias. Scores and softmax are fp32.
    ``chunk`` sets the query block size (default :func:`default_chunk`). A query left with no
    key (only padding in its window) returns zeros.
    """
    groups = check_shapes(q, k, v)
    if window < 1:
        raise ValueError(f"window must be ≥ 1, got {window}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be ≥ 1, got {chunk}")
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if tq == 0:
        return q.clone()

    w = min(window, tk)  # no query has more than Tk keys behind it
    c = max(1, min(chunk or default_chunk(w), tq))
    n = math.ceil(tq / c)
    extra = n * c - tq  # queries padded at the end to fill the last chunk
    kc = c + w - 1  # keys a chunk can reach
    offset = tk - tq  # absolute position of query 0

    # Keys in "padded coordinates": index 0 is absolute position offset−(W−1), the first key
    # query 0 can see. Padding (invalid) keys fill positions < 0 and the tail of the last chunk.
    first = offset - (w - 1)
    lo, left = max(0, first), max(0, -first)
    kp = _pad_seq(k[:, :, lo:], left, extra, dim=2)
    vp = _pad_seq(v[:, :, lo:], left, extra, dim=2)
    valid = (
        torch.ones(1, tk - lo, dtype=torch.bool, device=q.device)
        if key_padding_mask is None
        else key_padding_mask[:, lo:].to(device=q.device, dtype=torch.bool)
    )
    valid = _pad_seq(valid, left, extra, dim=1, value=False)

    # Overlapping key slices, one per chunk (views): (B, Hkv, n, D, Kc) and (B, n, Kc).
    kw = kp.unfold(2, kc, c)
    vw = vp.unfold(2, kc, c).transpose(-1, -2)  # (B, Hkv, n, Kc, D)
    valid_w = valid.unfold(1, kc, c)

    # Queries grouped per kv head and chunk: (B, Hkv, n, G·C, D).
    qg = _pad_seq(q.reshape(b, hkv, groups, tq, d), 0, extra, dim=3)
    qg = qg.view(b, hkv, groups, n, c, d).permute(0, 1, 3, 2, 4, 5).reshape(b, hkv, n, -1, d)

    scores = torch.matmul(qg, kw).float() * (1.0 / math.sqrt(d))
    scores = scores.view(b, hkv, n, groups, c, kc)
    if bias is not None:
        # Within a slice, local query a sits at slice position W−1+a: exactly ``dense``'s
        # bottom-right alignment of C queries over Kc keys, the same for every chunk.
        local = bias.dense(c, kc, causal=True).to(scores.device).view(hkv, groups, c, kc)
        scores = scores + local[None, :, None]

    a = torch.arange(c, device=q.device)[:, None]
    j = torch.arange(kc, device=q.device)[None, :]
    band = (j >= a) & (j <= a + (w - 1))  # (C, Kc)
    mask = band & valid_w[:, :, None, :]  # (B or 1, n, C, Kc)
    empty = ~mask.any(dim=-1, keepdim=True)  # rows with no key: padding, or padded queries
    mask = (mask | empty)[:, None, :, None]  # re-opened so softmax stays finite
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(empty[:, None, :, None], 0.0)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)

    out = torch.matmul(probs.to(v.dtype).view(b, hkv, n, groups * c, kc), vw)
    out = out.view(b, hkv, n, groups, c, d).permute(0, 1, 3, 2, 4, 5).reshape(b, hq, n * c, d)
    return out[:, :, :tq]


class SlidingWindowAttention(AttentionKernel):
    """Causal sliding-window attention (Beltagy et al. 2020; Jiang et al. 2023), O(L·W).

    A KV cache only needs the last ``window`` keys (``cache_window``).
    """

    Options = SlidingWindowOptions

    def __init__(self, options: SlidingWindowOptions, ctx: BuildContext) -> None:
        super().__init__(options, ctx)
        self.window = options.window
        self.dropout = options.dropout
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
                )
        elif dropout_p == 0.0:
            runtime.announce_reference(NAME)
        return sliding_window_attention(
            q,
            k,
            v,
            self.window,
            bias=bias,
            key_padding_mask=key_padding_mask,
            dropout_p=dropout_p,
        )

    @classmethod
    def runtime_backend(cls) -> str:
        """Which path this component takes on this machine (``llmkit show``)."""
        return runtime.describe_backend(NAME)

    def extra_repr(self) -> str:
        return f"window={self.window}, dropout={self.dropout}"
