"""Causal sliding-window attention, computed block-locally in O(L·W) time and O(L·D) memory.

A query at absolute position p attends the W keys at positions p−W+1 … p (local attention as
in Longformer, Beltagy et al. 2020, and Mistral 7B, Jiang et al. 2023).

Block-local scheme: queries are cut into chunks of C consecutive positions (default about
W/4). The keys any query of a chunk can reach form one contiguous slice of C+W−1 keys, and
inside that slice the window is the same band for every chunk (local query a sees local keys
a … a+W−1). A step takes one chunk, or a few consecutive ones when a chunk alone is small
(at most :data:`STEP_SCORES` scores), for every (batch, kv head): one batched matmul against
the key slices (views of k for a single chunk), the band (and an ALiBi bias) added as one
precomputed bias, a softmax in place and a matmul with the value slices. GQA query heads of a
kv head are folded into the rows of the matmul (keys and values are never repeated). Only
one step's scores exist at a time, reused from one buffer: never L×L, nor L×W.

Without dropout the function is a :class:`torch.autograd.Function` in the FlashAttention-2
manner (Dao 2023): forward saves only q, k, v and the output; backward recomputes each step's
probabilities P and forms dS = P ∘ (dP − δ) with δ = rowsum(dO ∘ O), adding dK, dV into the
overlapping key slices. The autograd graph holds O(L·D); forward+backward allocates the
output, the three gradients and a few step-sized buffers. With dropout the same steps run
under plain autograd, which keeps every step's probabilities (O(L·(C+W)) per head).

The component runs the Triton kernel :mod:`llmkit.kernels.sliding_window` (same O(L·W) band)
when :func:`llmkit.kernels.runtime.use_triton` allows it, and this block-local function
otherwise: CPU tensors without ``TRITON_INTERPRET=1``, dropout in training, or inputs the
kernel does not take (float64, head dim > 256, bf16 in the interpreter). The block-local
function is also the kernel's test reference.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor
from torch.autograd.function import once_differentiable

from llmkit.contracts import AttentionKernel, BuildContext, ComponentOptions, DistanceBias
from llmkit.kernels import runtime
from llmkit.ops import check_shapes

#: Component name used in runtime notices.
NAME = "attention.sliding_window"

#: Default query chunks are ``clamp(W // 4, MIN_CHUNK, MAX_CHUNK)`` positions.
MAX_CHUNK = 128
MIN_CHUNK = 16
#: Scores computed per step (several chunks at once): at most this many elements, or one chunk.
STEP_SCORES = 1 << 18


class SlidingWindowOptions(ComponentOptions):
    """Options of sliding-window attention."""

    window: int = Field(
        256, ge=1, description="Keys each query attends, counting itself (positions p−W+1 … p)."
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on attention probabilities (training only)."
    )


def default_chunk(window: int) -> int:
    """Query chunk size for a window: about W/4, kept within [MIN_CHUNK, MAX_CHUNK].

    A chunk computes C·(C+W−1) scores for the C·W it needs (1.25× at C = W/4); smaller
    chunks waste less but make thinner matmuls. Several chunks run as one step (see
    :data:`STEP_SCORES`), so a small chunk does not mean many small calls.
    """
    return max(MIN_CHUNK, min(window // 4, MAX_CHUNK))


class _Step(NamedTuple):
    """``m`` consecutive chunks of ``rows`` queries from query ``start``, over keys
    k0 … k1−1 (chunk t reads k0+t·rows … k0+t·rows+cols−1), with the bias (1 or B·Hkv·m,
    G·rows, cols) of their scores."""

    start: int
    m: int
    rows: int
    k0: int
    k1: int
    cols: int
    bias: Tensor


class _Plan:
    """Shapes, the steps and their score biases for one call."""

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

        # Steps: chunks whose slice starts before key 0 and a short last chunk run alone;
        # the others in runs of up to ``most`` chunks (bounded scores per step).
        most = max(1, STEP_SCORES // (self.b * self.hkv * groups * c * kc))
        self.steps: list[_Step] = []
        cache: dict[tuple[int, int, int, int], Tensor] = {}
        start = 0
        while start < self.tq:
            first = self.offset + start - (w - 1)  # key at slice column 0
            rows = min(c, self.tq - start)
            m = 1 if first < 0 or rows < c else min(most, (self.tq - start) // c)
            k0, k1 = max(0, first), self.offset + start + m * rows
            cols = k1 - k0 - (m - 1) * rows
            key = (m, rows, k0 - first, cols)
            if self.valid is not None:
                step_bias = self._bias(start, *key)
            elif key in cache:
                step_bias = cache[key]
            else:
                step_bias = cache[key] = self._bias(start, *key)
            self.steps.append(_Step(start, m, rows, k0, k1, cols, step_bias))
            start += m * rows

    def _bias(self, start: int, m: int, rows: int, col0: int, cols: int) -> Tensor:
        """(1 or B·Hkv·m, G·rows, cols) bias of a step; its chunks' slices start at slice
        column ``col0``. With padding, padded keys are −inf and empty rows are re-opened (0)
        so that the softmax stays finite; their probabilities are zeroed afterwards."""
        bias = self.base[None, :, None, :, :rows, col0 : col0 + cols]  # (1, X, 1, G, r, cols)
        if self.valid is not None:
            k0 = self.offset + start - (self.w - 1) + col0
            keys = self.valid[:, k0 : k0 + (m - 1) * rows + cols].unfold(1, cols, rows)
            bias = bias.masked_fill(~keys[:, None, :, None, None, :], -math.inf)
            if self.empty is not None:
                empty = self.empty[:, start : start + m * rows].view(self.b, m, rows)
                bias = bias.masked_fill(empty[:, None, :, None, :, None], 0.0)
        if bias.shape[:3] == (1, 1, 1):
            return bias.reshape(1, self.groups * rows, cols)
        shape = (self.b, self.hkv, m, self.groups, rows, cols)
        return bias.expand(shape).reshape(-1, self.groups * rows, cols)

    def buffer(self) -> Tensor:
        """Room for the scores of the largest step (reused step after step)."""
        size = max(s.m * s.rows * s.cols for s in self.steps) * self.b * self.hkv * self.groups
        return torch.empty(size, dtype=self.dtype, device=self.base.device)

    def split(self, x: Tensor) -> Tensor:
        """(B, Hq, Tq, ·) in the compute dtype as (B, Hkv, G, Tq, ·)."""
        return x.to(self.dtype).reshape(self.b, self.hkv, self.groups, self.tq, *x.shape[3:])

    def rows(self, x5: Tensor, step: _Step) -> Tensor:
        """A step's rows of (B, Hkv, G, Tq, D) as (B·Hkv·m, G·rows, D)."""
        x = x5[:, :, :, step.start : step.start + step.m * step.rows]
        x = x.unflatten(3, (step.m, step.rows)).transpose(2, 3)
        return x.reshape(-1, self.groups * step.rows, x.shape[-1])

    def put_rows(self, x5: Tensor, step: _Step, part: Tensor) -> None:
        """Write (B·Hkv·m, G·rows, D) into a step's rows of (B, Hkv, G, Tq, D)."""
        x = x5[:, :, :, step.start : step.start + step.m * step.rows]
        part = part.view(self.b, self.hkv, step.m, self.groups, step.rows, -1)
        x.unflatten(3, (step.m, step.rows)).copy_(part.transpose(2, 3))

    def slices(self, x: Tensor, step: _Step) -> Tensor:
        """The chunks' key slices of (B, Hkv, Tk, D) as (B·Hkv·m, cols, D) (a view for a
        single chunk, a copy for several)."""
        x = x[:, :, step.k0 : step.k1].unfold(2, step.cols, step.rows).transpose(-1, -2)
        return x.reshape(-1, step.cols, x.shape[-1])

    def add_slices(self, acc: Tensor, step: _Step, part: Tensor) -> None:
        """Add (B·Hkv·m, cols, D) into the chunks' overlapping key slices of ``acc``
        (B, Hkv, Tk, D): columns [j·rows, (j+1)·rows) of every chunk land on disjoint keys,
        so one add per block of ``rows`` columns."""
        part = part.view(self.b, self.hkv, step.m, step.cols, -1)
        block = step.rows if step.m > 1 else step.cols
        for lo in range(0, step.cols, block):
            width = min(block, step.cols - lo)
            keys = acc[:, :, step.k0 + lo : step.k0 + lo + (step.m - 1) * step.rows + width]
            keys = keys.unfold(2, width, step.rows).transpose(-1, -2)
            keys.add_(part[:, :, :, lo : lo + width])

    def probs(self, qs: Tensor, ks: Tensor, step: _Step, out: Tensor | None) -> Tensor:
        """Softmax probabilities (B·Hkv·m, G·rows, cols) of a step's queries and key slices,
        computed in place in ``out`` if given."""
        if out is not None:
            out = out[: qs.shape[0] * qs.shape[1] * step.cols].view(-1, qs.shape[1], step.cols)
        scores = torch.baddbmm(step.bias, qs, ks.transpose(1, 2), alpha=self.scale, out=out)
        probs = torch.softmax(scores, -1, out=out)
        if self.empty is not None:
            empty = self.empty[:, step.start : step.start + step.m * step.rows]
            empty = empty.view(self.b, 1, step.m, 1, step.rows, 1)
            view = probs.view(self.b, self.hkv, step.m, self.groups, step.rows, step.cols)
            view = (
                view.masked_fill_(empty, 0.0) if out is not None else view.masked_fill(empty, 0.0)
            )
            probs = view.view_as(probs)
        return probs


class _BlockLocal(torch.autograd.Function):
    """Block-local sliding-window attention without dropout; saves q, k, v and the output."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> Tensor:
        q5, kc, vc = plan.split(q), k.to(plan.dtype), v.to(plan.dtype)
        out = q5.new_empty(q5.shape)
        scores = plan.buffer()
        for step in plan.steps:
            probs = plan.probs(plan.rows(q5, step), plan.slices(kc, step), step, scores)
            plan.put_rows(out, step, torch.bmm(probs, plan.slices(vc, step)))
        out = out.view(q.shape).to(q.dtype)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        plan: _Plan = ctx.plan
        q, k, v, out = ctx.saved_tensors
        q5, kc, vc = plan.split(q), k.to(plan.dtype), v.to(plan.dtype)
        do = plan.split(grad)
        delta = torch.linalg.vecdot(do, plan.split(out))[..., None]  # rowsum(dO ∘ O)
        dq = q5.new_empty(q5.shape)
        dk, dv = kc.new_zeros(kc.shape), vc.new_zeros(vc.shape)
        scores, grads = plan.buffer(), plan.buffer()
        for step in plan.steps:
            qs, ks, vs = plan.rows(q5, step), plan.slices(kc, step), plan.slices(vc, step)
            probs = plan.probs(qs, ks, step, scores)
            dos = plan.rows(do, step)
            plan.add_slices(dv, step, torch.bmm(probs.transpose(1, 2), dos))
            ds = grads[: probs.numel()].view_as(probs)
            ds = torch.bmm(dos, vs.transpose(1, 2), out=ds)  # dP
            ds = ds.sub_(plan.rows(delta, step)).mul_(probs)  # dS = P ∘ (dP − δ)
            plan.put_rows(dq, step, torch.bmm(ds, ks))
            plan.add_slices(dk, step, torch.bmm(ds.transpose(1, 2), qs))
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

    Same contract as :class:`~llmkit.contracts.AttentionKernel`: q (B, Hq, Tq, D),
    k/v (B, Hkv, Tk, D), query i at key position Tk−Tq+i, ``key_padding_mask`` (B, Tk) True
    where a key may be attended, ``bias`` a per-head distance bias (its slopes get no
    gradient). Scores, softmax and the gradients' accumulation are fp32 (fp64 for fp64 inputs;
    fp16/bf16 inputs are upcast and the results cast back). ``chunk`` sets the query block
    size (default :func:`default_chunk`). A query left with no key (only padding in its window)
    returns zeros, with zero gradients.
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
    # Dropout: the same steps under plain autograd, which keeps every step's probabilities.
    q5, kc, vc = plan.split(q), k.to(plan.dtype), v.to(plan.dtype)
    parts = []
    for step in plan.steps:
        probs = plan.probs(plan.rows(q5, step), plan.slices(kc, step), step, None)
        probs = F.dropout(probs, p=dropout_p, training=True)
        part = torch.bmm(probs, plan.slices(vc, step))
        part = part.view(plan.b, plan.hkv, step.m, groups, step.rows, plan.d).transpose(2, 3)
        parts.append(part.flatten(3, 4))
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
