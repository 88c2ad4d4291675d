"""Fused SwiGLU activation (Shazeer 2020, "GLU Variants Improve Transformer") in Triton.

``h = silu(g) · u = g · σ(g) · u`` elementwise, for the gate and up projections of a SwiGLU
feed-forward block. Fusing reads g and u once and writes h once (the unfused PyTorch form
writes and re-reads silu(g)); the math is fp32, stored in the input dtype.

Backward recomputes σ(g) from the saved inputs instead of storing activations:
``du = dh · silu(g)`` and ``dg = dh · u · σ(g) · (1 + g · (1 − σ(g)))``.
Elementwise, so gradients are deterministic.

The PyTorch reference is ``F.silu(gate) * up`` (:meth:`llmkit.components.ffn.swiglu.SwiGLU.
activate`).

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


def _fwd_kernel(G, U, H, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(H + offs, h.to(H.dtype.element_ty), mask=ok)


def _bwd_kernel(G, U, DH, DG, DU, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    dh = tl.load(DH + offs, mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DU + offs, (dh * silu).to(DU.dtype.element_ty), mask=ok)
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=ok)


def _block(device: torch.device) -> int:
    return 1024 if device.type == "cuda" else 256


# Under torch.compile the kernels run inside the custom operators ``llmkit::swiglu_fwd`` /
# ``llmkit::swiglu_bwd`` (fake implementations, the backward registered as the forward's
# autograd formula), so a compiled model traces through a call as one node
# (``fullgraph=True``); eager calls take an autograd.Function over the same launchers, which
# dispatches faster.


def _forward(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` (contiguous, gate's shape and dtype)."""
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.numel()
    block = _block(gate.device)
    if n:
        runtime.kernel(_fwd_kernel)[(triton.cdiv(n, block),)](
            gate, up, h, n, BLOCK=block, num_warps=4
        )
    return h


swiglu_fwd = torch.library.custom_op("llmkit::swiglu_fwd", _forward, mutates_args=())


@swiglu_fwd.register_fake
def _swiglu_fwd_fake(gate, up):
    return gate.new_empty(gate.shape)


def _backward(dh: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients (d gate, d up), contiguous, recomputing σ(gate) from the inputs."""
    gate, up, dh = gate.contiguous(), up.contiguous(), dh.contiguous()
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    n = gate.numel()
    block = _block(gate.device)
    if n:
        runtime.kernel(_bwd_kernel)[(triton.cdiv(n, block),)](
            gate, up, dh, dg, du, n, BLOCK=block, num_warps=4
        )
    return dg, du


swiglu_bwd = torch.library.custom_op("llmkit::swiglu_bwd", _backward, mutates_args=())


@swiglu_bwd.register_fake
def _swiglu_bwd_fake(dh, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _autograd_backward(ctx, dh):
    gate, up = ctx.saved_tensors
    return swiglu_bwd(dh, gate, up)


swiglu_fwd.register_autograd(_autograd_backward, setup_context=_setup_context)


class _EagerSwiGLU(torch.autograd.Function):
    """The same launchers for eager calls (an autograd.Function dispatches faster)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return _forward(gate, up)

    @staticmethod
    def backward(ctx, dh: Tensor):
        gate, up = ctx.saved_tensors
        return _backward(dh, gate, up)


def supported(gate: Tensor, up: Tensor) -> bool:
    """True when the kernel handles these tensors (same shape, dtype and device rules)."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in DTYPES:
        return False
    if gate.device != up.device:
        return False
    # The interpreter computes bf16 arithmetic wrongly (triton 3.9); keep bf16 off it.
    return runtime.dtype_runs(gate)


def swiglu_triton(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` by the fused kernels (differentiable)."""
    if torch.compiler.is_compiling():
        return swiglu_fwd(gate, up)
    return _EagerSwiGLU.apply(gate, up)
