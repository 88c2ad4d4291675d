"""Attention with dropout on the attention probabilities, on the CPU, as one autograd function.

``softmax(q kᵀ/√d + bias) ∘ keep / (1 − p) · v`` (dropout as in Vaswani et al. 2017 and
nanoGPT), for what the ``sdpa`` component runs in training with ``dropout > 0`` on a CPU.
There, ``F.scaled_dot_product_attention`` with dropout leaves its fused kernel for the math
path, whose ``bernoulli_`` mask costs 8× the q·kᵀ product itself (80 ms against 9.5 ms for
B 16, H 6, L 256 on a 2-core EPYC): most of what attention dropout costs a baby-GPT step.

Here the keep mask comes from 16 random bits an element (:func:`llmkit.dropout.keep_masks`,
a few ms for the same shape), so the dropout rate is ``p`` rounded to a multiple of 2⁻¹⁶
(0.2 → 0.199997; the kept values are scaled by 1 / (1 − rate)). A causal call runs in up to
four blocks of query rows, each against the keys up to its last query (:func:`row_blocks`),
skipping most of the masked upper triangle. With the mask m holding 0 or 1/(1−p), the
forward keeps the probabilities P (fp32 or fp64) and P∘m (in the products' dtype): 8 bytes
a score in fp32, 6 with bf16 inputs, where SDPA's math path keeps P and a mask of P's dtype.
The backward is the analytic one: dV = (P∘m)ᵀ·dO, dS = (P∘m)∘dP − P∘δ with dP = dO·vᵀ and
δ = rowsum(dO ∘ O), dQ = dS·k/√d, dK = dSᵀ·q/√d (and the bias gets dS, summed over its
broadcast dimensions, when it needs a gradient).

bf16 tensors (autocast on a CPU with AVX512-BF16 or AMX, where ``precision = "auto"`` picks
bf16) run the five products in bf16, about 5× the fp32 speed there, and the rest in fp32: the
scores are widened before the bias and the softmax, P and dS are rounded to bf16 only as
inputs of a product, and dQ, dK, dV accumulate in fp32 — the precision of a bf16
``q @ kᵀ`` under autocast, where SDPA's math path would widen everything to fp32. fp16
tensors are computed in fp32 and the output cast back, as SDPA's math path does on a CPU.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from llmkit.contracts import DistanceBias
from llmkit.dropout import keep_masks
from llmkit.ops import check_shapes, expand_kv, sdpa_mask

#: Causal calls are cut into up to MAX_BLOCKS row blocks of at least BLOCK_ROWS rows
#: (:func:`row_blocks`).
BLOCK_ROWS = 64
MAX_BLOCKS = 4


def applies(q: Tensor, dropout_p: float) -> bool:
    """Whether :func:`dropout_attention` is the path for these queries: dropout on, a CPU
    tensor."""
    return dropout_p > 0.0 and q.device.type == "cpu"


def row_blocks(tq: int, tk: int, causal: bool) -> list[tuple[int, int, int]]:
    """(first row, end row, keys) of each block of query rows. Causal: up to
    :data:`MAX_BLOCKS` blocks of at least :data:`BLOCK_ROWS` rows, each against the keys up
    to its last query (``tk − tq + end``), which skips most of the masked upper triangle (a
    quarter of the scores with two blocks, 3/8 with four). Otherwise one block."""
    if not causal:
        return [(0, tq, tk)]
    n = max(1, min(MAX_BLOCKS, tq // BLOCK_ROWS))
    bounds = [round(i * tq / n) for i in range(n + 1)]
    return [(r0, r1, tk - tq + r1) for r0, r1 in itertools.pairwise(bounds)]


class DropoutAttention(torch.autograd.Function):
    """(B, H, Tq, D) attention with dropout; ``bias`` additive, broadcastable to
    (B, H, Tq, Tk), −inf wherever a query may not look (beyond its own position if
    ``causal``). A bias in q's dtype is added by the score product itself; a wider one (a
    distance bias with bf16 queries) after it, in its own dtype."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, p: float, causal: bool
    ) -> Tensor:
        with torch.autocast("cpu", enabled=False):
            return DropoutAttention._forward(ctx, q, k, v, bias, p, causal)

    @staticmethod
    def _forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, p: float, causal: bool
    ) -> Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        b, h, tq = q.shape[:3]
        low, wide = q.dtype, _wide(q.dtype)
        # (B·H, T, D) views. fp32 bmm reads the sliced and transposed views below in place;
        # bf16 bmm (oneDNN) copies each slice to a contiguous operand first.
        q3, k3, v3 = (x.reshape(b * h, x.shape[2], x.shape[3]) for x in (q, k, v))
        blocks = row_blocks(tq, k.shape[2], causal)
        # Each mask holds 0 or 1/(1−p), so no other factor appears in either direction.
        keeps = keep_masks([(b * h, r1 - r0, keys) for r0, r1, keys in blocks], p, wide, q.device)
        out = q3.new_empty(b * h, tq, v.shape[-1])
        probs, kept = [], []  # P (wide) and P∘mask (low): all the backward needs of them
        for (r0, r1, keys), keep in zip(blocks, keeps, strict=True):
            bias3 = _per_head(bias[..., r0:r1, :keys], b, h)
            qk = (q3[:, r0:r1], k3[:, :keys].transpose(1, 2))
            if bias.dtype == low:
                s = torch.baddbmm(bias3, *qk, alpha=scale)
            else:  # the product in `low`, the bias and everything after in its dtype
                s = torch.add(bias3, torch.bmm(*qk), alpha=scale)
            prob = torch.softmax(s, -1, dtype=wide)
            pk = torch.mul(prob, keep, out=torch.empty_like(prob, dtype=low))
            out[:, r0:r1] = torch.bmm(pk, v3[:, :keys])
            probs.append(prob)
            kept.append(pk)
        ctx.save_for_backward(q3, k3, v3, out, *probs, *kept)
        ctx.scale, ctx.blocks = scale, blocks
        ctx.bias_shape = bias.shape if bias.requires_grad else None
        return out.view(b, h, tq, v.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        with torch.autocast("cpu", enabled=False):
            return DropoutAttention._backward(ctx, grad)

    @staticmethod
    def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q3, k3, v3, out, *saved = ctx.saved_tensors
        blocks = ctx.blocks
        probs, kept = saved[: len(blocks)], saved[len(blocks) :]
        low, wide = q3.dtype, _wide(q3.dtype)
        b, h, tq, d = grad.shape
        g3 = grad.reshape(b * h, tq, d)
        # dS = P ∘ (dP∘mask − δ) = (P∘mask) ∘ dP − P ∘ δ, dP = dO·vᵀ, δ = rowsum(dO ∘ O).
        delta = torch.linalg.vecdot(g3.to(wide), out.to(wide))[..., None]
        dq = torch.empty_like(q3)
        dk, dv = torch.zeros_like(k3, dtype=wide), torch.zeros_like(v3, dtype=wide)
        dbias = None if ctx.bias_shape is None else q3.new_zeros(ctx.bias_shape, dtype=wide)
        for (r0, r1, keys), prob, pk in zip(blocks, probs, kept, strict=True):
            g = g3[:, r0:r1]
            dv[:, :keys] += torch.bmm(pk.transpose(1, 2), g)
            ds = torch.bmm(g, v3[:, :keys].transpose(1, 2)).to(wide).mul_(pk)
            ds.addcmul_(prob, delta[:, r0:r1], value=-1.0)
            ds_low = torch.mul(ds, ctx.scale, out=torch.empty_like(ds, dtype=low))
            dq[:, r0:r1] = torch.bmm(ds_low, k3[:, :keys])
            dk[:, :keys] += torch.bmm(ds_low.transpose(1, 2), q3[:, r0:r1])
            if dbias is not None:
                shape = (*ctx.bias_shape[:2], r1 - r0, keys)
                dbias[..., r0:r1, :keys] += ds.view(b, h, r1 - r0, keys).sum_to_size(shape)
        return (
            dq.view(b, h, tq, d),
            dk.to(low).view(b, h, k3.shape[1], d),
            dv.to(low).view(b, h, v3.shape[1], v3.shape[2]),
            dbias,
            None,
            None,
        )


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the softmax, the masks and the accumulations for products in ``dtype``."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


def _per_head(bias: Tensor, b: int, h: int) -> Tensor:
    """A (B or 1, H or 1, R, K) bias as a (B·H or 1, R, K) one for bmm's batch of heads."""
    if bias.shape[0] == bias.shape[1] == 1:
        return bias[0]
    return bias.expand(b, h, *bias.shape[2:]).reshape(b * h, *bias.shape[2:])


def dropout_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    dropout_p: float,
    causal: bool = True,
    bias: DistanceBias | None = None,
    key_padding_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> Tensor:
    """Kernel-contract attention (as :func:`llmkit.ops.sdpa_attention`: bottom-right causal
    alignment, GQA, a distance bias, key padding, documents) with dropout ``dropout_p`` on the
    probabilities; see the module docstring."""
    groups = check_shapes(q, k, v)
    dtype = q.dtype
    if dtype not in (torch.float32, torch.float64, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    tq, tk = q.shape[2], k.shape[2]
    # A distance bias in the softmax's dtype; a 0/−inf mask, exact in bf16, in q's own.
    wide = _wide(q.dtype)
    like_q = q.new_empty(1, 1, tq, 0, dtype=wide)  # what sdpa_mask reads: length, device, dtype
    mask, empty = sdpa_mask(
        like_q,
        tk,
        causal=causal,
        bias=bias,
        key_padding_mask=key_padding_mask,
        document_ids=document_ids,
    )
    # Additive, (B or 1, H or 1, Tq, Tk): the bias, or 0 / −inf from a boolean mask.
    if mask is None:
        additive = q.new_zeros(1, 1, tq, tk)
    elif mask.dtype == torch.bool:
        additive = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    else:
        additive = mask
    k, v = expand_kv(k, groups), expand_kv(v, groups)
    out = DropoutAttention.apply(q, k, v, additive, dropout_p, causal)
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    return out.to(dtype)
