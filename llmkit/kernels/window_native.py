"""Causal sliding-window attention by a compiled CPU kernel (fp32, forward and backward).

The C source beside this module (``window_native.c``) fuses each tile of 14 queries (6 on
AVX2): scores against the tile's one span of keys, an exact softmax over the whole row,
and the product with the values, all in registers and L1/L2; the backward recomputes P
from the saved row log-sum-exp and accumulates dK, dV straight into their rows. The tiles
cut a row's window in one place only, so the work spent outside the windows is (14−1)/W of
the useful work, where the chunked PyTorch path (:mod:`llmkit.kernels.block_local`) spends
C/W = 1/8 at W = 256 and runs each of its seven products as a separate batched matmul.

**Build.** On first use :data:`KERNEL` (a :class:`llmkit.kernels.native_build.NativeLibrary`)
compiles the source with ``-O3 -march=native`` into the cache, keyed by the source, the
compiler, its flags and the CPU's flags. It is built with OpenMP where the compiler has it:
one call then splits the (batch, kv head) pairs over torch's own intra-op threads (the
library binds to the OpenMP runtime torch loaded), so no thread of torch's spins on a core
the kernel needs. Without OpenMP the pairs run on :mod:`llmkit.kernels.worker_threads` (a
call releases the GIL). Where no compiler is found or the build fails, :func:`library`
returns None (:func:`unavailable_reason` says why) and the PyTorch path runs;
``LLMKIT_NATIVE_KERNELS=0`` turns the kernel off.

**What it takes**: CPU tensors, fp32 (fp16 and bf16 are computed in fp32 and cast back, as
the PyTorch path does), head dims a multiple of the vector step (32 floats with AVX-512, 16
without), optional ALiBi slopes; not key padding masks or dropout (those take the PyTorch
path). Speed, against the PyTorch path and SDPA: docs/benchmarks.md.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from llmkit.kernels import worker_threads
from llmkit.kernels.native_build import FLAGS, OPENMP, NativeLibrary
from llmkit.kernels.worker_threads import run_parts, workers_for

SOURCE = Path(__file__).with_name("window_native.c")

_PTR = ctypes.c_void_p
_INT = ctypes.c_int
_TAIL = [_INT] * 8 + [ctypes.c_float, _PTR, ctypes.c_long, _INT]

#: The compiled kernel: tried with OpenMP (:data:`OPENMP`), then without.
KERNEL = NativeLibrary(
    "window_native",
    SOURCE,
    {
        "llmkit_window_lanes": (_INT, None),
        "llmkit_window_work": (ctypes.c_long, [_INT, _INT, _INT, _INT]),
        "llmkit_window_openmp": (_INT, None),
        "llmkit_window_forward": (None, [_PTR] * 6 + _TAIL),
        "llmkit_window_backward": (None, [_PTR] * 10 + _TAIL),
    },
    builds=(FLAGS + OPENMP, FLAGS),
)


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it is off or cannot be built."""
    return KERNEL.load()


def unavailable_reason() -> str | None:
    """Why :func:`library` returns None (after a call), else None."""
    return KERNEL.unavailable_reason()


def forget() -> None:
    """Forget the loaded library (or the reason there is none): the next call builds or loads
    again."""
    KERNEL.forget()


def describe() -> str:
    """One line: whether the kernel runs here, building it if needed (``llmkit show``)."""
    lib = library()
    if lib is not None:
        lanes = lib.llmkit_window_lanes()
        threads = "OpenMP" if lib.llmkit_window_openmp() else "Python worker"
        return (
            f"the compiled C kernel (llmkit.kernels.window_native; head dims a multiple of "
            f"{lanes}; {threads} threads)"
        )
    return f"the PyTorch path (compiled kernel unavailable: {unavailable_reason()})"


def supports(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, dropout_p: float
) -> bool:
    """True when the compiled kernel takes this call (and is available)."""
    if dropout_p != 0.0 or key_padding_mask is not None:
        return False
    if not q.device.type == k.device.type == v.device.type == "cpu":
        return False
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ):
        return False
    lanes = _lanes()
    return lanes > 0 and q.shape[-1] % lanes == 0


def _lanes() -> int:
    """The kernel's vector width in floats, 0 without a kernel: a constant to torch.compile,
    which cannot trace the library's lock and ctypes call."""
    lib = library()
    return 0 if lib is None else int(lib.llmkit_window_lanes())


# What ``torch.compiler.assume_constant_result`` does, without its import of torch._dynamo
# (0.9 s, and a meta build must not pay it: tests/model/test_meta.py).
_lanes._dynamo_marked_constant = True  # type: ignore[attr-defined]


def window_attention_native(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    groups: int,
    slopes: Tensor | None = None,
    *,
    lib: ctypes.CDLL | None = None,
) -> Tensor:
    """Sliding-window attention by the compiled kernel (differentiable in q, k, v): the
    contract of :func:`llmkit.components.attention.sliding_window.sliding_window_attention`
    without key padding and dropout, shapes already checked (``groups`` = Hq // Hkv).
    ``lib``: a library from ``KERNEL.load_file`` (default :func:`library`; check
    :func:`supports` first)."""
    if window < 1:
        raise ValueError(f"window must be ≥ 1, got {window}")
    compiling = torch.compiler.is_compiling()
    if not compiling:  # (the operator finds the library itself, outside the trace)
        lib = lib if lib is not None else _lib()
    dtype = q.dtype
    if dtype != torch.float32:  # computed in fp32; autograd casts the gradients back
        q, k, v = q.float(), k.float(), v.float()
    if slopes is not None:
        if slopes.shape != (q.shape[1],):
            raise ValueError(
                f"slopes {tuple(slopes.shape)} must be ({q.shape[1]},), one per query head"
            )
        slopes = slopes.detach().to("cpu", torch.float32).contiguous()
    window = min(window, k.shape[2])
    if compiling:
        out = window_native_fwd(q, k, v, slopes, window, groups)[0]
    else:
        out = _WindowNative.apply(q, k, v, slopes, window, groups, lib)
    return out.to(dtype)


def _threads(lib: ctypes.CDLL, q: Tensor, k: Tensor, window: int) -> int:
    """Threads for a call's (batch, kv head) pairs. OpenMP: torch's intra-op thread count, at
    most one a pair, for calls of at least ``PARALLEL_SCORES`` scores, else 1. Without
    OpenMP, the worker threads' rule (:func:`llmkit.kernels.worker_threads.workers_for`)."""
    pairs = k.shape[0] * k.shape[1]
    scores = q.shape[0] * q.shape[1] * q.shape[2] * min(window, k.shape[2])
    if not lib.llmkit_window_openmp():
        return workers_for(q.device, scores, pairs)
    return min(torch.get_num_threads(), pairs) if scores >= worker_threads.PARALLEL_SCORES else 1


def _each_pair(lib: ctypes.CDLL, call: Any, pairs: int, threads: int, floats: int) -> None:
    """Runs ``call(p0, p1, work, floats, threads)`` over pairs 0 … ``pairs``−1: one call on
    ``threads`` OpenMP threads, or (a build without OpenMP) one call a pair on worker threads,
    each with its own work buffer of ``floats``."""
    if threads < 2 or lib.llmkit_window_openmp():
        work = torch.empty(threads * floats, dtype=torch.float32, device="cpu")
        call(0, pairs, work.data_ptr(), floats, threads)
        return

    def part(p0: int, p1: int, state: dict[str, Tensor]) -> None:
        buf = state.get("work")
        if buf is None:
            buf = state["work"] = torch.empty(floats, dtype=torch.float32, device="cpu")
        call(p0, p1, buf.data_ptr(), floats, 1)

    run_parts([(i, i + 1) for i in range(pairs)], threads, part)


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    slopes: Tensor | None,
    window: int,
    groups: int,
    lib: ctypes.CDLL,
) -> tuple[Tensor, Tensor]:
    """The forward kernel on fp32 CPU tensors: the output and the row log-sum-exp."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    bsz, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(bsz, hq, tq, dtype=torch.float32, device="cpu")
    floats = lib.llmkit_window_work(min(tk, tq + window - 1), d, window, 0)
    scale = d**-0.5

    def call(p0: int, p1: int, work: int, floats: int, threads: int) -> None:
        lib.llmkit_window_forward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(),
            None if slopes is None else slopes.data_ptr(), out.data_ptr(), lse.data_ptr(),
            p0, p1, hkv, groups, tq, tk, d, window, scale, work, floats, threads,
        )  # fmt: skip

    _each_pair(lib, call, bsz * hkv, _threads(lib, q, k, window), floats)
    return out, lse


def _backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    slopes: Tensor | None,
    window: int,
    groups: int,
    lib: ctypes.CDLL,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward kernel: (dq, dk, dv), fp32, contiguous."""
    q, k, v, out = q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous()
    grad = grad.contiguous().float()
    tq, d = q.shape[2], q.shape[3]
    hkv, tk = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    floats = lib.llmkit_window_work(min(tk, tq + window - 1), d, window, 1)
    scale = d**-0.5

    def call(p0: int, p1: int, work: int, floats: int, threads: int) -> None:
        lib.llmkit_window_backward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(),
            None if slopes is None else slopes.data_ptr(), out.data_ptr(), grad.data_ptr(),
            lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
            p0, p1, hkv, groups, tq, tk, d, window, scale, work, floats, threads,
        )  # fmt: skip

    _each_pair(lib, call, q.shape[0] * hkv, _threads(lib, q, k, window), floats)
    return dq, dk, dv


# Under torch.compile the kernel runs as the custom operators ``llmkit::window_native_fwd`` /
# ``_bwd`` (fake implementations, the backward as the forward's autograd formula): traced
# code must not see the raw ``data_ptr()`` calls, which Dynamo would hand fake addresses.


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"the compiled window kernel is unavailable: {unavailable_reason()}")
    return lib


@torch.library.custom_op("llmkit::window_native_fwd", mutates_args=())
def window_native_fwd(
    q: Tensor, k: Tensor, v: Tensor, slopes: Tensor | None, window: int, groups: int
) -> tuple[Tensor, Tensor]:
    """The forward kernel as a custom operator (fp32 CPU tensors)."""
    return _forward(q, k, v, slopes, window, groups, _lib())


@window_native_fwd.register_fake
def _window_native_fwd_fake(q, k, v, slopes, window, groups):
    b, hq, tq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, tq), dtype=torch.float32)


@torch.library.custom_op("llmkit::window_native_bwd", mutates_args=())
def window_native_bwd(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    slopes: Tensor | None,
    window: int,
    groups: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward kernel as a custom operator."""
    return _backward(grad, q, k, v, out, lse, slopes, window, groups, _lib())


@window_native_bwd.register_fake
def _window_native_bwd_fake(grad, q, k, v, out, lse, slopes, window, groups):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, slopes, window, groups = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.slopes, ctx.window, ctx.groups = slopes, window, groups


def _autograd_backward(ctx: Any, grad: Tensor, _dlse: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = window_native_bwd(grad, q, k, v, out, lse, ctx.slopes, ctx.window, ctx.groups)
    return dq, dk, dv, None, None, None


window_native_fwd.register_autograd(_autograd_backward, setup_context=_setup_context)


class _WindowNative(torch.autograd.Function):
    """Eager calls (a custom operator dispatches slower), with the library given."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        slopes: Tensor | None,
        window: int,
        groups: int,
        lib: ctypes.CDLL,
    ) -> Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # saved as the kernel reads
        out, lse = _forward(q, k, v, slopes, window, groups, lib)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.slopes, ctx.window, ctx.groups, ctx.lib = slopes, window, groups, lib
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(grad, q, k, v, out, lse, ctx.slopes, ctx.window, ctx.groups, ctx.lib)
        return dq, dk, dv, None, None, None, None
