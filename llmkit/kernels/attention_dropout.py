"""Attention with dropout on the attention probabilities, on the CPU, as one autograd function.

``softmax(q kᵀ/√d + bias) ∘ keep / (1 − p) · v`` (dropout as in Vaswani et al. 2017 and
nanoGPT), for what the ``sdpa`` component runs in training with ``dropout > 0`` on a CPU.
There, ``F.scaled_dot_product_attention`` with dropout leaves its fused kernel for the math
path, whose ``bernoulli_`` mask costs 8× the q·kᵀ product itself (80 ms against 9.5 ms for
B 16, H 6, L 256 on a 2-core EPYC): most of what attention dropout costs a baby-GPT step.

Here the keep mask comes from 16 random bits an element (:func:`keep_mask`: ``random_`` on
int64 words, each cut into four int16 lanes, 15 ms for the same shape), so the dropout rate
is ``p`` rounded to a multiple of 1/65536 (0.2 → 0.199997). A causal call runs in up to
four blocks of query rows, each against the keys up to its last query (:func:`row_blocks`),
skipping most of the masked upper triangle. The forward keeps the probabilities (in the
compute dtype) and the mask (bool), as the math path does; the backward is the
analytic one: dV = (P∘keep)ᵀ·dO/(1−p), dS = P ∘ (dP̃∘keep/(1−p) − δ) with dP̃ = dO·vᵀ and
δ = rowsum(dO ∘ O), dQ = dS·k/√d, dK = dSᵀ·q/√d (and the bias gets dS, summed over its
broadcast dimensions, when it needs a gradient).

bf16 and fp16 tensors are computed in fp32 (autocast off inside) and the output cast back,
as SDPA's math path does with them on a CPU.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from llmkit.contracts import DistanceBias
from llmkit.ops import check_shapes, expand_kv, sdpa_mask

#: Random bits drawn for each element's keep/drop decision.
BITS = 16
#: Causal calls are cut into up to MAX_BLOCKS row blocks of at least BLOCK_ROWS rows
#: (:func:`row_blocks`).
BLOCK_ROWS = 64
MAX_BLOCKS = 4


def applies(q: Tensor, dropout_p: float) -> bool:
    """Whether :func:`dropout_attention` is the path for these queries: dropout on, a CPU
    tensor."""
    return dropout_p > 0.0 and q.device.type == "cpu"


def keep_mask(shape: tuple[int, ...], p: float, device: torch.device | str = "cpu") -> Tensor:
    """A bool tensor of ``shape``, each element True with probability 1 − p (p rounded to a
    multiple of 2⁻¹⁶), from torch's default generator for ``device``."""
    n = math.prod(shape)
    words = -(-n // 4)
    bits = torch.empty(words, dtype=torch.int64, device=device).random_(-(2**63), 2**63 - 1)
    lanes = bits.view(torch.int16)[:n].view(shape)
    return lanes >= -(2 ** (BITS - 1)) + round(p * 2**BITS)


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


def keep_masks(
    shapes: list[tuple[int, ...]], p: float, device: torch.device | str = "cpu"
) -> list[Tensor]:
    """:func:`keep_mask` for several shapes, from one draw (views of it, in order)."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = keep_mask((sum(sizes),), p, device)
    return [m.view(shape) for m, shape in zip(flat.split(sizes), shapes, strict=True)]


class DropoutAttention(torch.autograd.Function):
    """(B, H, Tq, D) attention with dropout; ``bias`` additive, broadcastable to
    (B, H, Tq, Tk), −inf wherever a query may not look (beyond its own position if
    ``causal``)."""

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
        b, h, tq, _ = q.shape
        blocks = row_blocks(tq, k.shape[2], causal)
        keeps = keep_masks([(b, h, r1 - r0, keys) for r0, r1, keys in blocks], p, q.device)
        out = q.new_empty(b, h, tq, v.shape[-1])
        probs = []
        for (r0, r1, keys), keep in zip(blocks, keeps, strict=True):
            s = q.new_empty(b, h, r1 - r0, keys)
            for i in range(b):  # the bias is broadcast over heads (and batch) by baddbmm
                bias_i = bias[i if bias.shape[0] > 1 else 0][..., r0:r1, :keys]
                qi, ki = q[i, :, r0:r1], k[i, :, :keys].transpose(1, 2)
                torch.baddbmm(bias_i, qi, ki, alpha=scale, out=s[i])
            prob = torch.softmax(s, -1, out=s)
            out[:, :, r0:r1] = torch.matmul(prob * keep, v[:, :, :keys])
            probs.append(prob)
        out.mul_(1.0 / (1.0 - p))
        ctx.save_for_backward(q, k, v, out, *probs, *keeps)
        ctx.p, ctx.scale, ctx.blocks = p, scale, blocks
        ctx.bias_shape = bias.shape if bias.requires_grad else None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        with torch.autocast("cpu", enabled=False):
            return DropoutAttention._backward(ctx, grad)

    @staticmethod
    def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, *saved = ctx.saved_tensors
        blocks = ctx.blocks
        probs, keeps = saved[: len(blocks)], saved[len(blocks) :]
        grad = grad.contiguous()
        # dS·(1−p) = P ∘ (dP̃∘keep − δ·(1−p)); the factor 1/(1−p) goes to the results.
        delta = torch.linalg.vecdot(grad, out)[..., None].mul_(1.0 - ctx.p)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dbias = None if ctx.bias_shape is None else q.new_zeros(ctx.bias_shape)
        for (r0, r1, keys), prob, keep in zip(blocks, probs, keeps, strict=True):
            g = grad[:, :, r0:r1]
            dv[:, :, :keys] += torch.matmul((prob * keep).transpose(-1, -2), g)
            ds = torch.matmul(g, v[:, :, :keys].transpose(-1, -2))
            ds.mul_(keep).sub_(delta[:, :, r0:r1]).mul_(prob)
            dq[:, :, r0:r1] = torch.matmul(ds, k[:, :, :keys])
            dk[:, :, :keys] += torch.matmul(ds.transpose(-1, -2), q[:, :, r0:r1])
            if dbias is not None:
                shape = (*ctx.bias_shape[:2], r1 - r0, keys)
                dbias[..., r0:r1, :keys] += ds.sum_to_size(shape)
        inv = 1.0 / (1.0 - ctx.p)
        dq.mul_(inv * ctx.scale)
        dk.mul_(inv * ctx.scale)
        dv.mul_(inv)
        if dbias is not None:
            dbias.mul_(inv)
        return dq, dk, dv, dbias, None, None


def dropout_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    dropout_p: float,
    causal: bool = True,
    bias: DistanceBias | None = None,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Kernel-contract attention (as :func:`llmkit.ops.sdpa_attention`: bottom-right causal
    alignment, GQA, a distance bias, key padding) with dropout ``dropout_p`` on the
    probabilities; see the module docstring."""
    groups = check_shapes(q, k, v)
    dtype = q.dtype
    if dtype not in (torch.float32, torch.float64):
        q, k, v = q.float(), k.float(), v.float()
    tq, tk = q.shape[2], k.shape[2]
    mask, empty = sdpa_mask(q, tk, causal=causal, bias=bias, key_padding_mask=key_padding_mask)
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
