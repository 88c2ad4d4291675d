"""Fused flash attention in Triton: forward and backward, causal or not, GQA/MQA, ALiBi.

Algorithm (FlashAttention-2, Dao 2023, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning"). The L×L score matrix is never materialized:

- **Forward**: one program per (query block, batch·query head). It walks the key blocks the
  block can see and keeps an online softmax per row: running max ``m``, running sum ``l`` and an
  unnormalized fp32 accumulator, rescaled by ``exp(m_old − m_new)`` whenever the max grows.
  It stores the output and the row log-sum-exp ``lse`` (base 2, fp32), O(L) extra memory.
- **Backward**: a preprocess kernel computes ``delta = rowsum(dO ∘ O)``; then
  ``P = exp(S − lse)`` is recomputed block by block (no stored probabilities):
  a dK/dV kernel (one program per key block) walks the query blocks, accumulating
  ``dV += Pᵀ dO`` and ``dK += dSᵀ Q · scale`` with ``dS = P ∘ (dP − delta)``, ``dP = dO Vᵀ``;
  a separate dQ kernel (one program per query block) walks the key blocks accumulating
  ``dQ += dS K · scale``. No atomics: every gradient element is written by exactly one
  program, in a fixed order, so backward is deterministic (bit-identical on reruns).

Scores are computed in base 2 (``exp2``; ``log2 e`` folded into the scale and the ALiBi
slopes). Matmuls take the input dtype (fp16/bf16/fp32) and accumulate in fp32; softmax
statistics are fp32. For fp32 inputs the dots are IEEE fp32 unless PyTorch allows TF32
(``torch.backends.cuda.matmul.allow_tf32``), which they then follow.

Masking: keys past ``Tk`` and queries past ``Tq`` are masked on every load and store (lengths
need not be multiples of the block). Queries are aligned bottom-right: query i sits at key
position ``Tk − Tq + i`` (a KV cache decoding ``Tq`` new tokens over ``Tk`` keys); causal
programs stop at the last key block their rows can see. ``key_padding_mask`` (B, Tk) is
supported in the kernel (one byte per key, loaded per key block); a row left with no key
gives a zero output and zero gradients, never NaN. ALiBi (``DistanceBias.slopes``) adds
``−slope·d`` with ``d = max(qpos − kpos, 0)`` when causal and ``|qpos − kpos|`` otherwise,
exactly as :meth:`~llmkit.contracts.DistanceBias.dense`. Slopes get no gradient.

Sliding window (``window`` W, causal only; :mod:`llmkit.kernels.sliding_window`): a query
at key position p also drops keys ≤ p − W. The forward and dQ programs then start at the key
block of the oldest key their first query sees, and a dK/dV program stops at the last query
whose window reaches its keys, so the work is O(L·W). W is a runtime argument: windows share
one compiled kernel (apart from Triton's own specializations of the value 1 and of multiples
of 16), and ``HAS_WINDOW`` removes all of it from the kernels compiled without a window.

Packed documents (``document_ids`` (B, Tk), non-decreasing per row; varlen attention as in
FlashAttention-2's ``cu_seqlens``, but per row of a fixed-shape batch): the launcher turns
them into each key's document span, (B, 2, Tk) int32 (first key, one past the last), and a
query at p keeps keys in ``[start(p), end(p))``. The forward and dQ programs start at the key
block of their first query's document start (whole earlier documents are skipped) and, when
not causal, stop at their last query's document end; a dK/dV program stops after the last
query of its last key's document. Only blocks that cross a document boundary are masked
(``HAS_DOCS``, compiled out without documents).

GQA/MQA: K and V are never repeated in memory. Query head ``h`` reads kv head
``h // groups``. The dK/dV program of a kv head loops over the ``groups`` query heads of its
group and sums their contributions in registers before one store: deterministic and with no
(B, Hq, Tk, D) scratch, at the price of fewer, longer programs when ``Hkv`` is small (MQA
with a small batch may leave part of a large GPU idle in this kernel).

No dropout: the kernel computes exact attention only.

Interpreter vs compiled: each kernel is jitted lazily, on first launch, once per mode
(:func:`llmkit.kernels.runtime.kernel`), so the mode follows
:func:`llmkit.kernels.runtime.interpreting` at call time, like ``use_triton``, rather than
the moment this module was imported. (Triton's own language library is still fixed when
``triton`` is first imported: the interpreter needs ``TRITON_INTERPRET=1`` set before that;
see tests/conftest.py.)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from llmkit.contracts import DistanceBias
from llmkit.kernels import runtime
from llmkit.ops import check_document_ids, check_shapes, document_bounds, sdpa_attention

__all__ = [
    "SUPPORTED_DTYPES",
    "BlockConfig",
    "block_config",
    "flash_attention",
    "flash_attention_reference",
    "kernel_supports",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Largest head dim the kernels take (the (BLOCK, D) tiles must fit in shared memory).
MAX_HEAD_DIM = 256
#: Interior key blocks (no diagonal, window edge, tail or padding mask) skip the score mask;
#: False masks every block, as before (kept for side-by-side timing on a GPU).
SKIP_INTERIOR_MASKS = True
#: CUDA's largest grid size along y and z (the kernels' grids are (blocks, heads, batch)).
_MAX_GRID_YZ = 65535


# --------------------------------------------------------------------------- kernels
# Each kernel is self-contained (no jitted helpers): a helper would have to be jitted in the
# same mode as its caller, which the lazy per-mode build above does not track.


def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    SLOPES,
    KPM,
    DOCS,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_kpm,
    stride_docb,
    H,
    TQ,
    TK,
    sm_scale,
    WINDOW,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    PRECISION: tl.constexpr,
    SKIP_MASKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Grid (query blocks, heads, batch): the y and z grid sizes are capped at 65535 each,
    # so B·H may exceed 65535 (a flattened y axis would fail to launch there).
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_bh = off_b * H + off_h
    off_kvh = off_h // GROUPS

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < TQ
    d_valid = offs_d < HEAD_DIM
    offset = TK - TQ  # bottom-right alignment: query i sits at key position offset + i
    q_pos = offs_m + offset

    Q += off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    K += off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
    V += off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
    O += off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    KPM += off_b.to(tl.int64) * stride_kpm

    q_ptrs = Q + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=m_valid[:, None] & d_valid[None, :], other=0.0)

    # Scalars typed explicitly: a caller inside torch.compile may pass Python floats as fp64,
    # and an fp64 value would change the type of the loop-carried m_i/acc.
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): softmax in base 2
    if HAS_BIAS:
        slope = tl.load(SLOPES + off_h).to(tl.float32) * 1.4426950408889634
    hi = tl.minimum(TK, offset + (start_m + 1) * BLOCK_M) if CAUSAL else TK
    # A window: start at the key block of the oldest key the first query of the block sees.
    lo = (tl.maximum(offset + start_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
    lo = lo if HAS_WINDOW else 0
    if HAS_DOCS:
        # Packed documents: row 0 of DOCS holds the first key of each key's document, row 1
        # one past its last. Rows see keys in [start, end) only; the key blocks before the
        # first row's document are skipped (and after the last row's, without causality).
        DOCS += off_b.to(tl.int64) * stride_docb
        q_start = tl.load(DOCS + q_pos, mask=m_valid, other=0)
        q_end = tl.load(DOCS + TK + q_pos, mask=m_valid, other=TK)
        lo = tl.maximum(lo, (tl.load(DOCS + offset + start_m * BLOCK_M) // BLOCK_N) * BLOCK_N)
        if not CAUSAL:
            hi = tl.minimum(hi, tl.max(tl.where(m_valid, q_end, 0), 0))
        doc_lo = tl.max(q_start, 0)  # keys from here on are in every row's document …
        doc_hi = tl.min(q_end, 0)  # … up to here
    rows_n = (lo + offs_n)[:, None].to(tl.int64)  # Tk·stride may pass 2³¹
    k_ptrs = K + rows_n * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + rows_n * stride_vn + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        n_valid = cols < TK
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if HAS_BIAS:
            dist = (q_pos[:, None] - cols[None, :]).to(tl.float32)
            dist = tl.maximum(dist, 0.0) if CAUSAL else tl.abs(dist)
            s = s - slope * dist
        # Only blocks at the diagonal, the window's edge, the tail or under a padding mask
        # need the (BLOCK_M, BLOCK_N) mask; the others skip it (a branch per block).
        edge = (start_n + BLOCK_N > TK) | (HAS_KPM or not SKIP_MASKS)
        if CAUSAL:
            edge = edge | (start_n + BLOCK_N - 1 > offset + start_m * BLOCK_M)
        if HAS_WINDOW:
            edge = edge | (start_n <= offset + (start_m + 1) * BLOCK_M - 1 - WINDOW)
        if HAS_DOCS:
            edge = edge | (start_n < doc_lo) | (start_n + BLOCK_N > doc_hi)
        if edge:
            keep = n_valid[None, :]
            if CAUSAL:
                keep = keep & (cols[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                keep = keep & (cols[None, :] > q_pos[:, None] - WINDOW)
            if HAS_KPM:
                pad = tl.load(KPM + cols, mask=n_valid, other=0)
                keep = keep & (pad != 0)[None, :]
            if HAS_DOCS:
                keep = keep & (cols[None, :] >= q_start[:, None]) & (cols[None, :] < q_end[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        # The product accumulates into acc (on Hopper, in the MMA's own accumulator).
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn

    empty = l_i == 0.0  # only with a padding mask: zero output, finite lse
    l_safe = tl.where(empty, 1.0, l_i)
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    out = acc / l_safe[:, None]
    tl.store(LSE + off_bh.to(tl.int64) * TQ + offs_m, m_fin + tl.log2(l_safe), mask=m_valid)
    o_ptrs = O + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])


def _bwd_preprocess_kernel(
    O,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    H,
    TQ,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_bh = off_b * H + off_h
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < TQ
    mask = m_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_m[:, None].to(tl.int64)
    O += off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    DO += off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
    o = tl.load(O + rows * stride_om + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DO + rows * stride_dom + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + off_bh.to(tl.int64) * TQ + offs_m, delta, mask=m_valid)


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
    KPM,
    DOCS,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    stride_kpm,
    stride_docb,
    H,
    TQ,
    TK,
    sm_scale,
    WINDOW,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    PRECISION: tl.constexpr,
    SKIP_MASKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (key block, batch·kv head); works in the transposed (keys × queries)
    # orientation so that dV += Pᵀ dO and dK += dSᵀ Q need no further transposes.
    start_n = tl.program_id(0) * BLOCK_N
    off_kvh = tl.program_id(1)
    off_b = tl.program_id(2)

    offs_m = tl.arange(0, BLOCK_M)
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_valid = cols < TK
    d_valid = offs_d < HEAD_DIM
    kv_mask = n_valid[:, None] & d_valid[None, :]
    offset = TK - TQ

    K += off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
    V += off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
    rows_n = cols[:, None].to(tl.int64)
    k = tl.load(K + rows_n * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(V + rows_n * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    keep_n = n_valid
    if HAS_KPM:
        pad = tl.load(KPM + off_b.to(tl.int64) * stride_kpm + cols, mask=n_valid, other=0)
        keep_n = keep_n & (pad != 0)

    sm_scale = tl.cast(sm_scale, tl.float32)  # fp64 under a compiled caller
    qk_scale = sm_scale * 1.4426950408889634
    # Causal: start at the block of the first query that can see key start_n; with a window,
    # stop after the last query whose window still reaches the last key of the block.
    lo = (tl.maximum(start_n - offset, 0) // BLOCK_M) * BLOCK_M if CAUSAL else 0
    hi = tl.minimum(start_n + BLOCK_N + WINDOW - 1 - offset, TQ) if HAS_WINDOW else TQ
    if HAS_DOCS:
        # Only queries of these keys' documents see them: from the first key's document start
        # (the causal start is later) to the last key's document end.
        DOCS += off_b.to(tl.int64) * stride_docb
        hi = tl.minimum(hi, tl.load(DOCS + TK + tl.minimum(start_n + BLOCK_N, TK) - 1) - offset)
        if not CAUSAL:
            lo = (tl.maximum(tl.load(DOCS + start_n) - offset, 0) // BLOCK_M) * BLOCK_M

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(GROUPS):  # the query heads sharing this kv head, summed in registers
        off_h = off_kvh * GROUPS + g
        off_bh = off_b * H + off_h
        Qh = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        DOh = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        LSEh = LSE + off_bh.to(tl.int64) * TQ
        DELTAh = DELTA + off_bh.to(tl.int64) * TQ
        if HAS_BIAS:
            slope = tl.load(SLOPES + off_h).to(tl.float32) * 1.4426950408889634
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + offs_m
            m_valid = rows < TQ
            q_mask = m_valid[:, None] & d_valid[None, :]
            rows64 = rows[:, None].to(tl.int64)
            q = tl.load(
                Qh + rows64 * stride_qm + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0
            )
            do = tl.load(
                DOh + rows64 * stride_dom + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0
            )
            lse = tl.load(LSEh + rows, mask=m_valid, other=0.0)
            delta = tl.load(DELTAh + rows, mask=m_valid, other=0.0)
            q_pos = rows + offset
            s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (N, M)
            if HAS_BIAS:
                dist = (q_pos[None, :] - cols[:, None]).to(tl.float32)
                dist = tl.maximum(dist, 0.0) if CAUSAL else tl.abs(dist)
                s_t = s_t - slope * dist
            p_t = tl.exp2(s_t - lse[None, :])
            edge = (start_n + BLOCK_N > TK) | (start_m + BLOCK_M > TQ) | (HAS_KPM or not SKIP_MASKS)
            if CAUSAL:
                edge = edge | (start_n + BLOCK_N - 1 > offset + start_m)
            if HAS_WINDOW:
                edge = edge | (start_n <= offset + start_m + BLOCK_M - 1 - WINDOW)
            if HAS_DOCS:
                q_start = tl.load(DOCS + q_pos, mask=m_valid, other=0)
                q_end = tl.load(DOCS + TK + q_pos, mask=m_valid, other=TK)
                edge = edge | (start_n < tl.max(q_start, 0))
                edge = edge | (start_n + BLOCK_N > tl.min(q_end, 0))
            if edge:  # interior blocks need no mask (see the forward)
                keep = keep_n[:, None] & m_valid[None, :]
                if CAUSAL:
                    keep = keep & (cols[:, None] <= q_pos[None, :])
                if HAS_WINDOW:
                    keep = keep & (cols[:, None] > q_pos[None, :] - WINDOW)
                if HAS_DOCS:
                    keep = keep & (cols[:, None] >= q_start[None, :])
                    keep = keep & (cols[:, None] < q_end[None, :])
                p_t = tl.where(keep, p_t, 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    dk = dk * sm_scale

    DK += off_b.to(tl.int64) * stride_dkb + off_kvh.to(tl.int64) * stride_dkh
    DV += off_b.to(tl.int64) * stride_dvb + off_kvh.to(tl.int64) * stride_dvh
    tl.store(
        DK + rows_n * stride_dkn + offs_d[None, :] * stride_dkd,
        dk.to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + rows_n * stride_dvn + offs_d[None, :] * stride_dvd,
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    SLOPES,
    KPM,
    DOCS,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_dqd,
    stride_kpm,
    stride_docb,
    H,
    TQ,
    TK,
    sm_scale,
    WINDOW,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    PRECISION: tl.constexpr,
    SKIP_MASKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_bh = off_b * H + off_h
    off_kvh = off_h // GROUPS

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < TQ
    d_valid = offs_d < HEAD_DIM
    q_mask = m_valid[:, None] & d_valid[None, :]
    offset = TK - TQ
    q_pos = offs_m + offset

    Q += off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    DO += off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
    DQ += off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
    K += off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
    V += off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
    KPM += off_b.to(tl.int64) * stride_kpm

    rows64 = offs_m[:, None].to(tl.int64)
    q = tl.load(Q + rows64 * stride_qm + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    do = tl.load(DO + rows64 * stride_dom + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
    lse = tl.load(LSE + off_bh.to(tl.int64) * TQ + offs_m, mask=m_valid, other=0.0)
    delta = tl.load(DELTA + off_bh.to(tl.int64) * TQ + offs_m, mask=m_valid, other=0.0)

    sm_scale = tl.cast(sm_scale, tl.float32)  # fp64 under a compiled caller
    qk_scale = sm_scale * 1.4426950408889634
    if HAS_BIAS:
        slope = tl.load(SLOPES + off_h).to(tl.float32) * 1.4426950408889634
    hi = tl.minimum(TK, offset + (start_m + 1) * BLOCK_M) if CAUSAL else TK
    lo = (tl.maximum(offset + start_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
    lo = lo if HAS_WINDOW else 0
    if HAS_DOCS:  # as in the forward
        DOCS += off_b.to(tl.int64) * stride_docb
        q_start = tl.load(DOCS + q_pos, mask=m_valid, other=0)
        q_end = tl.load(DOCS + TK + q_pos, mask=m_valid, other=TK)
        lo = tl.maximum(lo, (tl.load(DOCS + offset + start_m * BLOCK_M) // BLOCK_N) * BLOCK_N)
        if not CAUSAL:
            hi = tl.minimum(hi, tl.max(tl.where(m_valid, q_end, 0), 0))
        doc_lo = tl.max(q_start, 0)
        doc_hi = tl.min(q_end, 0)
    rows_n = (lo + offs_n)[:, None].to(tl.int64)  # Tk·stride may pass 2³¹
    k_ptrs = K + rows_n * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + rows_n * stride_vn + offs_d[None, :] * stride_vd

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        n_valid = cols < TK
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if HAS_BIAS:
            dist = (q_pos[:, None] - cols[None, :]).to(tl.float32)
            dist = tl.maximum(dist, 0.0) if CAUSAL else tl.abs(dist)
            s = s - slope * dist
        p = tl.exp2(s - lse[:, None])
        edge = (start_n + BLOCK_N > TK) | (start_m * BLOCK_M + BLOCK_M > TQ)
        edge = edge | (HAS_KPM or not SKIP_MASKS)
        if CAUSAL:
            edge = edge | (start_n + BLOCK_N - 1 > offset + start_m * BLOCK_M)
        if HAS_WINDOW:
            edge = edge | (start_n <= offset + (start_m + 1) * BLOCK_M - 1 - WINDOW)
        if HAS_DOCS:
            edge = edge | (start_n < doc_lo) | (start_n + BLOCK_N > doc_hi)
        if edge:  # interior blocks need no mask (see the forward)
            keep = n_valid[None, :] & m_valid[:, None]
            if CAUSAL:
                keep = keep & (cols[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                keep = keep & (cols[None, :] > q_pos[:, None] - WINDOW)
            if HAS_KPM:
                pad = tl.load(KPM + cols, mask=n_valid, other=0)
                keep = keep & (pad != 0)[None, :]
            if HAS_DOCS:
                keep = keep & (cols[None, :] >= q_start[:, None]) & (cols[None, :] < q_end[:, None])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    dq = dq * sm_scale
    tl.store(
        DQ + rows64 * stride_dqm + offs_d[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty),
        mask=q_mask,
    )


# --------------------------------------------------------------------------- launch configs


class BlockConfig(NamedTuple):
    """Tile sizes and launch options of one kernel."""

    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int = 4
    num_stages: int = 2


#: GPU tiles (fwd, dkdv, dq) by padded head dim, for fp16/bf16 and for fp32. Compiled ahead of time
#: for sm_80, sm_86 and sm_90 with triton 3.6 and 3.9 (benchmarks/scripts/aot_compile_check.py, no
#: GPU needed): shared memory ≤ 96 KiB on sm_80/86 (sm_86/89 allow 99 KiB per block) and ≤ 128 KiB
#: on sm_90 (227), register spills at most a few hundred bytes. fp32 tiles are small: IEEE fp32
#: dots run on FMA units, whose operand layouts keep whole head-dim rows in registers (the 16-bit
#: tiles spilled up to ~11 KB per thread in fp32).
_GPU_CONFIGS_16BIT = (
    (64, BlockConfig(128, 64, 4, 3), BlockConfig(32, 128, 4, 3), BlockConfig(128, 32, 4, 3)),
    (128, BlockConfig(128, 64, 8, 3), BlockConfig(32, 128, 8, 2), BlockConfig(128, 32, 8, 2)),
    (256, BlockConfig(64, 32, 8, 2), BlockConfig(16, 64, 8, 2), BlockConfig(64, 16, 8, 2)),
)
_GPU_CONFIGS_FP32 = (
    (32, BlockConfig(64, 32, 4, 2), BlockConfig(16, 64, 4, 2), BlockConfig(64, 16, 4, 2)),
    (64, BlockConfig(32, 32, 4, 2), BlockConfig(16, 32, 4, 2), BlockConfig(32, 16, 4, 2)),
    (128, BlockConfig(16, 32, 4, 2), BlockConfig(16, 32, 8, 1), BlockConfig(32, 16, 4, 2)),
    (256, BlockConfig(16, 16, 4, 1), BlockConfig(16, 16, 4, 1), BlockConfig(16, 16, 4, 1)),
)
#: Sliding-window tiles (16-bit): the dense table's until a GPU sweep says otherwise.
_GPU_CONFIGS_16BIT_WINDOW = _GPU_CONFIGS_16BIT
_KERNELS = ("fwd", "dkdv", "dq")
#: Tiles that replace the table's for one kernel ("fwd", "dkdv" or "dq"), whatever the head
#: dim and dtype: benchmarks/scripts/flash_tune.py sets them to time candidates on a GPU.
TILE_OVERRIDES: dict[str, BlockConfig] = {}
#: A JSON file of measured 16-bit tiles, ``{"fwd-D64-W0": [BLOCK_M, BLOCK_N, warps, stages],
#: …}`` (kernel, padded head dim, windowed), as ``flash_tune --tiles`` writes it: its entries
#: replace the tables' in every process that sets the variable (read once).
TILES_ENV = "LLMKIT_FLASH_TILES"
_measured_tiles: dict[str, BlockConfig] | None = None


def _tiles_from_env() -> dict[str, BlockConfig]:
    global _measured_tiles
    if _measured_tiles is None:
        import json
        import os
        from pathlib import Path

        path = os.environ.get(TILES_ENV)
        raw = json.loads(Path(path).read_text()) if path else {}
        _measured_tiles = {key: BlockConfig(*map(int, cfg)) for key, cfg in raw.items()}
    return _measured_tiles


def block_config(
    kernel: str, head_dim: int, dtype: torch.dtype, windowed: bool = False
) -> BlockConfig:
    """Tile sizes for ``kernel`` ("fwd", "dkdv" or "dq").

    Under the interpreter: 16×16 tiles (each program step is a NumPy call; small tiles keep
    multi-block paths exercised on the tiny shapes tests can afford). On a GPU: the usual
    FlashAttention-2 shapes for fp16/bf16 (forward 128 queries × 64 keys; dK/dV with a
    resident block of 128 keys streaming 32 queries; dQ the transpose), shrunk as the head
    dim grows so the tiles fit shared memory and registers; much smaller tiles for fp32.
    Fixed heuristics, not autotuning: one compile per shape class and a deterministic choice.
    ``windowed`` (a sliding window) takes its own 16-bit table: the band's useful share of
    the visited blocks grows as the query tile shrinks.
    """
    if kernel not in _KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {_KERNELS}")
    if runtime.interpreting():
        return BlockConfig(16, 16, 1, 1)
    if kernel in TILE_OVERRIDES:
        return TILE_OVERRIDES[kernel]
    block_d = _block_d(head_dim)
    if dtype == torch.float32:
        table = _GPU_CONFIGS_FP32
    else:
        measured = _tiles_from_env().get(f"{kernel}-D{block_d}-W{int(windowed)}")
        if measured is not None:
            return measured
        table = _GPU_CONFIGS_16BIT_WINDOW if windowed else _GPU_CONFIGS_16BIT
    for limit, *configs in table:
        if block_d <= limit:
            return configs[_KERNELS.index(kernel)]
    return table[-1][1 + _KERNELS.index(kernel)]


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # ignored by tl.dot for fp16/bf16 operands


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _config(
    kernel: str, head_dim: int, dtype: torch.dtype, blocks, windowed: bool = False
) -> BlockConfig:
    if blocks is None:
        return block_config(kernel, head_dim, dtype, windowed)
    bm, bn = blocks
    return BlockConfig(bm, bn, 4, 2)


def kernel_supports(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """True when the Triton kernels take these inputs: one supported dtype, one device, head
    dim ≤ 256, batch and heads ≤ 65535 (CUDA's limit on the grid's y and z sizes), and not
    bf16 in the CPU interpreter (its bf16 arithmetic is wrong in triton 3.9).
    """
    return (
        q.dtype in SUPPORTED_DTYPES
        and q.dtype == k.dtype == v.dtype
        and q.shape[-1] <= MAX_HEAD_DIM
        and max(q.shape[0], q.shape[1]) <= _MAX_GRID_YZ
        and q.device == k.device == v.device
        and runtime.dtype_runs(q)
    )


# --------------------------------------------------------------------------- custom operators
# Under torch.compile the kernels run inside two PyTorch custom operators,
# ``llmkit::flash_attention_fwd`` and ``llmkit::flash_attention_bwd``, each with a fake (meta)
# implementation and the backward registered as the forward's autograd formula: the tracer sees
# one opaque node of known output shapes (``fullgraph=True`` traces a model through it) instead
# of tracing into the launcher, whose Python floats it would hand the kernel as fp64. Eager
# calls take an autograd.Function over the same two launchers (cheaper to dispatch). Optional
# arguments travel in schema-friendly form: ``window`` 0 for none, ``block_m``/``block_n`` 0 for
# the tile table's choice.
#
# Outputs and gradients take the memory order of their input: q, k and v arrive as (B, T, H, D)
# buffers viewed as (B, H, T, D) from the model's fused projection, and an output in that order
# lets the model's transpose-and-reshape (and autograd's, for dq, dk, dv) be a view, not a copy.


def _empty_as(t: Tensor) -> Tensor:
    """An uninitialized (B, H, T, D) tensor like ``t``, laid out (B, T, H, D) when ``t`` is."""
    b, h, n, d = t.shape
    if h > 1 and n > 1 and t.stride(1) < t.stride(2):
        return t.new_empty((b, n, h, d)).transpose(1, 2)
    return t.new_empty((b, h, n, d))


def _padding_bytes(key_padding_mask: Tensor | None, b: int, tk: int, device) -> Tensor | None:
    if key_padding_mask is None:
        return None
    if tuple(key_padding_mask.shape) != (b, tk):
        raise ValueError(
            f"key_padding_mask must be (B, Tk) = {(b, tk)}, got {tuple(key_padding_mask.shape)}"
        )
    return key_padding_mask.to(device=device, dtype=torch.uint8).contiguous()


def _document_spans(document_ids: Tensor | None, b: int, tk: int, device) -> Tensor | None:
    """(B, 2, Tk) int32: the first key of each key's document, and one past its last."""
    if document_ids is None:
        return None
    check_document_ids(document_ids, b, tk)
    starts, ends = document_bounds(document_ids.to(device))
    return torch.stack((starts, ends), 1).to(torch.int32).contiguous()


def _launch_config(
    kernel: str, d: int, dtype: torch.dtype, block_m: int, block_n: int, window: int
) -> BlockConfig:
    blocks = (block_m, block_n) if block_m and block_n else None
    return _config(kernel, d, dtype, blocks, window > 0)


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    slopes: Tensor | None,
    kpm: Tensor | None,
    causal: bool,
    window: int,
    block_m: int,
    block_n: int,
    docs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The forward kernel: output (B, Hq, Tq, D) in q's memory order and the base-2 row
    log-sum-exp (B, Hq, Tq), fp32. ``window`` 0 means none; ``block_m``/``block_n`` 0 the
    default tiles; ``docs`` the (B, 2, Tk) document spans of :func:`_document_spans`."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    o = _empty_as(q)
    lse = torch.empty((b, hq, tq), device=q.device, dtype=torch.float32)
    if tq == 0:
        return o, lse
    dummy = lse  # any tensor: pointers behind a False HAS_* flag are never read
    cfg = _launch_config("fwd", d, q.dtype, block_m, block_n, window)
    grid = (triton.cdiv(tq, cfg.block_m), hq, b)
    runtime.kernel(_fwd_kernel)[grid](
        q,
        k,
        v,
        o,
        lse,
        slopes if slopes is not None else dummy,
        kpm if kpm is not None else dummy,
        docs if docs is not None else dummy,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *o.stride(),
        kpm.stride(0) if kpm is not None else 0,
        docs.stride(0) if docs is not None else 0,
        hq,
        tq,
        tk,
        1.0 / math.sqrt(d),
        window,
        GROUPS=hq // hkv,
        HEAD_DIM=d,
        CAUSAL=causal,
        HAS_BIAS=slopes is not None,
        HAS_KPM=kpm is not None,
        HAS_WINDOW=window > 0,
        HAS_DOCS=docs is not None,
        PRECISION=_precision(q.dtype),
        SKIP_MASKS=SKIP_INTERIOR_MASKS,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=_block_d(d),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return o, lse


flash_attention_fwd = torch.library.custom_op(
    "llmkit::flash_attention_fwd", _forward, mutates_args=()
)


@flash_attention_fwd.register_fake
def _flash_attention_fwd_fake(q, k, v, slopes, kpm, causal, window, block_m, block_n, docs=None):
    b, hq, tq, _ = q.shape
    return _empty_as(q), q.new_empty((b, hq, tq), dtype=torch.float32)


def _backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    slopes: Tensor | None,
    kpm: Tensor | None,
    causal: bool,
    window: int,
    block_m: int,
    block_n: int,
    docs: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward kernels: (dq, dk, dv) in the inputs' dtype and memory order."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    dq, dk, dv = _empty_as(q), _empty_as(k), _empty_as(v)
    if tq == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    sm_scale = 1.0 / math.sqrt(d)
    block_d = _block_d(d)
    flags = {
        "GROUPS": hq // hkv,
        "HEAD_DIM": d,
        "CAUSAL": causal,
        "HAS_BIAS": slopes is not None,
        "HAS_KPM": kpm is not None,
        "HAS_WINDOW": window > 0,
        "HAS_DOCS": docs is not None,
        "PRECISION": _precision(q.dtype),
        "SKIP_MASKS": SKIP_INTERIOR_MASKS,
        "BLOCK_D": block_d,
    }
    slopes_arg = slopes if slopes is not None else lse
    kpm_arg = kpm if kpm is not None else lse
    kpm_stride = kpm.stride(0) if kpm is not None else 0
    docs_arg = docs if docs is not None else lse
    docs_stride = docs.stride(0) if docs is not None else 0

    delta = torch.empty_like(lse)
    pre_m = 16 if runtime.interpreting() else 64
    runtime.kernel(_bwd_preprocess_kernel)[(triton.cdiv(tq, pre_m), hq, b)](
        o,
        do,
        delta,
        *o.stride(),
        *do.stride(),
        hq,
        tq,
        HEAD_DIM=d,
        BLOCK_M=pre_m,
        BLOCK_D=block_d,
    )
    cfg = _launch_config("dkdv", d, q.dtype, block_m, block_n, window)
    runtime.kernel(_bwd_dkdv_kernel)[(triton.cdiv(tk, cfg.block_n), hkv, b)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        slopes_arg,
        kpm_arg,
        docs_arg,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *do.stride(),
        *dk.stride(),
        *dv.stride(),
        kpm_stride,
        docs_stride,
        hq,
        tq,
        tk,
        sm_scale,
        window,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **flags,
    )
    cfg = _launch_config("dq", d, q.dtype, block_m, block_n, window)
    runtime.kernel(_bwd_dq_kernel)[(triton.cdiv(tq, cfg.block_m), hq, b)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dq,
        slopes_arg,
        kpm_arg,
        docs_arg,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *do.stride(),
        *dq.stride(),
        kpm_stride,
        docs_stride,
        hq,
        tq,
        tk,
        sm_scale,
        window,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **flags,
    )
    return dq, dk, dv


flash_attention_bwd = torch.library.custom_op(
    "llmkit::flash_attention_bwd", _backward, mutates_args=()
)


@flash_attention_bwd.register_fake
def _flash_attention_bwd_fake(do, q, k, v, o, lse, slopes, kpm, causal, window, bm, bn, docs=None):
    return _empty_as(q), _empty_as(k), _empty_as(v)


def _flash_setup_context(ctx, inputs, output) -> None:
    q, k, v, slopes, kpm, causal, window, block_m, block_n, *rest = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, slopes, kpm, rest[0] if rest else None)
    ctx.args = (causal, window, block_m, block_n)
    ctx.n_inputs = len(inputs)


def _flash_backward(ctx, do, _dlse):
    q, k, v, o, lse, slopes, kpm, docs = ctx.saved_tensors
    dq, dk, dv = flash_attention_bwd(do, q, k, v, o, lse, slopes, kpm, *ctx.args, docs)
    return dq, dk, dv, *([None] * (ctx.n_inputs - 3))


flash_attention_fwd.register_autograd(_flash_backward, setup_context=_flash_setup_context)


class _EagerFlashAttention(torch.autograd.Function):
    """The same launchers for eager calls: an autograd.Function dispatches in about a third
    of a custom operator's Python time (≈ 18 against 38 µs a forward+backward on a CPU), which
    an eager step pays once per layer and kernel."""

    @staticmethod
    def forward(ctx, q, k, v, slopes, kpm, causal, window, block_m, block_n, docs):
        o, lse = _forward(q, k, v, slopes, kpm, causal, window, block_m, block_n, docs)
        ctx.save_for_backward(q, k, v, o, lse, slopes, kpm, docs)
        ctx.args = (causal, window, block_m, block_n)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, slopes, kpm, docs = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, slopes, kpm, *ctx.args, docs)
        return dq, dk, dv, None, None, None, None, None, None, None


# --------------------------------------------------------------------------- entry points


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    bias: DistanceBias | None = None,
    key_padding_mask: Tensor | None = None,
    window: int | None = None,
    blocks: tuple[int, int] | None = None,
    document_ids: Tensor | None = None,
) -> Tensor:
    """Attention through the fused Triton kernels (the AttentionKernel contract).

    q (B, Hq, Tq, D); k, v (B, Hkv, Tk, D) with Hq a multiple of Hkv and Tk ≥ Tq; query i at
    key position Tk − Tq + i; ``key_padding_mask`` (B, Tk) True where a key may be attended;
    ``bias`` an ALiBi-style :class:`DistanceBias`. ``window`` W (causal only): each query
    attends its last W keys, and the kernels visit only the key blocks that meet a window,
    so time is O(L·W) (:mod:`llmkit.kernels.sliding_window`). ``document_ids`` (B, Tk),
    non-decreasing per row: a query sees only keys of its own document (packed rows, varlen),
    and the programs skip the blocks wholly in other documents. Inputs must satisfy
    :func:`kernel_supports` and sit where :func:`llmkit.kernels.runtime.use_triton` allows.
    ``blocks`` = (BLOCK_M, BLOCK_N) overrides the tile sizes of all kernels (tests).
    """
    check_shapes(q, k, v)
    if window is not None:
        if window < 1:
            raise ValueError(f"window must be ≥ 1, got {window}")
        if not causal:
            raise ValueError("a window needs causal attention; got causal=False")
        window = min(int(window), k.shape[2])  # no query has more than Tk keys behind it
    if not kernel_supports(q, k, v):
        raise ValueError(
            f"flash_attention takes {[str(t) for t in SUPPORTED_DTYPES]} q/k/v of one dtype "
            f"on one device with head dim ≤ {MAX_HEAD_DIM} and batch, heads ≤ {_MAX_GRID_YZ}; "
            f"got {q.dtype}/{k.dtype}/{v.dtype}, shape {tuple(q.shape)}"
        )
    if q.shape[2] == 0:
        return q.new_zeros(q.shape)
    slopes = None
    if bias is not None:
        slopes = bias.slopes.detach().to(device=q.device, dtype=torch.float32).contiguous()
        if slopes.shape != (q.shape[1],):
            raise ValueError(f"bias has {tuple(slopes.shape)} slopes for {q.shape[1]} heads")
    kpm = _padding_bytes(key_padding_mask, q.shape[0], k.shape[2], q.device)
    docs = _document_spans(document_ids, q.shape[0], k.shape[2], q.device)
    args = (q, k, v, slopes, kpm, bool(causal), window or 0, *(blocks or (0, 0)), docs)
    if torch.compiler.is_compiling():  # an opaque node of known shapes for the tracer
        return flash_attention_fwd(*args)[0]
    return _EagerFlashAttention.apply(*args)


def flash_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    bias: DistanceBias | None = None,
    key_padding_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> Tensor:
    """The plain-PyTorch path the ``flash`` component takes without Triton: the same contract
    through :func:`~llmkit.ops.sdpa_attention` (memory-efficient on
    CPU, no L×L tensor for plain causal calls; documents as a block-diagonal mask)."""
    return sdpa_attention(
        q,
        k,
        v,
        causal=causal,
        bias=bias,
        key_padding_mask=key_padding_mask,
        document_ids=document_ids,
    )
