"""Causal sliding-window attention as a Triton kernel, forward and backward, O(L·W).

A query at absolute position p attends the keys p−W+1 … p (local attention: Longformer,
Beltagy et al. 2020; Mistral 7B, Jiang et al. 2023). Queries are aligned bottom-right: query
i of Tq sits at key position Tk−Tq+i, as a KV cache presents them.

Algorithm (FlashAttention-2, Dao 2023, restricted to a band):

- Forward: one program per (block of BLOCK_M queries, batch·query head). It visits only the
  key blocks that meet the window of some query of its block, the key range
  [p₀−W+1, p₀+BLOCK_M), and keeps an online softmax: a running row max m, row sum l and
  un-normalized output, rescaled by exp(m_old − m_new) when the max grows. It stores the
  output and the log-sum-exp (base 2) of every row; nothing of size L×L or L×W is stored.
- Backward: scores and probabilities are recomputed from the saved log-sum-exp.
  δ = rowsum(dO ∘ O) is computed first. One kernel runs over key blocks and accumulates
  dK, dV in registers over every query block that can see them and over every query head of
  the GQA group (q head h reads kv head h // G), then stores them once; a second kernel runs
  over query blocks for dQ. No atomics, so gradients are bit-identical between runs.

Compute and memory are O(L·(W + BLOCK)) per head. The window is a runtime argument (no
recompilation per window). Scores and softmax are fp32, matmuls accumulate in fp32; inputs may
be fp32 (matmuls in IEEE fp32, not TF32, so the kernel matches PyTorch's fp32 precision),
fp16 or bf16. ALiBi-style distance biases (:class:`~llmkit.components.base.DistanceBias`) are
read as per-head slopes: score − slope·(p − j). ``key_padding_mask`` (B, Tk), True where a key
may be attended, is applied in the kernel; a query left with no key returns zeros (and zero
gradients), like the PyTorch reference. Dropout is not supported: the component uses the
reference path for it.

The PyTorch reference is
:func:`llmkit.components.attention.sliding_window.sliding_window_attention`.

Kernels are plain functions jitted on first launch, once per mode (interpreted when
``TRITON_INTERPRET=1`` at call time, compiled otherwise): ``triton.jit`` freezes that choice
when it runs, and jitting lazily keeps this module independent of import order.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from llmkit.components.attention.dense import check_shapes
from llmkit.kernels import runtime

#: Input dtypes the kernel accepts.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Largest head dimension the kernel accepts.
MAX_HEAD_DIM = 256

_LOG2E = 1.4426950408889634


def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    SLOPES,
    PAD,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sob,
    soh,
    sot,
    HQ,
    GROUPS,
    TQ,
    TK,
    WINDOW,
    HEAD_DIM,
    qk_scale,
    HAS_BIAS: tl.constexpr,
    HAS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = (h // GROUPS).to(tl.int64)
    offset = TK - TQ  # key position of query 0

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < TQ
    d_ok = offs_d < HEAD_DIM
    qpos = offs_m + offset

    q_ptrs = Q + b * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqt + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    if HAS_BIAS:
        slope = tl.load(SLOPES + h) * 1.4426950408889634  # in log2 units, like the scores

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Only key blocks meeting the window of some query of this block: [p₀−W+1, p₀+BLOCK_M).
    lo = (tl.maximum(offset + m0 - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(offset + m0 + BLOCK_M, TK)
    for n0 in range(lo, hi, BLOCK_N):
        kpos = n0 + offs_n
        n_ok = kpos < TK
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kpos[:, None] * skt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        dist = qpos[:, None] - kpos[None, :]
        keep = (dist >= 0) & (dist < WINDOW) & n_ok[None, :]
        if HAS_BIAS:
            s -= slope * dist.to(tl.float32)
        if HAS_PAD:
            valid = tl.load(PAD + b * TK + kpos, mask=n_ok, other=0)
            keep &= (valid != 0)[None, :]
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + kpos[:, None] * svt + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    has_key = l_i > 0.0  # False only for a query whose window is all padding
    l_safe = tl.where(has_key, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = O + b * sob + h.to(tl.int64) * soh + offs_m[:, None] * sot + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    lse = tl.where(has_key, m_i + tl.log2(l_safe), 0.0)
    tl.store(LSE + pid_bh.to(tl.int64) * TQ + offs_m, lse, mask=m_ok)


def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    SLOPES,
    PAD,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sob,
    soh,
    sot,
    HQ,
    HKV,
    GROUPS,
    TQ,
    TK,
    WINDOW,
    HEAD_DIM,
    qk_scale,
    sm_scale,
    HAS_BIAS: tl.constexpr,
    HAS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    hk = pid_bh % HKV
    offset = TK - TQ

    n0 = pid_n * BLOCK_N
    kpos = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = kpos < TK
    d_ok = offs_d < HEAD_DIM
    kv_mask = n_ok[:, None] & d_ok[None, :]

    k_ptrs = K + b * skb + hk.to(tl.int64) * skh + kpos[:, None] * skt + offs_d[None, :]
    v_ptrs = V + b * svb + hk.to(tl.int64) * svh + kpos[:, None] * svt + offs_d[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    key_ok = n_ok
    if HAS_PAD:
        valid = tl.load(PAD + b * TK + kpos, mask=n_ok, other=0)
        key_ok &= valid != 0

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Queries that see a key of this block sit at key positions [n₀, n₀+BLOCK_N+W−1).
    lo = (tl.maximum(n0 - offset, 0) // BLOCK_M) * BLOCK_M
    hi = tl.minimum(n0 + BLOCK_N + WINDOW - 1 - offset, TQ)
    for g in range(GROUPS):
        h = hk * GROUPS + g
        bh = b * HQ + h
        q_base = Q + b * sqb + h.to(tl.int64) * sqh
        do_base = DO + b * sob + h.to(tl.int64) * soh
        if HAS_BIAS:
            slope = tl.load(SLOPES + h) * 1.4426950408889634
        for m0 in range(lo, hi, BLOCK_M):
            offs = m0 + offs_m
            m_ok = offs < TQ
            q_mask = m_ok[:, None] & d_ok[None, :]
            q = tl.load(q_base + offs[:, None] * sqt + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(do_base + offs[:, None] * sot + offs_d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(LSE + bh * TQ + offs, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + bh * TQ + offs, mask=m_ok, other=0.0)
            # Transposed scores (keys × queries), so dK and dV accumulate row-wise.
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale
            dist = (offs + offset)[None, :] - kpos[:, None]
            keep = (dist >= 0) & (dist < WINDOW) & key_ok[:, None] & m_ok[None, :]
            if HAS_BIAS:
                s_t -= slope * dist.to(tl.float32)
            p_t = tl.where(keep, tl.exp2(s_t - lse[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PREC)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PREC)

    # dK, dV are contiguous (B, Hkv, Tk, D).
    base = (b * HKV + hk) * TK * HEAD_DIM
    d_ptrs = base + kpos[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + d_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + d_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)


def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    SLOPES,
    PAD,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sob,
    soh,
    sot,
    HQ,
    GROUPS,
    TQ,
    TK,
    WINDOW,
    HEAD_DIM,
    qk_scale,
    sm_scale,
    HAS_BIAS: tl.constexpr,
    HAS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = (h // GROUPS).to(tl.int64)
    offset = TK - TQ

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < TQ
    d_ok = offs_d < HEAD_DIM
    q_mask = m_ok[:, None] & d_ok[None, :]
    qpos = offs_m + offset

    q_ptrs = Q + b * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqt + offs_d[None, :]
    do_ptrs = DO + b * sob + h.to(tl.int64) * soh + offs_m[:, None] * sot + offs_d[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    do = tl.load(do_ptrs, mask=q_mask, other=0.0)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * TQ + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * TQ + offs_m, mask=m_ok, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    if HAS_BIAS:
        slope = tl.load(SLOPES + h) * 1.4426950408889634

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = (tl.maximum(offset + m0 - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(offset + m0 + BLOCK_M, TK)
    for n0 in range(lo, hi, BLOCK_N):
        kpos = n0 + offs_n
        n_ok = kpos < TK
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kpos[:, None] * skt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + kpos[:, None] * svt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        dist = qpos[:, None] - kpos[None, :]
        keep = (dist >= 0) & (dist < WINDOW) & n_ok[None, :] & m_ok[:, None]
        if HAS_BIAS:
            s -= slope * dist.to(tl.float32)
        if HAS_PAD:
            valid = tl.load(PAD + b * TK + kpos, mask=n_ok, other=0)
            keep &= (valid != 0)[None, :]
        p = tl.where(keep, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)

    # dQ is contiguous (B, Hq, Tq, D).
    dq_ptrs = (
        DQ + pid_bh.to(tl.int64) * TQ * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    )
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


def _blocks(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). 16×16 in the interpreter; on a GPU, tiles whose shared
    memory (checked by compiling for sm_80/86/90) fits a 99 KB consumer-GPU limit."""
    if device.type != "cuda":
        return 16, 16, 1
    if dtype == torch.float32:
        return (32, 32, 4) if head_dim <= 64 else (16, 16, 4)
    if head_dim <= 64:
        return 64, 64, 4
    return (64, 32, 4) if head_dim <= 128 else (32, 32, 8)


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class SlidingWindowAttentionFunction(torch.autograd.Function):
    """Autograd wrapper of the Triton sliding-window kernels (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        window: int,
        slopes: Tensor | None,
        pad: Tensor | None,
        block_m: int | None,
        block_n: int | None,
    ) -> Tensor:
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        b, hq, tq, d = q.shape
        hkv, tk = k.shape[1], k.shape[2]
        w = min(window, tk)  # no query has more than Tk keys behind it
        bm, bn, warps = _blocks(d, q.dtype, q.device)
        bm, bn = block_m or bm, block_n or bn
        o = torch.empty(b, hq, tq, d, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, hq, tq, dtype=torch.float32, device=q.device)
        sm_scale = 1.0 / math.sqrt(d)
        prec = "ieee" if q.dtype == torch.float32 else "tf32"
        block_d = max(16, triton.next_power_of_2(d))
        dummy = lse  # any pointer stands in for absent slopes / padding (never read)
        runtime.kernel(_fwd_kernel)[(triton.cdiv(tq, bm), b * hq)](
            q,
            k,
            v,
            o,
            lse,
            dummy if slopes is None else slopes,
            dummy if pad is None else pad,
            *_strides(q),
            *_strides(k),
            *_strides(v),
            *_strides(o),
            hq,
            hq // hkv,
            tq,
            tk,
            w,
            d,
            sm_scale * _LOG2E,
            HAS_BIAS=slopes is not None,
            HAS_PAD=pad is not None,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_D=block_d,
            DOT_PREC=prec,
            num_warps=warps,
        )
        ctx.save_for_backward(q, k, v, o, lse, slopes, pad)
        ctx.meta = (w, bm, bn, block_d, warps, prec)
        return o

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, do: Tensor):
        q, k, v, o, lse, slopes, pad = ctx.saved_tensors
        w, bm, bn, block_d, warps, prec = ctx.meta
        b, hq, tq, d = q.shape
        hkv, tk = k.shape[1], k.shape[2]
        do = do.contiguous()  # same layout as o
        delta = (do.float() * o.float()).sum(-1)  # (B, Hq, Tq), δ = rowsum(dO ∘ O)
        dq = torch.empty(b, hq, tq, d, dtype=q.dtype, device=q.device)
        dk = torch.empty(b, hkv, tk, d, dtype=k.dtype, device=k.device)
        dv = torch.empty(b, hkv, tk, d, dtype=v.dtype, device=v.device)
        sm_scale = 1.0 / math.sqrt(d)
        dummy = lse
        common = (
            *_strides(q),
            *_strides(k),
            *_strides(v),
            *_strides(do),
        )
        flags = dict(
            HAS_BIAS=slopes is not None,
            HAS_PAD=pad is not None,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_D=block_d,
            DOT_PREC=prec,
            num_warps=warps,
        )
        slopes_arg = dummy if slopes is None else slopes
        pad_arg = dummy if pad is None else pad
        runtime.kernel(_bwd_dkdv_kernel)[(triton.cdiv(tk, bn), b * hkv)](
            q, k, v, do, lse, delta, dk, dv, slopes_arg, pad_arg, *common,
            hq, hkv, hq // hkv, tq, tk, w, d, sm_scale * _LOG2E, sm_scale, **flags,
        )  # fmt: skip
        runtime.kernel(_bwd_dq_kernel)[(triton.cdiv(tq, bm), b * hq)](
            q, k, v, do, lse, delta, dq, slopes_arg, pad_arg, *common,
            hq, hq // hkv, tq, tk, w, d, sm_scale * _LOG2E, sm_scale, **flags,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None


def supported(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """True when the kernel handles these tensors (dtype, head dim, device rules)."""
    if not (q.dtype == k.dtype == v.dtype and q.dtype in DTYPES):
        return False
    if q.shape[-1] > MAX_HEAD_DIM:
        return False
    # The interpreter computes bf16 arithmetic wrongly (triton 3.9); keep bf16 off it.
    return runtime.dtype_runs(q)


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
) -> Tensor:
    """Causal sliding-window attention by the Triton kernels (differentiable).

    q (B, Hq, Tq, D); k, v (B, Hkv, Tk, D), Hq a multiple of Hkv, Tk ≥ Tq, query i at key
    position Tk−Tq+i; ``slopes`` (Hq,) ALiBi slopes (score − slope·distance);
    ``key_padding_mask`` (B, Tk) True where a key may be attended. ``block_m``/``block_n``
    override the tile sizes (powers of two ≥ 16).
    """
    check_shapes(q, k, v)  # the kernels index without bounds checks: validate first
    if window < 1:
        raise ValueError(f"window must be ≥ 1, got {window}")
    b, hq, tq = q.shape[:3]
    if tq == 0:
        return q.clone()
    if slopes is not None:
        if slopes.shape != (hq,):
            raise ValueError(f"slopes {tuple(slopes.shape)} must be ({hq},), one per query head")
        slopes = slopes.to(device=q.device, dtype=torch.float32).contiguous()
    pad = None
    if key_padding_mask is not None:
        if key_padding_mask.shape != (b, k.shape[2]):
            raise ValueError(
                f"key_padding_mask {tuple(key_padding_mask.shape)} must be (B, Tk) = "
                f"({b}, {k.shape[2]})"
            )
        pad = key_padding_mask.to(device=q.device, dtype=torch.int8).contiguous()
    return SlidingWindowAttentionFunction.apply(q, k, v, window, slopes, pad, block_m, block_n)
