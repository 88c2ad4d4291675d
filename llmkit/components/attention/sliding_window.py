"""Causal sliding-window attention, computed block-locally in O(L·W) time and O(L·D) memory.

A query at absolute position p attends the W keys at positions p−W+1 … p (local attention as
in Longformer, Beltagy et al. 2020, and Mistral 7B, Jiang et al. 2023).

Block-local scheme: queries are cut into chunks of C consecutive positions. The keys any query
of a chunk can reach form one contiguous slice of C+W−1 keys, and inside that slice the window
is the same band for every chunk (local query a sees local keys a … a+W−1). So each chunk is
one batched matmul over every (batch, kv head) against its key slice (a view of k, no copy),
with the band (and an ALiBi bias) added as one precomputed (C, C+W−1) bias, a softmax in
place and a matmul with the value slice. GQA query heads of one kv head are folded into the
rows of the matmul (keys and values are never repeated). Only one chunk's scores, (B, Hkv,
G·C, C+W−1), exist at a time: never L×L, nor L×W.

Without dropout the function is a :class:`torch.autograd.Function` in the FlashAttention-2
manner (Dao 2023): forward saves only q, k, v and the output; backward recomputes each chunk's
probabilities P and forms dS = P ∘ (dP − δ) with δ = rowsum(dO ∘ O), accumulating dK, dV over
the overlapping key slices. The autograd graph holds O(L·D), and forward+backward allocates the
output, the three gradients and a few chunk-sized buffers. With dropout, the same chunks run
under plain autograd (which keeps every chunk's probabilities: O(L·(C+W)) per head).

The component runs the Triton kernel :mod:`llmkit.kernels.sliding_window` (same O(L·W) band)
when :func:`llmkit.kernels.runtime.use_triton` allows it, and this block-local function
otherwise: CPU tensors without ``TRITON_INTERPRET=1``, dropout in training, or inputs the
kernel does not take (float64, head dim > 256, bf16 in the interpreter). The block-local
function is also the kernel's test reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor
from torch.autograd.function import once_differentiable

from llmkit.components.attention.dense import check_shapes
from llmkit.components.base import AttentionKernel, BuildContext, ComponentOptions, DistanceBias
from llmkit.kernels import runtime

#: Component name used in runtime notices.
NAME = "attention.sliding_window"

#: Largest default query chunk; chunks are ``clamp(W // 2, MIN_CHUNK, MAX_CHUNK)`` positions.
MAX_CHUNK = 128
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
    """Query chunk size for a window: about W/2, kept within [MIN_CHUNK, MAX_CHUNK].

    A chunk computes C·(C+W−1) scores for the C·W it needs: 1.5× at C = W/2. Smaller chunks
    waste less but make smaller, less efficient matmuls and more Python-level calls.
    """
    return max(MIN_CHUNK, min(window // 2, MAX_CHUNK))


class _Chunk(NamedTuple):
    """One query chunk: rows start … start+rows−1, keys k0 … k1−1, the (B·Hkv, G·rows, D)
    queries and (B·Hkv, k1−k0, D) keys and values, and the probabilities (B·Hkv, G·rows,
    k1−k0)."""

    start: int
    rows: int
    k0: int
    k1: int
    q: Tensor
    k: Tensor
    v: Tensor
    probs: Tensor


class _Plan:
    """Shapes, chunk geometry and the additive score biases of one call."""

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        window: int,
        groups: int,
        bias: DistanceBias | None,
        key_padding_mask: Tensor | None,
        chunk: int | None,
    ) -> None:
        self.b, _, self.tq, self.d = q.shape
        self.hkv, self.tk = k.shape[1], k.shape[2]
        self.groups = groups
        # fp32 scores and softmax (fp64 stays fp64); low-precision inputs are upcast.
        self.dtype = torch.promote_types(q.dtype, torch.float32)
        self.scale = 1.0 / math.sqrt(self.d)
        self.w = w = min(window, self.tk)  # no query has more than Tk keys behind it
        self.c = c = max(1, min(chunk or default_chunk(w), self.tq))
        self.offset = self.tk - self.tq  # absolute position of query 0
        kc = c + w - 1  # keys a chunk can reach
        device = q.device

        # (Hkv or 1, G, C, Kc): 0 on the band, −inf off it, plus the distance bias. Within a
        # slice, local query a sits at slice position W−1+a: exactly ``dense``'s bottom-right
        # alignment of C queries over Kc keys, the same for every chunk.
        a = torch.arange(c, device=device)[:, None]
        j = torch.arange(kc, device=device)[None, :]
        band = (j >= a) & (j <= a + (w - 1))
        base = torch.zeros(c, kc, dtype=self.dtype, device=device).masked_fill_(~band, -math.inf)
        if bias is None:
            self.base = base.expand(1, groups, c, kc)
        else:
            local = bias.dense(c, kc, causal=True).to(device=device, dtype=self.dtype)
            self.base = (local + base).view(self.hkv, groups, c, kc)

        self.valid = self.empty = None
        if key_padding_mask is not None:
            self.valid = key_padding_mask.to(device=device, dtype=torch.bool)
            # Rows whose window holds no valid key: counts of valid keys from prefix sums.
            counts = F.pad(self.valid.long().cumsum(1), (1, 0))
            pos = torch.arange(self.offset, self.tk, device=device)
            empty = counts[:, pos + 1] == counts[:, (pos - w + 1).clamp(min=0)]
            self.empty = empty if bool(empty.any()) else None
        self.inner = self._bias(c, 0, kc, None)  # every chunk away from the edges

    def _bias(self, rows: int, col0: int, cols: int, start: int | None) -> Tensor:
        """(1 or B·Hkv, G·rows, cols) bias of ``rows`` queries over the slice columns
        col0 … col0+cols−1; with ``start``, padded keys and empty rows of that chunk."""
        bias = self.base[None, :, :, :rows, col0 : col0 + cols]
        if start is not None and self.valid is not None:
            k0 = self.offset + start - (self.w - 1) + col0
            keys = self.valid[:, k0 : k0 + cols]
            bias = bias.masked_fill(~keys[:, None, None, None, :], -math.inf)
            if self.empty is not None:
                # Re-opened so the softmax stays finite; their probabilities are zeroed.
                empty = self.empty[:, start : start + rows]
                bias = bias.masked_fill(empty[:, None, None, :, None], 0.0)
        if bias.shape[0] == 1 and bias.shape[1] == 1:
            return bias.reshape(1, self.groups * rows, cols)
        shape = (self.b, self.hkv, self.groups, rows, cols)
        return bias.expand(shape).reshape(self.b * self.hkv, self.groups * rows, cols)

    def chunks(self, q5: Tensor, k: Tensor, v: Tensor) -> Iterator[_Chunk]:
        """The chunks in order, each with its probabilities (computed in place when grad
        mode is off, so that only one chunk's scores are alive at a time)."""
        b, hkv, g, d, c, w = self.b, self.hkv, self.groups, self.d, self.c, self.w
        inplace = not torch.is_grad_enabled()
        for start in range(0, self.tq, c):
            rows = min(c, self.tq - start)
            first = self.offset + start - (w - 1)  # key at slice column 0
            k0, k1 = max(0, first), self.offset + start + rows
            col0, cols = k0 - first, k1 - k0
            edge = rows != c or col0 != 0 or self.valid is not None
            bias = self._bias(rows, col0, cols, start) if edge else self.inner
            qc = q5[:, :, :, start : start + rows].reshape(b * hkv, g * rows, d)
            kk = k[:, :, k0:k1].reshape(b * hkv, cols, d)
            vv = v[:, :, k0:k1].reshape(b * hkv, cols, d)
            scores = torch.baddbmm(bias, qc, kk.transpose(1, 2), alpha=self.scale)
            probs = torch.softmax(scores, -1, out=scores if inplace else None)
            if self.empty is not None:
                empty = self.empty[:, None, None, start : start + rows, None]
                view = probs.view(b, hkv, g, rows, cols)
                view = view.masked_fill_(empty, 0.0) if inplace else view.masked_fill(empty, 0.0)
                probs = view.view(b * hkv, g * rows, cols)
            yield _Chunk(start, rows, k0, k1, qc, kk, vv, probs)

    def split(self, x: Tensor) -> Tensor:
        """(B, Hq, Tq, ·) in the compute dtype as (B, Hkv, G, Tq, ·)."""
        return x.to(self.dtype).reshape(self.b, self.hkv, self.groups, self.tq, *x.shape[3:])


class _BlockLocal(torch.autograd.Function):
    """Block-local sliding-window attention without dropout; saves q, k, v and the output."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> Tensor:
        b, hkv, g, tq, d = plan.b, plan.hkv, plan.groups, plan.tq, plan.d
        kc, vc = k.to(plan.dtype), v.to(plan.dtype)
        out = torch.empty(b, hkv, g, tq, d, dtype=plan.dtype, device=q.device)
        for ch in plan.chunks(plan.split(q), kc, vc):
            part = torch.bmm(ch.probs, ch.v).view(b, hkv, g, ch.rows, d)
            out[:, :, :, ch.start : ch.start + ch.rows] = part
        out = out.view(q.shape).to(q.dtype)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        plan: _Plan = ctx.plan
        q, k, v, out = ctx.saved_tensors
        b, hkv, g, tq, d = plan.b, plan.hkv, plan.groups, plan.tq, plan.d
        kc, vc = k.to(plan.dtype), v.to(plan.dtype)
        do = plan.split(grad)
        delta = torch.linalg.vecdot(do, plan.split(out))  # (B, Hkv, G, Tq) rowsum(dO ∘ O)
        dq = torch.empty(b, hkv, g, tq, d, dtype=plan.dtype, device=q.device)
        dk = torch.zeros(kc.shape, dtype=plan.dtype, device=q.device)
        dv = torch.zeros(vc.shape, dtype=plan.dtype, device=q.device)
        for ch in plan.chunks(plan.split(q), kc, vc):
            rows = slice(ch.start, ch.start + ch.rows)
            doc = do[:, :, :, rows].reshape(b * hkv, g * ch.rows, d)
            dv[:, :, ch.k0 : ch.k1].view(b * hkv, -1, d).baddbmm_(ch.probs.transpose(1, 2), doc)
            ds = torch.bmm(doc, ch.v.transpose(1, 2))  # dP
            ds = ds.sub_(delta[:, :, :, rows].reshape(b * hkv, -1, 1)).mul_(ch.probs)
            dq[:, :, :, rows] = torch.bmm(ds, ch.k).view(b, hkv, g, ch.rows, d)
            dk[:, :, ch.k0 : ch.k1].view(b * hkv, -1, d).baddbmm_(ds.transpose(1, 2), ch.q)
        dq = dq.mul_(plan.scale).view(q.shape).to(q.dtype)
        return dq, dk.mul_(plan.scale).to(k.dtype), dv.to(v.dtype), None


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
    where a key may be attended, ``bias`` a per-head distance bias. Scores and softmax are fp32
    (fp64 for fp64 inputs). ``chunk`` sets the query block size (default
    :func:`default_chunk`). A query left with no key (only padding in its window) returns
    zeros, with zero gradients.
    """
    groups = check_shapes(q, k, v)
    if window < 1:
        raise ValueError(f"window must be ≥ 1, got {window}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be ≥ 1, got {chunk}")
    if q.shape[2] == 0:
        return q.clone()
    plan = _Plan(q, k, window, groups, bias, key_padding_mask, chunk)
    if dropout_p == 0.0:
        return _BlockLocal.apply(q, k, v, plan)
    kc, vc = k.to(plan.dtype), v.to(plan.dtype)
    parts = [
        torch.bmm(F.dropout(ch.probs, p=dropout_p, training=True), ch.v).view(
            plan.b, plan.hkv, plan.groups, ch.rows, plan.d
        )
        for ch in plan.chunks(plan.split(q), kc, vc)
    ]
    return torch.cat(parts, dim=3).view(q.shape).to(q.dtype)


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
