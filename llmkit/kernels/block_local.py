"""Block-local causal sliding-window attention in plain PyTorch: O(L·W) time, O(L·D) memory.

The PyTorch path of :mod:`llmkit.components.attention.sliding_window` (CPU, and wherever the
Triton kernel does not run). A query at absolute position p attends the keys p−W+1 … p.

**Chunks and spans.** Queries are cut into chunks of C consecutive positions (C = 32 for
W ≥ 64). Every query of a chunk sees keys inside one contiguous *span* of ``Kc = (n+1)·C``
keys, ``n = ⌈(W−1)/C⌉``, that starts n·C keys before the chunk; inside a span the window is
the same band for every chunk (local query a sees local keys nC+a−W+1 … nC+a), so scores
cost Kc/W of the useful ones (1.125 at W = 256). GQA query heads of a kv head are folded
into the rows of a chunk (``G·C`` rows), so keys and values are never repeated.

**Flat layout.** The key rows of all (batch, kv head) pairs lie end to end, each pair's
``nb·C`` keys after the previous pair's: chunk f's span then starts at row f·C − n·C for
every flat chunk f, so the spans of any run of chunks, across heads, are one strided *view*
and a step is one batched matmul. When Tk = nb·C this is k itself (no copy); otherwise a
padded copy. Span columns before a head's first key (the previous head's tail, or zeros)
are masked.

**Forward.** On a CPU without key padding: torch's fused attention kernel (the one behind
SDPA on a CPU) on the chunks as a batch, with the spans as key/value views and the band (and
ALiBi) as an additive mask. Elsewhere, step by step: a ``baddbmm`` of the scores with the
band as bias, a softmax in place in a reused buffer, a ``bmm`` with the value spans.

**Backward** (FlashAttention-2 manner, Dao 2023: forward saves only q, k, v and the output):
each step recomputes P and forms dS = P ∘ (dP − δ), δ = rowsum(dO ∘ O) (−δ is the input of
dP's ``baddbmm``, so dP − δ is one op), and dQ = dS·K. dK of
key chunk f sums dSᵀ·Q over the n+1 query chunks f … f+n, whose tiles for that key chunk lie
on a diagonal of the (chunk, tile) grid. P and dS are kept in rolling buffers whose chunk
stride is ``G·C·Kc + C`` rather than ``G·C·Kc``: that extra C makes the diagonal one
strided matrix, (n+1)·G·C rows of stride Kc, so dK (and dV from P) of a run of key chunks
is one batched matmul of depth Kc written straight into dK's rows, with no scatter-add.
torch's fused CPU flash backward (``_scaled_dot_product_flash_attention_for_cpu_backward``)
takes an additive ``attn_mask`` too and would run on the same chunk batch and span views,
but it loops over the chunks one small block at a time and returns per-span dK, dV (to fold
back); measured, it is about 2× slower than these batched steps at C = 32, so it is not used.
Keeping P from an unfused forward instead of recomputing it (38 MB at L 4096, W 256, 8
heads) was slower too: 121 against 104 ms fwd+bwd on a 2-core EPYC, the copy into the store
and reading P back from memory costing more than a product and a softmax on data in cache.

**Threads.** A large CPU call runs its (batch, kv head) pairs on several Python threads,
each with its share of torch's threads (one on a 2-core machine) and taking the next heads
when done (:mod:`llmkit.kernels.worker_threads`): no op then waits at a
barrier for a thread the OS has descheduled, which makes the many small steps robust on a
shared machine. The calling thread runs no op large enough for an OpenMP region of its own
just before the workers start (the masks are a few rows, not one per chunk): after such a
region libgomp's team threads spin for milliseconds, on the cores the workers need.

Decoding and other short query blocks (Tq ≤ C) take one chunk per (batch, kv head), whose
span is a view of the last keys of k itself; Tq < Tk with several chunks runs the last
Tq + min(Tk−Tq, W−1) keys, with that many dummy queries in front. With dropout the same
steps run under plain autograd (which then keeps every step's probabilities).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from llmkit.contracts import DistanceBias
from llmkit.kernels.worker_threads import run_parts, workers_for

#: Default chunk: C = DEFAULT_CHUNK query positions (fewer for short windows, see
#: :func:`default_chunk`).
DEFAULT_CHUNK = 32
#: Scores computed per step: at most this many (or one chunk), reused from one buffer (2 MiB
#: in fp32, so a step's operands stay in cache from one op to the next; larger steps mean
#: fewer calls, smaller ones less memory).
STEP_SCORES = 1 << 19
#: The backward keeps this many steps of P and dS before moving the last n chunks back.
ROLL = 1
#: Forward with torch's fused CPU attention kernel where it applies (see :func:`_forward_fused`).
FUSED_FORWARD = True
_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def default_chunk(window: int) -> int:
    """Query chunk size for a window: 32, or less for windows under 64 (at least 8).

    A chunk computes C·(W+C) scores (with its span rounded up to whole chunks) for the C·W it
    needs: 1.125× at C = 32, W = 256. Smaller chunks waste less but make thinner matmuls;
    many chunks run as one step, so small chunks do not mean many small calls.
    """
    return max(8, min(DEFAULT_CHUNK, window // 2))


class Layout:
    """Geometry and masks of one call (see the module docstring)."""

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
        self.b, self.hq, self.tq, self.d = q.shape
        self.hkv, self.tk = k.shape[1], k.shape[2]
        self.g = groups
        self.device = q.device
        # fp32 scores and softmax (fp64 stays fp64); low-precision inputs are upcast.
        self.dtype = torch.promote_types(q.dtype, torch.float32)
        self.scale = 1.0 / math.sqrt(self.d)
        self.w = w = min(window, self.tk)  # no query has more than Tk keys behind it
        c = chunk or default_chunk(w)
        offset = self.tk - self.tq  # absolute position of query 0
        #: One chunk per (batch, kv head), its span the last Kc keys of k itself.
        self.single = self.tq <= c
        if self.single:
            self.c, self.n, self.nb, self.pre = self.tq, 0, 1, 0
            self.kc = min(self.tk, self.tq + w - 1)
            #: Absolute position of span column 0 (single) or of a head's flat key row n·C.
            self.first = self.tk - self.kc
        else:
            self.c, self.n = c, -(-(w - 1) // c)
            self.kc = (self.n + 1) * c
            self.pre = min(offset, w - 1)  # dummy queries in front (Tq < Tk)
            self.nb = -(-(self.tq + self.pre) // c)
            self.first = offset - self.pre
        self.heads = self.b * self.hkv
        self.chunks = self.heads * self.nb
        self.rows = self.g * self.c
        seg = self.nb * self.c
        #: Query rows are a view of q (no dummy or padding rows, GQA heads already in rows).
        self.q_view = self.pre == 0 and self.tq == seg and (self.g == 1 or self.nb == 1)
        #: Flat key rows are a view of k (multi-chunk: Tk = nb·C; single: always).
        self.k_view = self.single or (self.first == 0 and self.tk == seg)
        #: Chunk stride of the backward's score buffers: a chunk's scores plus C (diagonal).
        self.stride = self.rows * self.kc + self.c
        #: Chunks per step: at most STEP_SCORES scores (at least one chunk).
        self.most = max(1, STEP_SCORES // (self.rows * self.kc))
        #: Workers (threads) and the parts (runs of whole heads) they share; see
        #: :mod:`llmkit.kernels.worker_threads`.
        self.workers = workers_for(self.device, self.chunks * self.rows * self.kc, self.heads)
        per_part = -(-self.chunks // (4 * self.workers)) if self.workers > 1 else self.chunks
        hp = max(1, -(-max(per_part, self.most) // self.nb))  # heads per part
        self.parts = [
            (h * self.nb, min(h + hp, self.heads) * self.nb) for h in range(0, self.heads, hp)
        ]
        #: Chunks of the largest part; no buffer holds more.
        self.part_chunks = max(p1 - p0 for p0, p1 in self.parts)
        self.most = min(self.most, self.part_chunks)
        self._masks(bias, key_padding_mask)
        #: Forward through torch's fused CPU kernel (:func:`_forward_fused`): CPU tensors
        #: without key padding.
        self.fused = (
            FUSED_FORWARD and _FUSED is not None and self.device.type == "cpu" and self.cols is None
        )

    def steps(self, p0: int, p1: int) -> list[tuple[int, int]]:
        """Steps of part [p0, p1): runs of up to :attr:`most` chunks; with k viewed in place,
        chunks 0 … n−1 (spans before the first key) are a step of their own."""
        bounds = [p0]
        if p0 == 0 and self.k_view and not self.single and 0 < self.n < p1:
            bounds.append(self.n)
        out = []
        for lo, hi in zip(bounds, [*bounds[1:], p1], strict=True):
            out += [(f, min(f + self.most, hi)) for f in range(lo, hi, self.most)]
        return out

    # -- masks -----------------------------------------------------------------------------

    def _masks(self, bias: DistanceBias | None, key_padding_mask: Tensor | None) -> None:
        c, kc, w, dev = self.c, self.kc, self.w, self.device
        a = torch.arange(c, device=dev)[:, None]
        col = torch.arange(kc, device=dev)[None, :]
        dist = (kc - c) + a - col  # query position − key position, the same in every span
        band = (dist >= 0) & (dist < w)
        base = torch.zeros(c, kc, dtype=self.dtype, device=dev).masked_fill_(~band, -math.inf)
        if bias is None:
            self.bias = base.repeat(self.g, 1)[None]  # (1, G·C, Kc)
        else:
            slopes = bias.slopes.detach().to(device=dev, dtype=self.dtype)
            alibi = -slopes[:, None, None] * dist.clamp(min=0).to(self.dtype)  # (Hq, C, Kc)
            self.bias = (alibi + base).reshape(self.hkv, self.rows, kc)
        #: (chunks, Kc): the column holds an unpadded key of the chunk's own head.
        self.cols: Tensor | None = None
        #: (chunks, C): rows whose band holds no such key (zeroed after the softmax).
        self.empty: Tensor | None = None
        #: (n, 1, Kc): columns before a head's first key in its chunks 0 … n−1 (True = masked).
        self.front: Tensor | None = None
        if key_padding_mask is not None:
            self.cols = self._columns(key_padding_mask)
            counts = F.pad(self.cols.long().cumsum(1), (1, 0))
            hi = (kc - c) + torch.arange(c, device=dev)  # each row's last band column
            lo = (hi - w + 1).clamp(min=0)
            empty = (counts[:, hi + 1] - counts[:, lo]) == 0
            self.empty = empty if bool(empty.any()) else None
        elif self.n:
            # Only min(n, nb) + 1 rows (the last all False when nb > n): a mask of every
            # chunk would be large enough for an OpenMP region in this thread, whose team
            # then spins on a core while the workers run.
            nf = min(self.n, self.nb)
            j = torch.arange(nf + 1, device=dev)[:, None]
            #: (nf + 1, 1, Kc): row j for a head's chunk j < nf, row nf for all later ones.
            self.front_rows = (col < (self.n - j) * c)[:, None, :]
            self.front = self.front_rows[:nf]

    def _columns(self, key_padding_mask: Tensor) -> Tensor:
        dev = self.device
        col = torch.arange(self.kc, device=dev)
        if self.single:
            pos = (self.first + col)[None, :]  # (1, Kc)
        else:
            j = torch.arange(self.nb, device=dev)[:, None]
            pos = self.first + (j - self.n) * self.c + col[None, :]  # (nb, Kc)
        inside = (pos >= self.first) & (pos < self.tk)
        valid = key_padding_mask.to(device=dev, dtype=torch.bool)
        at = pos.clamp(0, self.tk - 1).flatten()
        cols = inside[None] & valid[:, at].view(self.b, *pos.shape)  # (B, nb, Kc)
        return cols[:, None].expand(self.b, self.hkv, *pos.shape).reshape(self.chunks, self.kc)

    def probs(self, qc: Tensor, ks: Tensor, f0: int, f1: int, out: Tensor | None) -> Tensor:
        """Softmax probabilities (f1−f0, G·C, Kc) of chunks f0 … f1−1 from their query rows
        and key spans, computed in place in ``out`` if given (else differentiably)."""
        bias = self.bias
        if bias.shape[0] > 1:  # ALiBi: one bias per kv head
            bias = bias[torch.arange(f0, f1, device=self.device) // self.nb % self.hkv]
        s = torch.baddbmm(bias, qc, ks.transpose(1, 2), alpha=self.scale, out=out)
        if self.cols is not None:
            s.masked_fill_(~self.cols[f0:f1, None, :], -math.inf)
        elif self.front is not None:
            # Chunks 0 … n−1 of the heads inside the step: a slice per head, or a gathered
            # mask when the step holds many heads.
            nf, heads = self.front.shape[0], range(f0 // self.nb, (f1 - 1) // self.nb + 1)
            if len(heads) > 2:
                j = torch.arange(f0, f1, device=self.device) % self.nb
                s.masked_fill_(self.front_rows[j.clamp_(max=nf)], -math.inf)
            for h in heads if len(heads) <= 2 else ():
                lo, hi = max(h * self.nb, f0), min(h * self.nb + nf, f1)
                if lo < hi:
                    j0 = lo - h * self.nb
                    s[lo - f0 : hi - f0].masked_fill_(self.front[j0 : j0 + hi - lo], -math.inf)
        empty = None
        if self.empty is not None:
            # Rows with no visible key: re-opened so that the softmax stays finite (no NaN in
            # its backward either), their probabilities zeroed after it.
            empty = self.empty[f0:f1, None, :, None]
            s.view(f1 - f0, self.g, self.c, self.kc).masked_fill_(empty, 0.0)
        p = torch.softmax(s, -1, out=s if out is not None else None)
        if empty is not None:
            view = p.view(f1 - f0, self.g, self.c, self.kc)
            view = (
                view.masked_fill_(empty, 0.0) if out is not None else view.masked_fill(empty, 0.0)
            )
            p = view.view(f1 - f0, self.rows, self.kc)
        return p

    # -- flat tensors ----------------------------------------------------------------------

    def buffer(self, chunks: int) -> Tensor:
        """Room for the scores of ``chunks`` chunks."""
        return torch.empty(chunks * self.rows * self.kc, dtype=self.dtype, device=self.device)

    def scores(self, buf: Tensor, chunks: int) -> Tensor:
        """The first ``chunks`` chunks' scores in ``buf``: (chunks, G·C, Kc)."""
        return buf[: chunks * self.rows * self.kc].view(chunks, self.rows, self.kc)

    def queries(self, x: Tensor) -> Tensor:
        """(B, Hq, Tq, D) as query chunks (chunks, G·C, D) in the compute dtype: a view when
        :attr:`q_view` (and x is contiguous in that dtype); dummy and padding rows are zero."""
        b, hkv, g, c, d, seg = self.b, self.hkv, self.g, self.c, self.d, self.nb * self.c
        x = x.to(self.dtype)
        if self.q_view:  # contiguous: the backward views query rows with as_strided
            return x.contiguous().view(self.chunks, self.rows, d)
        x = x.reshape(b, hkv, g, self.tq, d)
        x = F.pad(x, (0, 0, self.pre, seg - self.tq - self.pre))
        return x.view(b, hkv, g, self.nb, c, d).transpose(2, 3).reshape(self.chunks, self.rows, d)

    def new_queries(self, like: Tensor) -> tuple[Tensor, Tensor]:
        """An uninitialized q-shaped result in ``like``'s dtype, and its chunks (chunks, G·C,
        D) to write in the compute dtype (the same memory when :attr:`q_view`)."""
        if self.q_view and like.dtype == self.dtype:
            out = like.new_empty(self.b, self.hq, self.tq, self.d)
            return out, out.view(self.chunks, self.rows, self.d)
        flat = like.new_empty(self.chunks, self.rows, self.d, dtype=self.dtype)
        return flat, flat  # converted by :meth:`finish_queries`

    def finish_queries(self, result: Tensor, flat: Tensor, dtype: torch.dtype) -> Tensor:
        """The q-shaped result of :meth:`new_queries` once its chunks are written."""
        if result is not flat:
            return result
        b, hkv, g, c, d = self.b, self.hkv, self.g, self.c, self.d
        x = flat.view(b, hkv, self.nb, g, c, d).transpose(2, 3)
        x = x.reshape(b, self.hq, self.nb * c, d)[:, :, self.pre : self.pre + self.tq]
        return x.to(dtype).contiguous()

    def new_keys(self, like: Tensor) -> tuple[Tensor, Tensor]:
        """An uninitialized k-shaped result and its key chunks (chunks, C, D) in the compute
        dtype (the same memory when :attr:`k_view`; single: (B·Hkv·Tk, D) rows, zeroed)."""
        shape = (self.b, self.hkv, self.tk, self.d)
        if self.single:
            flat = like.new_zeros(self.heads * self.tk, self.d, dtype=self.dtype)
            return flat.view(shape), flat
        if self.k_view and like.dtype == self.dtype:
            out = like.new_empty(shape)
            return out, out.view(self.chunks, self.c, self.d)
        flat = like.new_empty(self.chunks, self.c, self.d, dtype=self.dtype)
        return flat, flat

    def finish_keys(self, result: Tensor, flat: Tensor, dtype: torch.dtype) -> Tensor:
        """The k-shaped result of :meth:`new_keys` once its chunks are written; zeros before
        the first flat key."""
        if result is not flat:
            return result.to(dtype)
        keys = flat.view(self.b, self.hkv, self.nb * self.c, self.d)[:, :, : self.tk - self.first]
        return F.pad(keys, (0, 0, self.first, 0)).to(dtype).contiguous()


class Keys:
    """Key (or value) spans of a call: views of flat key rows (see the module docstring)."""

    def __init__(self, lay: Layout, x: Tensor) -> None:
        self.lay = lay
        nc, d = lay.n * lay.c, lay.d
        x = x.to(lay.dtype).contiguous()  # rows are also viewed with as_strided
        self.head: Tensor | None = None
        if lay.single:
            self.flat = x.reshape(lay.heads * lay.tk, d)
            self.start, self.step = lay.first, lay.tk
        elif lay.k_view:
            # k itself; chunk f's span starts at row f·C − n·C. Chunks 0 … n−1 read a small
            # copy of the first n·C rows behind n·C zero rows instead.
            self.flat = x.reshape(-1, d)
            self.start, self.step = -nc, lay.c
            if nc:
                self.head = self.flat.new_zeros(2 * nc, d)
                first = self.flat[:nc]
                self.head[nc : nc + first.shape[0]] = first
        else:
            # A padded copy: n·C zero rows, then each head's keys from ``first`` on, padded
            # to nb·C rows.
            seg, used = lay.nb * lay.c, lay.tk - lay.first
            self.flat = x.new_zeros(nc + lay.heads * seg, d)
            view = self.flat[nc:].view(lay.b, lay.hkv, seg, d)
            view[:, :, :used] = x[:, :, lay.first :]
            self.start, self.step = 0, lay.c

    def spans(self, f0: int, f1: int) -> Tensor:
        """(f1−f0, Kc, D) view: the spans of chunks f0 … f1−1 (a step never straddles n when
        the head copy is in use)."""
        flat, start = self.flat, self.start + f0 * self.step
        if start < 0:
            assert self.head is not None
            flat, start = self.head, f0 * self.step
        return _windows(flat, start, self.step, f1 - f0, self.lay.kc)

    def block(self, p0: int, heads: int, j0: int, j1: int) -> Tensor:
        """(heads, j1−j0, Kc, D) view: the spans of chunks j0 … j1−1 of the ``heads`` heads
        from chunk p0 on (for the fused kernel). Chunks before a head's n-th, with k viewed
        in place, read a copy of each head's first n·C keys behind n·C zero rows."""
        lay, d = self.lay, self.lay.d
        if self.start < 0 and j0 < lay.n:
            nc, seg = lay.n * lay.c, lay.nb * lay.c
            buf = self.flat.new_zeros(heads, 2 * nc, d)
            keys = self.flat[p0 * lay.c : p0 * lay.c + heads * seg].view(heads, seg, d)
            buf[:, nc:] = keys[:, :nc]
            size, strides = (heads, j1 - j0, lay.kc, d), (2 * nc * d, lay.c * d, d, 1)
            return buf.as_strided(size, strides, j0 * lay.c * d)
        start = self.flat.storage_offset() + (self.start + (p0 + j0) * self.step) * d
        strides = (lay.nb * self.step * d, self.step * d, d, 1)
        return self.flat.as_strided((heads, j1 - j0, lay.kc, d), strides, start)


def _windows(flat: Tensor, start: int, step: int, count: int, size: int) -> Tensor:
    """(count, size, D) view of rows start + i·step … + size − 1 of flat (rows, D)."""
    rows = flat[start : start + (count - 1) * step + size]
    return rows.unfold(0, size, step).transpose(1, 2)


class BlockLocal(torch.autograd.Function):
    """Block-local sliding-window attention without dropout; saves q, k, v and the output."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, lay: Layout) -> Tensor:
        qf, keys, values = lay.queries(q), Keys(lay, k), Keys(lay, v)
        result, out = lay.new_queries(q)

        def part(p0: int, p1: int, state: dict[str, Tensor]) -> None:
            if lay.fused:
                _forward_fused(lay, qf, keys, values, out, p0, p1)
                return
            buf = state.get("scores")
            if buf is None:
                buf = state["scores"] = lay.buffer(lay.most)
            for f0, f1 in lay.steps(p0, p1):
                p = lay.probs(qf[f0:f1], keys.spans(f0, f1), f0, f1, lay.scores(buf, f1 - f0))
                torch.bmm(p, values.spans(f0, f1), out=out[f0:f1])

        run_parts(lay.parts, lay.workers, part)
        result = lay.finish_queries(result, out, q.dtype)
        ctx.lay = lay
        ctx.save_for_backward(q, k, v, result)
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        lay: Layout = ctx.lay
        q, k, v, out = ctx.saved_tensors
        bwd = _Backward(lay, q, k, v, out, grad)
        run_parts(lay.parts, lay.workers, bwd.single if lay.single else bwd.chunks)
        return (
            lay.finish_queries(bwd.dq_result, bwd.dq, q.dtype),
            lay.finish_keys(bwd.dk_result, bwd.dk, k.dtype),
            lay.finish_keys(bwd.dv_result, bwd.dv, v.dtype),
            None,
        )


def _forward_fused(
    lay: Layout, qf: Tensor, keys: Keys, values: Keys, out: Tensor, p0: int, p1: int
) -> None:
    """The output of part [p0, p1) from torch's fused CPU attention kernel (the one behind
    SDPA on a CPU), called on the chunks as a batch with their spans as key/value views and
    the band (and ALiBi) as an additive mask: per group of heads, two calls, chunks 0 … n−1
    of each head (whose mask also hides the columns before the head's first key) and the
    others. The kernel returns new tensors: groups keep those to about one step's size."""
    nb, rows, d = lay.nb, lay.rows, lay.d
    group = max(1, STEP_SCORES // (nb * rows * d))  # heads per call
    front = 0 if lay.front is None else lay.front.shape[0]
    for g0 in range(p0, p1, group * nb):
        heads = min(group, (p1 - g0) // nb)
        q4 = qf[g0 : g0 + heads * nb].view(heads, nb, rows, d)
        o4 = out[g0 : g0 + heads * nb].view(heads, nb, rows, d)
        bias = lay.bias  # (1 or Hkv, G·C, Kc)
        if bias.shape[0] > 1:
            bias = bias[torch.arange(g0 // nb, g0 // nb + heads, device=lay.device) % lay.hkv]
        bias = bias[:, None]
        if front < nb:
            o4[:, front:] = _FUSED(
                q4[:, front:],
                keys.block(g0, heads, front, nb),
                values.block(g0, heads, front, nb),
                attn_mask=bias,
                scale=lay.scale,
            )[0]
        if front:
            assert lay.front is not None
            o4[:, :front] = _FUSED(
                q4[:, :front],
                keys.block(g0, heads, 0, front),
                values.block(g0, heads, 0, front),
                attn_mask=bias.masked_fill(lay.front[None], -math.inf),
                scale=lay.scale,
            )[0]


class _Backward:
    """The backward of :class:`BlockLocal`, part by part (see :func:`run_parts`)."""

    def __init__(self, lay: Layout, q: Tensor, k: Tensor, v: Tensor, out: Tensor, grad: Tensor):
        self.lay = lay
        self.qf, self.do, self.of = lay.queries(q), lay.queries(grad), lay.queries(out)
        self.keys, self.values = Keys(lay, k), Keys(lay, v)
        self.dq_result, self.dq = lay.new_queries(q)
        self.dk_result, self.dk = lay.new_keys(k)
        self.dv_result, self.dv = lay.new_keys(v)

    def _ds(self, f0: int, f1: int, out: Tensor) -> Tensor:
        """dP·scale of chunks f0 … f1−1 in ``out`` (contiguous), minus δ·scale,
        δ = rowsum(dO ∘ O), in one ``baddbmm`` (δ as its input, expanded); the caller
        multiplies by P."""
        lay, do, vs = self.lay, self.do[f0:f1], self.values.spans(f0, f1)
        delta = torch.linalg.vecdot(do, self.of[f0:f1]).mul_(lay.scale)[..., None]
        delta = delta.expand(out.shape)
        return torch.baddbmm(delta, do, vs.transpose(1, 2), beta=-1, alpha=lay.scale, out=out)

    def single(self, p0: int, p1: int, state: dict[str, Tensor]) -> None:
        """One chunk per head: dK, dV of a span are written straight into its keys' rows."""
        lay = self.lay
        if "p" not in state:
            state["p"], state["ds"] = lay.buffer(lay.most), lay.buffer(lay.most)
        for f0, f1 in lay.steps(p0, p1):
            m = f1 - f0
            ks = self.keys.spans(f0, f1)
            p = lay.probs(self.qf[f0:f1], ks, f0, f1, lay.scores(state["p"], m))
            ds = self._ds(f0, f1, lay.scores(state["ds"], m)).mul_(p)
            torch.bmm(ds, ks, out=self.dq[f0:f1])
            start = f0 * lay.tk + lay.first
            rows = _windows(self.dk, start, lay.tk, m, lay.kc)
            torch.bmm(ds.transpose(1, 2), self.qf[f0:f1], out=rows)
            rows = _windows(self.dv, start, lay.tk, m, lay.kc)
            torch.bmm(p.transpose(1, 2), self.do[f0:f1], out=rows)

    def chunks(self, p0: int, p1: int, state: dict[str, Tensor]) -> None:
        """Several chunks per head: per step, P and dS·scale of its query chunks go to
        rolling buffers with the diagonal chunk stride; dK, dV of the key chunks whose n+1
        query chunks are all there then come from one matmul each (module docstring). A
        part is whole heads: past its end, the diagonal reads zeros."""
        lay = self.lay
        n, rows, kc, c, d, stride = lay.n, lay.rows, lay.kc, lay.c, lay.d, lay.stride
        slots = n + max(min(ROLL * lay.most, lay.part_chunks), n)
        if "s" not in state:
            state["s"] = lay.buffer(lay.most)
            # Slots of P and dS·scale, chunk after chunk. A slot is never read before it is
            # written, and the gaps between slots are never read.
            state["p"] = self.qf.new_empty(slots * stride)
            state["ds"] = self.qf.new_empty(slots * stride)
        sbuf, pg, dsg = state["s"], state["p"], state["ds"]

        def grid(buf: Tensor, s0: int, count: int) -> Tensor:
            """Slots s0 … s0+count−1 as (count, G·C, Kc) score matrices."""
            return buf.as_strided((count, rows, kc), (stride, kc, 1), s0 * stride)

        def diagonal(buf: Tensor, s0: int, count: int) -> Tensor:
            """For key chunks whose first query chunk is in slot s0, …: (count, C,
            (n+1)·G·C), the tiles of their n+1 query chunks (left factor of dK = dSᵀ·Q)."""
            view = buf.as_strided((count, (n + 1) * rows, c), (stride, kc, 1), s0 * stride + n * c)
            return view.transpose(1, 2)

        def window(x: Tensor, f: int, count: int) -> Tensor:
            """Rows of query chunks f … f+n for key chunks f … f+count−1."""
            start = x.storage_offset() + f * rows * d
            return x.as_strided((count, (n + 1) * rows, d), (rows * d, d, 1), start)

        def room(base: int, m: int) -> int:
            """Slot of chunk f0 − n once the next m chunks fit after it: when they do not,
            the last n chunks move to slots 0 … n−1 (every ROLL steps or so)."""
            if base + n + m <= slots:
                return base
            for buf in (pg, dsg):
                tail = buf[base * stride : (base + n) * stride]
                buf[: n * stride].copy_(tail.clone() if base < n else tail)
            return 0

        base = 0  # slot of chunk f0 − n
        for f0, f1 in lay.steps(p0, p1):
            m = f1 - f0
            base = room(base, m)
            ks = self.keys.spans(f0, f1)
            scores = lay.scores(sbuf, m)
            p = grid(pg, base + n, m).copy_(lay.probs(self.qf[f0:f1], ks, f0, f1, scores))
            ds = torch.mul(self._ds(f0, f1, scores), p, out=grid(dsg, base + n, m))
            torch.bmm(ds, ks, out=self.dq[f0:f1])
            # Key chunks f0−n … f1−n−1 now have all their query chunks in the buffers.
            k0, k1 = max(f0 - n, p0), f1 - n
            if k1 > k0:
                s0 = base + k0 - (f0 - n)
                torch.bmm(
                    diagonal(pg, s0, k1 - k0), window(self.do, k0, k1 - k0), out=self.dv[k0:k1]
                )
                torch.bmm(
                    diagonal(dsg, s0, k1 - k0), window(self.qf, k0, k1 - k0), out=self.dk[k0:k1]
                )
            base += m
        # The part's last key chunks: their query chunks past the part are zeros.
        t0 = max(p1 - n, p0)
        count = p1 - t0
        if count == 0:
            return
        base = room(base, n)
        grid(pg, base + n, n).zero_()
        grid(dsg, base + n, n).zero_()
        s0 = base + t0 - (p1 - n)
        for x, buf, out in ((self.do, pg, self.dv), (self.qf, dsg, self.dk)):
            tail = x.new_zeros((count + n) * rows, d)
            tail[: count * rows] = x[t0:p1].reshape(-1, d)
            torch.bmm(diagonal(buf, s0, count), window(tail, 0, count), out=out[t0:p1])


def block_local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    groups: int,
    *,
    bias: DistanceBias | None = None,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    chunk: int | None = None,
) -> Tensor:
    """Sliding-window attention of (B, Hq, Tq, D) queries over (B, Hkv, Tk, D) keys and
    values (shapes already checked, ``groups`` = Hq // Hkv); see the module docstring."""
    lay = Layout(q, k, window, groups, bias, key_padding_mask, chunk)
    if dropout_p == 0.0:
        return BlockLocal.apply(q, k, v, lay)
    # Dropout: the same steps under plain autograd, which keeps every step's probabilities.
    qf, keys, values = lay.queries(q), Keys(lay, k), Keys(lay, v)
    parts = []
    for f0, f1 in lay.steps(0, lay.chunks):
        p = lay.probs(qf[f0:f1], keys.spans(f0, f1), f0, f1, None)
        p = F.dropout(p, p=dropout_p, training=True)
        parts.append(torch.bmm(p, values.spans(f0, f1)))
    flat = torch.cat(parts)
    return lay.finish_queries(flat, flat, q.dtype)
