"""Dropout with a keep mask from 16 random bits an element, for the CPU.

``torch.nn.functional.dropout`` on a CPU draws its mask with ``bernoulli_``, one generator
call per element: 12–14 ms for a (16, 256, 384) activation on a 2-core EPYC, ten times the
cost of the multiply itself. Here the mask comes from ``random_`` on int64 words, each cut
into four int16 lanes compared with a threshold straight into the activation's dtype (about
2.5 ms for the same shape), so the dropout rate is ``p`` rounded to a multiple of 2⁻¹⁶ (0.2 →
0.199997; :func:`drop_rate`) and the kept values are scaled by 1 / (1 − rate) (to the
activation's precision, as in torch's own dropout). The
mask is a float tensor holding 0 or the scale: on a CPU a multiply by a bool tensor runs 30×
slower than one by a tensor of the same dtype (4.8 against 0.15 ms for 1.5M fp32 elements).

:class:`Dropout` is a drop-in :class:`torch.nn.Dropout` that takes this path for CPU
tensors and torch's fused kernel elsewhere; the residual and embedding dropout of every model
and the attention-probability dropout of :mod:`llmkit.kernels.attention_dropout` use it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

#: Random bits drawn for each element's keep/drop decision.
BITS = 16


def _dropped_lanes(p: float) -> int:
    """How many of the 2¹⁶ values of a lane drop its element: p · 2¹⁶, rounded."""
    return round(p * 2**BITS)


def drop_rate(p: float) -> float:
    """The dropout rate :func:`keep_mask` realises for ``p``: ``p`` rounded to a multiple of
    2⁻¹⁶."""
    return _dropped_lanes(p) / 2**BITS


def keep_mask(
    shape: tuple[int, ...],
    p: float,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bool,
) -> Tensor:
    """A tensor of ``shape`` and ``dtype``, each element 1 (True) with probability
    1 − :func:`drop_rate` (p) and 0 otherwise, from torch's default generator for ``device``."""
    n = math.prod(shape)
    words = -(-n // 4)
    bits = torch.empty(words, dtype=torch.int64, device=device).random_(-(2**63), 2**63 - 1)
    lanes = bits.view(torch.int16)[:n].view(shape)
    threshold = -(2 ** (BITS - 1)) + _dropped_lanes(p)
    return torch.ge(lanes, threshold, out=torch.empty(shape, dtype=dtype, device=device))


def scaled_keep_mask(
    shape: tuple[int, ...], p: float, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Tensor:
    """:func:`keep_mask` in ``dtype`` holding 0 or 1 / (1 − :func:`drop_rate` (p)) (rounded
    to ``dtype``; all 0 when the rate rounds to 1): the factor an activation is multiplied by
    in dropout."""
    rate = drop_rate(p)
    return keep_mask(shape, p, device, dtype).mul_(0.0 if rate >= 1.0 else 1.0 / (1.0 - rate))


def keep_masks(
    shapes: list[tuple[int, ...]], p: float, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> list[Tensor]:
    """:func:`scaled_keep_mask` for several shapes, from one draw (views of it, in order)."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = scaled_keep_mask((sum(sizes),), p, dtype, device)
    return [m.view(shape) for m, shape in zip(flat.split(sizes), shapes, strict=True)]


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Dropout of ``x`` at rate ``p`` (0 ≤ p ≤ 1): the 16-bit mask on a CPU; torch's kernel
    elsewhere and while ``torch.compile`` traces (dynamo cannot trace ``random_``). The
    gradient is the incoming one times the same mask (autograd keeps only the mask)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    torch_kernel = x.device.type != "cpu" or not x.is_floating_point()
    if torch_kernel or torch.compiler.is_compiling():
        return nn.functional.dropout(x, p, training=True)
    return x * scaled_keep_mask(tuple(x.shape), p, x.dtype, x.device)


class Dropout(nn.Dropout):
    """:class:`torch.nn.Dropout` through :func:`dropout` (``inplace`` is not supported)."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__(p)

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)
