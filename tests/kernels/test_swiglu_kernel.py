"""The fused SwiGLU activation Triton kernel (llmkit.kernels.swiglu) and the ``swiglu_triton``
component: compiled on CUDA tensors with a GPU, in the Triton interpreter on CPU without one.

Where the kernels run is the ``kernel_device`` fixture (tests/kernels/conftest.py). With a CUDA
GPU the kernel tests run the compiled kernels on CUDA tensors and add bf16 and GPU-sized
cases (up to a million elements, ragged against the GPU's 1024-element blocks). Without one
they set ``TRITON_INTERPRET=1`` and run the kernels in the interpreter on tiny CPU tensors;
bf16 (the interpreter's bf16 arithmetic is wrong in triton 3.9) and GPU-sized cases skip
there, saying why. The reference-path tests run on CPU on every machine.

Accuracy criterion: the reference is ``silu(g) · u`` in float64; the plain ``swiglu``
activation in the input dtype ("pt") sets the error budget. For h, dg and du::

    max|kernel − ref| ≤ 2 · max|pt − ref| + floor,   floor = 1e-5 (fp32), 2e-3 (fp16),
                                                      1e-2 (bf16, CUDA only)
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from llmkit.components.ffn.swiglu import SwiGLU
from llmkit.components.ffn.swiglu_triton import SwiGLUTriton
from llmkit.contracts import BuildContext
from llmkit.kernels import runtime
from tests.kernels.common import BF16, CUDA, assert_within_budget, case, spy

sg = pytest.importorskip("llmkit.kernels.swiglu", reason="needs triton")

FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
CTX = BuildContext(d_model=16, n_heads=2, n_kv_heads=2, head_dim=8, max_seq_len=8, n_layers=1)

pytestmark = pytest.mark.usefixtures("one_thread")


def grads(fn, g, u, dh, dtype, device):
    """``fn``'s output and gradients for g and u, on ``device`` in ``dtype``."""
    g = g.to(device, dtype).requires_grad_(True)
    u = u.to(device, dtype).requires_grad_(True)
    h = fn(g, u)
    return [h.detach(), *torch.autograd.grad(h, (g, u), dh.to(device, dtype))]


def plain(g, u):
    return SwiGLU.activate(None, g, u)


def test_in_interpreter_subprocess(rerun_in_interpreter):
    """Where this process can run the kernels neither compiled nor interpreted, rerun the
    module in a child that can interpret them."""
    rerun_in_interpreter(__file__)


GPU_SHAPES = [(3, 333, 1000), (4097,), (2, 300, 5461)]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, BF16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize(
    "shape",
    [
        *((5, 300), (2, 3, 7), (1,)),
        *(case(s, id=f"gpu-{s}", gpu_sized=True) for s in GPU_SHAPES),
    ],
    ids=str,
)
def test_kernel_matches_reference(kernel_device, shape, dtype):
    gen = torch.Generator().manual_seed(len(shape))
    g, u, dh = (torch.randn(*shape, generator=gen) * 4 for _ in range(3))
    g.view(-1)[0] = -60.0  # σ underflows to 0: no NaN
    got = grads(sg.swiglu_triton, g, u, dh, dtype, kernel_device)
    pt = grads(plain, g, u, dh, dtype, kernel_device)
    ref = grads(lambda g, u: F.silu(g) * u, g, u, dh, torch.float64, kernel_device)
    assert_within_budget(("h", "dg", "du"), got, pt, ref, FLOOR[dtype])


def test_empty_and_non_contiguous_inputs(kernel_device):
    empty = torch.empty(0, 4, device=kernel_device)
    assert sg.swiglu_triton(empty, empty).shape == (0, 4)
    g, u = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0)).unbind(0)
    g, u = g.to(kernel_device).t(), u.to(kernel_device).t()  # non-contiguous views
    assert not g.is_contiguous()
    torch.testing.assert_close(sg.swiglu_triton(g, u), plain(g, u))


def test_component_shares_options_and_weights_with_swiglu():
    assert SwiGLUTriton.Options is SwiGLU.Options
    opts = SwiGLU.Options(hidden=24, bias=False)
    plain_ffn, fused = SwiGLU(opts, CTX), SwiGLUTriton(opts, CTX)
    assert list(fused.state_dict()) == list(plain_ffn.state_dict())
    fused.load_state_dict(plain_ffn.state_dict())
    plain_ffn.load_state_dict(fused.state_dict())
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(fused(x), plain_ffn(x))


def test_component_dispatch(kernel_device, monkeypatch):
    """The kernel for fp32 on the kernel device (gradients reach the projections through
    it); for bf16 too on CUDA, while in the interpreter bf16 takes the reference path."""
    calls = spy(monkeypatch, sg, "swiglu_triton")
    torch.manual_seed(0)
    opts = SwiGLU.Options(hidden=24)
    fused = SwiGLUTriton(opts, CTX).to(kernel_device)
    plain_ffn = SwiGLU(opts, CTX).to(kernel_device)
    plain_ffn.load_state_dict(fused.state_dict())
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
    x = x.to(kernel_device).requires_grad_(True)
    out = fused(x)
    assert len(calls) == 1
    torch.testing.assert_close(out, plain_ffn(x), atol=1e-5, rtol=1e-5)
    out.sum().backward()  # gradients reach the projections through the kernel
    assert all(p.grad is not None for p in fused.parameters())
    low = fused.bfloat16()(x.detach().bfloat16())
    assert low.dtype == torch.bfloat16
    assert len(calls) == (2 if kernel_device.type == "cuda" else 1)


def test_interpreter_sends_cpu_bf16_to_the_reference(monkeypatch):
    """Under TRITON_INTERPRET=1, CPU bf16 takes the reference path (the interpreter's bf16
    is wrong): no kernel launches, so this runs on every machine."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = spy(monkeypatch, sg, "swiglu_triton")
    g, u = torch.randn(2, 3, 24).bfloat16(), torch.randn(2, 3, 24).bfloat16()
    h = SwiGLUTriton(SwiGLU.Options(hidden=24), CTX).activate(g, u)
    assert not calls and h.dtype == torch.bfloat16
    torch.testing.assert_close(h, plain(g, u))


def test_component_reference_path_without_interpreter_logs_once(monkeypatch, caplog):
    """CPU tensors without the interpreter take the reference path (on every machine)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(runtime, "_announced", set())

    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on CPU without the interpreter")

    monkeypatch.setattr(sg, "swiglu_triton", boom)
    ffn = SwiGLUTriton(SwiGLU.Options(hidden=24), CTX)
    x = torch.randn(2, 3, 16)
    with caplog.at_level(logging.INFO, logger="llmkit.kernels"):
        y = ffn(x)
        ffn(x)
    plain_ffn = SwiGLU(SwiGLU.Options(hidden=24), CTX)
    plain_ffn.load_state_dict(ffn.state_dict())
    torch.testing.assert_close(y, plain_ffn(x), atol=0, rtol=0)
    notes = [r for r in caplog.records if "ffn.swiglu_triton" in r.getMessage()]
    assert len(notes) == 1 and "reference" in notes[0].getMessage()


def test_runtime_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    line = SwiGLUTriton.runtime_backend()
    assert line.startswith("ffn.swiglu_triton:")
    assert ("Triton kernel on CUDA" if CUDA else "reference") in line
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in SwiGLUTriton.runtime_backend()
