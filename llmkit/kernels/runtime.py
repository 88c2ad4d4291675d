"""Where a Triton kernel can run, and the one-time notice when it cannot.

Rules (the same for every kernel):

- a CUDA tensor with Triton importable → the compiled Triton kernel;
- ``TRITON_INTERPRET=1`` set before import → the Triton kernel in the interpreter, on CPU
  tensors too (slow; used by the tests on small shapes);
- otherwise → the component's plain-PyTorch reference path, announced once per component
  through the ``llmkit.kernels`` logger.

Nothing here touches the GPU driver at import time (without a GPU that raises).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("llmkit.kernels")

_announced: set[str] = set()


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks for the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_triton_importable: bool | None = None


def triton_available() -> bool:
    """True when ``triton`` imports (it may still have no GPU to run on). Remembered in a
    module global rather than ``functools.cache``, which torch.compile warns about when it
    traces a component's dispatch."""
    global _triton_importable
    if _triton_importable is None:
        try:
            import triton  # noqa: F401
        except Exception:  # pragma: no cover - triton absent on this platform
            _triton_importable = False
        else:
            _triton_importable = True
    return _triton_importable


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when a Triton kernel should run on ``tensors``."""
    if not triton_available():
        return False
    if interpreting():
        return True
    return all(t.is_cuda for t in tensors)


def backend(device: torch.device | str | None = None) -> str:
    """``"triton"``, ``"triton-interpreter"`` or ``"reference"`` for tensors on ``device``.

    With ``device`` None, the default for this machine: CUDA when a GPU is visible.
    """
    if not triton_available():
        return "reference"
    if interpreting():
        return "triton-interpreter"
    if device is None:
        return "triton" if torch.cuda.is_available() else "reference"
    return "triton" if torch.device(device).type == "cuda" else "reference"


def describe_backend(name: str) -> str:
    """One line for ``llmkit show``: which path component ``name`` takes on this machine."""
    mode = backend()
    if mode == "triton":
        return f"{name}: Triton kernel on CUDA (CPU tensors use the PyTorch reference path)"
    if mode == "triton-interpreter":
        return f"{name}: Triton kernel under TRITON_INTERPRET=1 (interpreter, slow)"
    why = "Triton is not installed" if not triton_available() else "no CUDA GPU"
    return (
        f"{name}: PyTorch reference path ({why}; set TRITON_INTERPRET=1 to run the "
        "Triton kernel in the interpreter)"
    )


def announce_reference(name: str) -> None:
    """Log once per component that it runs its reference path instead of Triton."""
    if name in _announced:
        return
    _announced.add(name)
    log.info(
        "%s: running the PyTorch reference path (no CUDA tensor; set TRITON_INTERPRET=1 "
        "to run the Triton kernel in the interpreter)",
        name,
    )


@functools.cache
def _jit(fn: Callable, interpret: bool) -> Any:
    import triton

    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        return triton.jit(fn)


def kernel(fn: Callable) -> Any:
    """The Triton kernel ``fn`` (a plain function) jitted in the mode
    :func:`interpreting` asks for now, built on first launch and once per mode.

    Triton fixes interpreted-vs-compiled when a function is jitted; jitting lazily lets the
    tests switch ``TRITON_INTERPRET`` per test while the rest of a session stays compiled (or
    on the reference paths). Kernels must be self-contained (no jitted helpers), since a
    helper would be jitted in whatever mode was active at import.
    """
    return _jit(fn, interpreting())


def dtype_runs(t: torch.Tensor) -> bool:
    """False for bf16 in the interpreter, whose bf16 arithmetic is wrong (triton 3.9)."""
    return not (t.dtype == torch.bfloat16 and not t.is_cuda and interpreting())
