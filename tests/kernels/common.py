"""What the kernel tests share: the accuracy criterion, and whether this process's Triton
can run the interpreter.

Accuracy, as in flash-attention's own tests:

The reference is the textbook formula in float64; a plain-PyTorch computation in the input
dtype ("pt") sets the error budget. For each compared tensor::

    max|kernel − ref| ≤ 2 · max|pt − ref| + floor[dtype]

Each test module states its floors in its docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BF16_REASON = "the Triton interpreter's bf16 arithmetic is wrong (triton 3.9)"
#: bf16 as a parameter that runs only with CUDA.
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason=BF16_REASON))


def assert_within_budget(
    names: Sequence[str],
    got: Sequence[Tensor],
    pt: Sequence[Tensor],
    ref: Sequence[Tensor],
    floor: float,
) -> None:
    """Each kernel tensor is finite, of pt's dtype and ref's shape, and within budget."""
    for name, a, p, r in zip(names, got, pt, ref, strict=True):
        assert a.dtype == p.dtype and a.shape == r.shape, name
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        err = (a.double() - r).abs().max().item()
        budget = 2 * (p.double() - r).abs().max().item() + floor
        assert err <= budget, f"{name}: kernel error {err:.2e} > budget {budget:.2e}"


def interpreter_ready() -> bool:
    """True when this process's Triton language library (``tl.sum`` …) was built for the
    interpreter, which happens when ``triton`` is first imported under
    ``TRITON_INTERPRET=1`` (tests/conftest.py does so on machines without CUDA)."""
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - triton absent on this platform
        return False
    return isinstance(tl.sum, InterpretedFunction)
