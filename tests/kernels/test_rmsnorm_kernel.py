"""The fused RMSNorm Triton kernel (llmkit.kernels.rmsnorm) and the ``rmsnorm_triton``
component: compiled on CUDA tensors with a GPU, in the Triton interpreter on CPU without one.

Where the kernels run is the ``kernel_device`` fixture (tests/kernels/conftest.py). With a CUDA
GPU the kernel tests run the compiled kernels on CUDA tensors and add bf16 and GPU-sized
cases (rows of 1000–16000 features, more rows than the backward has programs). Without one
they set ``TRITON_INTERPRET=1`` and run the kernels in the interpreter on tiny CPU tensors;
bf16 (the interpreter's bf16 arithmetic is wrong in triton 3.9) and GPU-sized cases skip
there, saying why. The reference-path tests run on CPU on every machine.

Accuracy criterion: the reference is ``F.rms_norm`` in float64; the plain ``rmsnorm``
component in the input dtype ("pt", fp32 math, output cast back) sets the error budget. For
y, dx and dweight::

    max|kernel − ref| ≤ 2 · max|pt − ref| + floor,   floor = 1e-5 (fp32), 2e-3 (fp16),
                                                      1e-2 (bf16, CUDA only)
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from llmkit.components.norm.rmsnorm import RMSNorm
from llmkit.components.norm.rmsnorm_triton import RMSNormTriton
from llmkit.contracts import BuildContext
from llmkit.kernels import runtime
from tests.kernels.common import BF16, CUDA, assert_within_budget, case, spy

rn = pytest.importorskip("llmkit.kernels.rmsnorm", reason="needs triton")

FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
EPS = 1e-6

pytestmark = pytest.mark.usefixtures("one_thread")


def ctx(dim: int) -> BuildContext:
    return BuildContext(
        d_model=dim, n_heads=2, n_kv_heads=2, head_dim=dim // 2, max_seq_len=8, n_layers=1
    )


def inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3 + 0.5
    w = torch.rand(shape[-1], generator=g) + 0.5
    dy = torch.randn(*shape, generator=g)
    return x, w, dy


def grads(fn, x, w, dy, dtype, device):
    """``fn``'s output and gradients for x and w, on ``device`` in ``dtype`` (a tensor
    already there stays as it is, strides included)."""
    x = x.to(device, dtype).requires_grad_(True)
    w = w.to(device, dtype).requires_grad_(True)
    y = fn(x, w)
    return [y.detach(), *torch.autograd.grad(y, (x, w), dy.to(device, dtype))]


def plain(x, w):
    """The plain ``rmsnorm`` component's forward, with ``w`` as its weight."""
    return RMSNorm.forward(SimpleNamespace(features=x.shape[-1], weight=w, eps=EPS, offset=0.0), x)


def test_in_interpreter_subprocess(rerun_in_interpreter):
    """Where this process can run the kernels neither compiled nor interpreted, rerun the
    module in a child that can interpret them."""
    rerun_in_interpreter(__file__)


GPU_SHAPES = [(3, 333, 1000), (2, 300, 4096), (7, 16000)]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, BF16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize(
    "shape",
    [
        *((3, 7, 40), (1, 16), (2, 5, 64)),
        *(case(s, id=f"gpu-{s}", gpu_sized=True) for s in GPU_SHAPES),
    ],
    ids=str,
)
def test_kernel_matches_reference(kernel_device, shape, dtype):
    x, w, dy = inputs(shape, seed=len(shape))
    got = grads(lambda x, w: rn.rms_norm_triton(x, w, EPS), x, w, dy, dtype, kernel_device)
    pt = grads(plain, x, w, dy, dtype, kernel_device)
    ref = grads(
        lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS), x, w, dy, torch.float64, kernel_device
    )
    assert_within_budget(("y", "dx", "dw"), got, pt, ref, FLOOR[dtype])


@pytest.mark.parametrize(
    ("shape", "cols"),
    [
        case((6, 4, 32), 24, id="tiny"),
        case((3, 333, 1024), 1000, id="gpu-999x1000", gpu_sized=True),
    ],
)
def test_strided_rows_and_deterministic_backward(kernel_device, shape, cols):
    """Rows with a stride wider than the features (a column slice, kept as a view) give the
    plain result; reruns of forward and backward are bit-identical."""
    wide, w, dy = inputs(shape, seed=3)
    view, w, dy = wide.to(kernel_device)[..., :cols], w[:cols], dy[..., :cols]

    def kernel(x, w):
        assert x.reshape(-1, cols).stride(0) == shape[-1]  # the kernel reads the strided rows
        return rn.rms_norm_triton(x, w, EPS)

    first = grads(kernel, view, w, dy, torch.float32, kernel_device)
    again = grads(kernel, view, w, dy, torch.float32, kernel_device)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    ref = grads(plain, view, w, dy, torch.float32, kernel_device)
    for a, r in zip(first, ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


def test_component_shares_options_and_weights_with_rmsnorm():
    assert RMSNormTriton.Options is RMSNorm.Options
    plain_norm = RMSNorm(RMSNorm.Options(eps=1e-5), ctx(16))
    fused = RMSNormTriton(RMSNormTriton.Options(eps=1e-5), ctx(16))
    assert list(fused.state_dict()) == list(plain_norm.state_dict()) == ["weight"]
    with torch.no_grad():
        plain_norm.weight.uniform_(0.5, 1.5)
    fused.load_state_dict(plain_norm.state_dict())
    plain_norm.load_state_dict(fused.state_dict())
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(fused(x), plain_norm(x))


def test_component_dispatch(kernel_device, monkeypatch):
    """The kernel for fp32 on the kernel device; for bf16 too on CUDA, while in the
    interpreter bf16 takes the reference path."""
    calls = spy(monkeypatch, rn, "rms_norm_triton")
    norm = RMSNormTriton(RMSNormTriton.Options(), ctx(16)).to(kernel_device)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0)).to(kernel_device)
    torch.testing.assert_close(norm(x), RMSNorm.forward(norm, x), atol=1e-6, rtol=1e-5)
    assert len(calls) == 1
    y = norm.bfloat16()(x.bfloat16())
    assert y.dtype == torch.bfloat16
    assert len(calls) == (2 if kernel_device.type == "cuda" else 1)


def test_interpreter_sends_cpu_bf16_to_the_reference(monkeypatch):
    """Under TRITON_INTERPRET=1, CPU bf16 takes the reference path (the interpreter's bf16
    is wrong): no kernel launches, so this runs on every machine."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = spy(monkeypatch, rn, "rms_norm_triton")
    norm = RMSNormTriton(RMSNormTriton.Options(), ctx(16)).bfloat16()
    x = torch.randn(2, 3, 16).bfloat16()
    y = norm(x)
    assert not calls and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, RMSNorm.forward(norm, x))


def test_component_reference_path_without_interpreter_logs_once(monkeypatch, caplog):
    """CPU tensors without the interpreter take the reference path (on every machine)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(runtime, "_announced", set())

    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on CPU without the interpreter")

    monkeypatch.setattr(rn, "rms_norm_triton", boom)
    norm = RMSNormTriton(RMSNormTriton.Options(), ctx(16))
    x = torch.randn(2, 3, 16)
    with caplog.at_level(logging.INFO, logger="llmkit.kernels"):
        y = norm(x)
        norm(x)
    torch.testing.assert_close(y, RMSNorm.forward(norm, x))
    notes = [r for r in caplog.records if "norm.rmsnorm_triton" in r.getMessage()]
    assert len(notes) == 1 and "reference" in notes[0].getMessage()


def test_runtime_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    line = RMSNormTriton.runtime_backend()
    assert line.startswith("norm.rmsnorm_triton:")
    assert ("Triton kernel on CUDA" if CUDA else "reference") in line
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in RMSNormTriton.runtime_backend()
