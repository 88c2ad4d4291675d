"""Finding NaN and infinity in a tensor of any size without a full-size temporary: the
one scan that import, export and generation's weight check share."""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: Elements checked at once (each piece's boolean temporary is this large).
CHUNK = 1 << 22
#: The dtypes checked as they are; others (float8) as float32, a piece at a time.
COMPUTED = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def first_nonfinite(
    t: Tensor, chunk: int = CHUNK, limit: float | None = None
) -> tuple[tuple[int, ...], float] | None:
    """The index and value of ``t``'s first NaN or infinity (or, with ``limit``, value of
    larger magnitude), or None; None for a tensor that is not floating point. Reads slices
    of whole rows, about ``chunk`` elements (at least a row) at a time, of any strides: no
    contiguous copy of ``t``."""
    if not t.is_floating_point():
        return None
    t = t.detach()
    rows_of = t.reshape(1) if t.dim() == 0 else t
    per_row = max(math.prod(rows_of.shape[1:]), 1)
    rows = max(chunk // per_row, 1)
    for start in range(0, rows_of.shape[0], rows):
        part = rows_of[start : start + rows]
        x = part if part.dtype in COMPUTED else part.float()
        bad = ~torch.isfinite(x)
        if limit is not None:
            bad |= x.abs() > limit
        if not bool(bad.any()):
            continue
        where = bad.nonzero()[0].tolist()
        value = float(x[tuple(where)])
        where[0] += start
        return tuple(where)[: t.dim()], value
    return None
