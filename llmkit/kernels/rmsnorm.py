"""Fused RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization") in Triton.

``y = x · r · w`` with ``r = 1 / sqrt(mean(x²) + eps)`` over the last dimension, all math in
fp32, the output cast to the input dtype (as the plain ``rmsnorm`` component and LLaMA do).

- Forward: one program per row; it reads the row once, stores y and r (fp32, one per row).
- Backward: with x̂ = x·r and g = dy·w, ``dx = r · (g − x̂ · mean(g ∘ x̂))`` and
  ``dw = Σ_rows dy ∘ x̂``. A fixed number of programs each walk a strided set of rows,
  accumulating their share of dw in fp32 registers; the partial sums (programs × C) are added
  in PyTorch. No atomics, so gradients are bit-identical between runs.

The PyTorch reference is :class:`llmkit.components.norm.rmsnorm.RMSNorm`.

Kernels are plain functions jitted on first launch, once per mode (interpreted when
``TRITON_INTERPRET=1`` at call time, compiled otherwise): ``triton.jit`` freezes that choice
when it runs, and jitting lazily keeps this module independent of import order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from llmkit.kernels import runtime

#: Input dtypes the kernel accepts.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Largest feature size held in one tile (a row lives in registers); wider rows use PyTorch.
MAX_FEATURES = 16384


def _fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, N_COLS, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N_COLS
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N_COLS + tl.cast(eps, tl.float32))
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + row, rstd)


def _bwd_kernel(
    X,
    W,
    DY,
    RSTD,
    DX,
    DW_PARTIAL,
    stride_x,
    stride_dy,
    stride_dx,
    N_ROWS,
    N_COLS,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N_COLS
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    for r64 in range(pid.to(tl.int64), N_ROWS, n_progs):
        x = tl.load(X + r64 * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64 * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r64)
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, 0) / N_COLS))
        tl.store(DX + r64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=ok)
        dw += dy * xhat
    tl.store(DW_PARTIAL + pid.to(tl.int64) * N_COLS + cols, dw, mask=ok)


#: Launch knobs (benchmarks/scripts/flash_tune.py times alternatives on a GPU): warps per
#: program are the row's width / WIDTH_PER_WARP, within [1, MAX_WARPS]; the backward runs
#: BWD_PROGRAMS_PER_SM programs per multiprocessor.
WIDTH_PER_WARP = 256
MAX_WARPS = 16
BWD_PROGRAMS_PER_SM = 4
_sm_counts: dict[int, int] = {}


def _warps(block: int) -> int:
    return max(1, min(MAX_WARPS, block // WIDTH_PER_WARP))


def _bwd_programs(rows: int, device: torch.device) -> int:
    """Programs of the backward: a few per SM on a GPU, 4 in the interpreter."""
    if device.type != "cuda":
        return max(1, min(rows, 4))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(rows, BWD_PROGRAMS_PER_SM * _sm_counts[index]))


# Under torch.compile the kernels run inside the custom operators ``llmkit::rms_norm_fwd`` /
# ``llmkit::rms_norm_bwd`` (fake implementations, the backward registered as the forward's
# autograd formula), so a compiled model traces through a call as one node
# (``fullgraph=True``); eager calls take an autograd.Function over the same launchers, which
# dispatches faster.


def _rows(t: Tensor, cols: int) -> Tensor:
    t2 = t.reshape(-1, cols)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The forward kernel: ``y`` (x's shape and dtype, contiguous) and the fp32 ``1/rms`` of
    each of the rows (x.numel() / C,)."""
    cols = x.shape[-1]
    x2 = _rows(x, cols)
    rows = x2.shape[0]
    y = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(cols)
    if rows:
        runtime.kernel(_fwd_kernel)[(rows,)](
            x2,
            weight,
            y,
            rstd,
            x2.stride(0),
            y.stride(0),
            cols,
            eps,
            BLOCK=block,
            num_warps=_warps(block),
        )
    return y.view(x.shape), rstd


rms_norm_fwd = torch.library.custom_op("llmkit::rms_norm_fwd", _forward, mutates_args=())


@rms_norm_fwd.register_fake
def _rms_norm_fwd_fake(x, weight, eps):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.new_empty(x.shape), x.new_empty((rows,), dtype=torch.float32)


def _backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """The backward kernel: ``dx`` (x's shape and dtype, contiguous) and ``dw`` (weight's)."""
    cols = x.shape[-1]
    x2, dy2 = _rows(x, cols), _rows(dy, cols)
    rows = x2.shape[0]
    dx = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    programs = _bwd_programs(rows, x2.device)
    partial = torch.zeros(programs, cols, dtype=torch.float32, device=x2.device)
    block = triton.next_power_of_2(cols)
    if rows:
        runtime.kernel(_bwd_kernel)[(programs,)](
            x2,
            weight,
            dy2,
            rstd,
            dx,
            partial,
            x2.stride(0),
            dy2.stride(0),
            dx.stride(0),
            rows,
            cols,
            BLOCK=block,
            num_warps=_warps(block),
        )
    return dx.view(x.shape), partial.sum(0).to(weight.dtype)


rms_norm_bwd = torch.library.custom_op("llmkit::rms_norm_bwd", _backward, mutates_args=())


@rms_norm_bwd.register_fake
def _rms_norm_bwd_fake(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _autograd_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd(dy, x, weight, rstd)
    return dx, dw, None


rms_norm_fwd.register_autograd(_autograd_backward, setup_context=_setup_context)


class _EagerRMSNorm(torch.autograd.Function):
    """The same launchers for eager calls (an autograd.Function dispatches faster)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, x, weight, rstd)
        return dx, dw, None


def supported(x: Tensor, weight: Tensor) -> bool:
    """True when the kernel handles these tensors (dtype, size, device rules)."""
    if x.dtype not in DTYPES or weight.dtype not in DTYPES or x.shape[-1] > MAX_FEATURES:
        return False
    if x.device != weight.device:
        return False
    # The interpreter computes bf16 arithmetic wrongly (triton 3.9); keep bf16 off it.
    bf16 = torch.bfloat16 in (x.dtype, weight.dtype)
    return not (bf16 and not x.is_cuda and runtime.interpreting())


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x`` over its last dimension by the fused kernels (differentiable)."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if torch.compiler.is_compiling():
        return rms_norm_fwd(x, weight.contiguous(), float(eps))[0]
    return _EagerRMSNorm.apply(x, weight.contiguous(), float(eps))
