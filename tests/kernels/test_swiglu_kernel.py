"""The fused SwiGLU activation Triton kernel (llmkit.kernels.swiglu) and the ``swiglu_triton``
component, run in the Triton interpreter without a GPU.

Accuracy criterion: the reference is ``silu(g) · u`` in float64; the plain ``swiglu``
activation in the input dtype ("pt") sets the error budget. For h, dg and du::

    max|kernel − ref| ≤ 2 · max|pt − ref| + floor,   floor = 1e-5 (fp32), 2e-3 (fp16),
                                                      1e-2 (bf16, CUDA only)

bf16 is skipped in the interpreter (its bf16 arithmetic is wrong in triton 3.9).
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
from tests.kernels.common import BF16, CUDA, DEVICE, assert_within_budget

sg = pytest.importorskip("llmkit.kernels.swiglu", reason="needs triton")

FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
CTX = BuildContext(d_model=16, n_heads=2, n_kv_heads=2, head_dim=8, max_seq_len=8, n_layers=1)

pytestmark = pytest.mark.usefixtures("one_thread")


def grads(fn, g, u, dh, dtype):
    g = g.to(DEVICE, dtype).requires_grad_(True)
    u = u.to(DEVICE, dtype).requires_grad_(True)
    h = fn(g, u)
    return [h.detach(), *torch.autograd.grad(h, (g, u), dh.to(DEVICE, dtype))]


def plain(g, u):
    return SwiGLU.activate(None, g, u)


def test_in_interpreter_subprocess(rerun_in_interpreter):
    """Where this process cannot interpret Triton, run the module in a child that can."""
    rerun_in_interpreter(__file__)


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, BF16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("shape", [(5, 300), (2, 3, 7), (1,)], ids=str)
def test_kernel_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(len(shape))
    g, u, dh = (torch.randn(*shape, generator=gen) * 4 for _ in range(3))
    g.view(-1)[0] = -60.0  # σ underflows to 0: no NaN
    got = grads(sg.swiglu_triton, g, u, dh, dtype)
    pt = grads(plain, g, u, dh, dtype)
    ref = grads(lambda g, u: F.silu(g) * u, g, u, dh, torch.float64)
    assert_within_budget(("h", "dg", "du"), got, pt, ref, FLOOR[dtype])


@pytest.mark.usefixtures("interpret")
def test_empty_and_non_contiguous_inputs():
    assert sg.swiglu_triton(torch.empty(0, 4), torch.empty(0, 4)).shape == (0, 4)
    g, u = torch.randn(2, 6, 8, device=DEVICE).unbind(0)
    g, u = g.t(), u.t()  # non-contiguous views
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


@pytest.mark.usefixtures("interpret")
def test_component_dispatch(monkeypatch):
    """The kernel for fp32; the reference for bf16 in the interpreter."""
    calls: list[int] = []
    real = sg.SwiGLUFunction.apply
    monkeypatch.setattr(sg.SwiGLUFunction, "apply", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    opts = SwiGLU.Options(hidden=24)
    fused = SwiGLUTriton(opts, CTX).to(DEVICE)
    plain_ffn = SwiGLU(opts, CTX).to(DEVICE)
    plain_ffn.load_state_dict(fused.state_dict())
    x = torch.randn(2, 3, 16, device=DEVICE, requires_grad=True)
    out = fused(x)
    assert calls == [1]
    torch.testing.assert_close(out, plain_ffn(x), atol=1e-5, rtol=1e-5)
    out.sum().backward()  # gradients reach the projections through the kernel
    assert all(p.grad is not None for p in fused.parameters())
    fused.bfloat16()(x.detach().bfloat16())
    assert calls == [1, 1] if CUDA else [1]


def test_component_reference_path_without_interpreter_logs_once(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(runtime, "_announced", set())

    def boom(*args):
        raise AssertionError("the Triton kernel ran on CPU without the interpreter")

    monkeypatch.setattr(sg.SwiGLUFunction, "apply", boom)
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
