"""What the kernel tests share: where the kernels run, the accuracy criterion, test-case
helpers, and a spy on the kernels' public entry points.

Where the kernels run (the ``kernel_device`` fixture of tests/kernels/conftest.py): with a
CUDA GPU (and ``TRITON_INTERPRET`` not set when the session starts, :data:`GPU`), the
compiled kernels on CUDA tensors, bf16 and GPU-sized shapes included; without one, the
Triton interpreter on CPU tensors, on tiny shapes only (it is ~1000× slower than PyTorch) and
without bf16 (its bf16 arithmetic is wrong in triton 3.9).

Accuracy, as in flash-attention's own tests:

The reference is the textbook formula in float64; a plain-PyTorch computation in the input
dtype ("pt") sets the error budget. For each compared tensor::

    max|kernel − ref| ≤ 2 · max|pt − ref| + floor[dtype]

Each test module states its floors in its docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from llmkit.kernels import runtime

CUDA = torch.cuda.is_available()
#: The kernel tests run the compiled kernels on CUDA tensors: a CUDA GPU is present and the
#: session was not started under ``TRITON_INTERPRET=1`` (which selects the CPU interpreter).
GPU = CUDA and not runtime.interpreting()
BF16_REASON = "the Triton interpreter's bf16 arithmetic is wrong (triton 3.9); bf16 runs on CUDA"
GPU_SIZE_REASON = "GPU-sized shape (many GPU tiles): runs on CUDA, too slow for the interpreter"
#: bf16 as a parameter that runs only on the GPU.
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not GPU, reason=BF16_REASON))


def case(*values: Any, id: str, gpu_sized: bool = False) -> Any:
    """A ``pytest.param`` that skips without the GPU when it is GPU-sized
    (:data:`GPU_SIZE_REASON`) or holds ``torch.bfloat16`` among its values
    (:data:`BF16_REASON`)."""
    marks = []
    if gpu_sized:
        marks.append(pytest.mark.skipif(not GPU, reason=GPU_SIZE_REASON))
    elif any(v is torch.bfloat16 for v in values):
        marks.append(pytest.mark.skipif(not GPU, reason=BF16_REASON))
    return pytest.param(*values, id=id, marks=marks)


def dtype_id(dtype: torch.dtype) -> str:
    """``fp32``, ``fp16`` or ``bf16``."""
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[tuple[tuple, dict]]:
    """Replace the public function ``module.name`` for this test by a wrapper that records
    the ``(args, kwargs)`` of every call and then calls the real function. The components
    import their kernel module lazily and call its functions through the module attribute,
    so the spy sees every call a component makes."""
    calls: list[tuple[tuple, dict]] = []
    real = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


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
