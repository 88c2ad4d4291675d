"""The sliding-window attention Triton kernel (llmkit.kernels.sliding_window) and the
``sliding_window`` component's dispatch: compiled on CUDA tensors with a GPU, in the Triton
interpreter on CPU without one.

Where the kernels run is the ``kernel_device`` fixture (tests/kernels/conftest.py). With a CUDA
GPU every kernel test runs the compiled kernels on CUDA tensors, and adds bf16 and GPU-sized
cases (lengths 300, 333, 1000 against 64–128-row GPU tiles, windows below, across and above a
tile). Without one it sets ``TRITON_INTERPRET=1`` for the test and runs the kernels in the
interpreter on CPU tensors: tiny shapes only (≤ 64 keys, batch·heads ≤ 8; interpreter tiles
are 16×16, so they still span several blocks with ragged tails), no bf16 (the interpreter's
bf16 arithmetic is wrong in triton 3.9); those cases skip there, saying why. The argument
checks and the reference-path tests run on CPU on every machine.

Accuracy criterion (as flash-attention's tests): the reference is the textbook formula in
float64 from explicit positions (on the kernel's device); the plain-PyTorch block-local
implementation in the input dtype ("pt") sets the error budget. For the output and each of
dq, dk, dv::

    max|kernel − ref| ≤ 2 · max|pt − ref| + floor,   floor = 1e-5 (fp32), 2e-3 (fp16),
                                                      1e-2 (bf16, CUDA only)
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import Tensor

from llmkit.components.attention.sliding_window import (
    SlidingWindowAttention,
    sliding_window_attention,
)
from llmkit.components.position.alibi import alibi_slopes
from llmkit.contracts import BuildContext, DistanceBias
from llmkit.kernels import runtime
from tests.kernels.common import CUDA, assert_within_budget, case, spy

sw = pytest.importorskip("llmkit.kernels.sliding_window", reason="needs triton")
flash = pytest.importorskip("llmkit.kernels.flash_attention", reason="needs triton")

FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

pytestmark = pytest.mark.usefixtures("one_thread")


def textbook(q, k, v, window, *, slopes=None, pad=None) -> Tensor:
    """Sliding-window attention in float64 from explicit positions; empty rows give 0."""
    q, k, v = q.double(), k.double(), v.double()
    hq, tq, d = q.shape[1], q.shape[2], q.shape[3]
    hkv, tk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    qpos = torch.arange(tk - tq, tk, device=q.device)[:, None]
    kpos = torch.arange(tk, device=q.device)[None, :]
    allowed = ((kpos <= qpos) & (kpos > qpos - window))[None, None]
    if pad is not None:
        allowed = allowed & pad[:, None, None, :]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if slopes is not None:
        scores = scores - slopes.double()[None, :, None, None] * (qpos - kpos).clamp(min=0)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v


def make_inputs(b, hq, hkv, tq, tk, d, *, seed=0, pad_keys=0):
    """fp32 q, k, v, an upstream gradient, and (optionally) a left-padding mask: the last
    batch row loses its first ``pad_keys`` keys."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g) for h, t in ((hq, tq), (hkv, tk), (hkv, tk)))
    grad = torch.randn(b, hq, tq, d, generator=g)
    pad = None
    if pad_keys:
        pad = torch.ones(b, tk, dtype=torch.bool)
        pad[-1, :pad_keys] = False
    return q, k, v, grad, pad


def forward_backward(fn, q, k, v, grad, dtype, device):
    """``fn``'s output and input gradients, on ``device`` in ``dtype``."""
    ins = [t.to(device, dtype).requires_grad_(True) for t in (q, k, v)]
    out = fn(*ins)
    grads = torch.autograd.grad(out, ins, grad.to(device, dtype))
    return [out.detach(), *grads]


def textbook_grads(q, k, v, grad, window, device, *, slopes=None, pad=None):
    """:func:`textbook`'s output and input gradients in float64 on ``device``."""
    slopes = None if slopes is None else slopes.to(device)
    pad = None if pad is None else pad.to(device)
    ins = [t.to(device, torch.float64).requires_grad_(True) for t in (q, k, v)]
    out = textbook(*ins, window, slopes=slopes, pad=pad)
    return [out.detach(), *torch.autograd.grad(out, ins, grad.to(device, torch.float64))]


def assert_grads_within_budget(got, pt, ref, dtype):
    assert_within_budget(("out", "dq", "dk", "dv"), got, pt, ref, FLOOR[dtype])


def test_in_interpreter_subprocess(rerun_in_interpreter):
    """Where this process can run the kernels neither compiled nor interpreted, rerun the
    module in a child that can interpret them."""
    rerun_in_interpreter(__file__)


# (b, hq, hkv, tq, tk, d, window, alibi, padded keys): tiny, for every machine
CASES = {
    "length-1": (1, 2, 1, 1, 1, 16, 4, False, 0),
    "ragged-batch2-gqa2": (2, 2, 1, 37, 37, 16, 5, False, 0),
    "window-over-length-d8": (1, 2, 2, 33, 33, 8, 50, False, 0),
    "window-1": (1, 2, 2, 20, 20, 16, 1, False, 0),
    "gqa4-alibi": (1, 4, 1, 24, 24, 16, 7, True, 0),
    "gqa8": (1, 8, 1, 17, 17, 16, 6, False, 0),
    "decode-tq1": (2, 4, 2, 1, 40, 16, 9, True, 0),
    "prefill-tq<tk-d24": (1, 2, 1, 10, 45, 24, 12, True, 0),
    "left-padding": (2, 2, 1, 21, 29, 16, 6, True, 11),
}
LOW_PRECISION_CASES = ["ragged-batch2-gqa2", "gqa4-alibi", "decode-tq1", "left-padding"]
# GPU-sized (CUDA only), in fp32, fp16 and bf16: lengths spanning several 64–128-row GPU tiles
# with ragged tails; windows below, across and above a tile.
GPU_CASES = {
    "gpu-300-w64-alibi": (2, 4, 2, 300, 300, 64, 64, True, 0),
    "gpu-333-w200-padding": (2, 4, 1, 333, 333, 64, 200, True, 57),
    "gpu-1000-w257-d128-gqa4": (1, 8, 2, 1000, 1000, 128, 257, False, 0),
    "gpu-300of1000-w100-alibi": (1, 4, 4, 300, 1000, 64, 100, True, 0),
    "gpu-decode-tq1-1000-w128": (2, 4, 2, 1, 1000, 64, 128, True, 0),
}
SHAPES = CASES | GPU_CASES
FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16

MATRIX = [
    *(case(name, FP32, id=f"{name}-float32") for name in CASES),
    *(
        case(name, dtype, id=f"{name}-{str(dtype).removeprefix('torch.')}")
        for dtype in (FP16, BF16)
        for name in LOW_PRECISION_CASES
    ),
    *(
        case(name, dtype, id=f"{name}-{str(dtype).removeprefix('torch.')}", gpu_sized=True)
        for dtype in (FP32, FP16, BF16)
        for name in GPU_CASES
    ),
]


@pytest.mark.parametrize(("case_name", "dtype"), MATRIX)
def test_kernel_matches_reference(kernel_device, case_name, dtype):
    b, hq, hkv, tq, tk, d, window, alibi, pad_keys = SHAPES[case_name]
    q, k, v, grad, pad = make_inputs(b, hq, hkv, tq, tk, d, seed=tq * tk, pad_keys=pad_keys)
    slopes = torch.tensor(alibi_slopes(hq)) if alibi else None
    dev_pad = None if pad is None else pad.to(kernel_device)
    dev_slopes = None if slopes is None else slopes.to(kernel_device)

    def kernel(q, k, v):
        return sw.sliding_window_attention_triton(
            q, k, v, window, slopes=dev_slopes, key_padding_mask=dev_pad
        )

    def plain(q, k, v):
        bias = None if slopes is None else DistanceBias(dev_slopes)
        return sliding_window_attention(q, k, v, window, bias=bias, key_padding_mask=dev_pad)

    got = forward_backward(kernel, q, k, v, grad, dtype, kernel_device)
    pt = forward_backward(plain, q, k, v, grad, dtype, kernel_device)
    ref = textbook_grads(q, k, v, grad, window, kernel_device, slopes=slopes, pad=pad)
    assert_grads_within_budget(got, pt, ref, dtype)
    if pad_keys:  # queries whose whole window is padding return zeros
        empty = got[0][-1, :, : pad_keys - (tk - tq)]  # their newest key is padding
        assert empty.numel() and torch.equal(empty, torch.zeros_like(empty))


@pytest.mark.parametrize(
    ("block_m", "block_n", "tq", "tk", "window", "dtype"),
    [
        case(16, 32, 19, 50, 13, FP32, id="16x32"),
        case(32, 16, 19, 50, 13, FP32, id="32x16"),
        case(128, 64, 300, 1000, 100, FP32, id="gpu-128x64-fp32", gpu_sized=True),
        case(64, 128, 300, 1000, 100, BF16, id="gpu-64x128-bf16", gpu_sized=True),
    ],
)
def test_unequal_tiles(kernel_device, block_m, block_n, tq, tk, window, dtype):
    """Block bounds hold when query and key tiles differ in size."""
    q, k, v, grad, _ = make_inputs(1, 2, 1, tq, tk, 16, seed=3)
    slopes = torch.tensor(alibi_slopes(2))
    dev_slopes = slopes.to(kernel_device)

    def kernel(q, k, v):
        return sw.sliding_window_attention_triton(
            q, k, v, window, slopes=dev_slopes, block_m=block_m, block_n=block_n
        )

    def plain(q, k, v):
        return sliding_window_attention(q, k, v, window, bias=DistanceBias(dev_slopes))

    got = forward_backward(kernel, q, k, v, grad, dtype, kernel_device)
    ref = textbook_grads(q, k, v, grad, window, kernel_device, slopes=slopes)
    if dtype == FP32:
        for a, r in zip(got, ref, strict=True):
            torch.testing.assert_close(a.double(), r, atol=1e-5, rtol=0)
    else:
        pt = forward_backward(plain, q, k, v, grad, dtype, kernel_device)
        assert_grads_within_budget(got, pt, ref, dtype)


@pytest.mark.parametrize("tq", [1, 16])
def test_only_window_blocks_are_read(kernel_device, tq):
    """Keys in blocks outside every window are never loaded: NaN there cannot leak into the
    output (0·NaN = NaN in a matmul), and their gradients are exactly zero."""
    tk, window = 64, 5
    q, k, v, grad, _ = make_inputs(1, 2, 1, tq, tk, 16, seed=tq)
    first_needed = tk - tq - window + 1  # first key any query may attend
    cut = (first_needed // 16) * 16  # the kernel starts at that key's 16-wide block
    assert cut >= 16
    k[:, :, :cut] = float("nan")
    v[:, :, :cut] = float("nan")
    out, dq, dk, dv = forward_backward(
        lambda q, k, v: sw.sliding_window_attention_triton(q, k, v, window, block_n=16),
        q, k, v, grad, torch.float32, kernel_device,
    )  # fmt: skip
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    assert torch.equal(dk[:, :, :cut], torch.zeros_like(dk[:, :, :cut]))
    assert torch.equal(dv[:, :, :cut], torch.zeros_like(dv[:, :, :cut]))
    ref = textbook(q, k[:, :, cut:], v[:, :, cut:], window)
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "t", "window", "pad_keys", "dtype"),
    [
        case(2, 4, 2, 30, 9, 5, FP32, id="tiny"),
        case(2, 8, 2, 1000, 200, 77, BF16, id="gpu-1000-bf16", gpu_sized=True),
    ],
)
def test_backward_is_deterministic(kernel_device, b, hq, hkv, t, window, pad_keys, dtype):
    q, k, v, grad, pad = make_inputs(b, hq, hkv, t, t, 16, seed=7, pad_keys=pad_keys)
    slopes = torch.tensor(alibi_slopes(hq)).to(kernel_device)
    mask = pad.to(kernel_device)

    def run():
        return forward_backward(
            lambda q, k, v: sw.sliding_window_attention_triton(
                q, k, v, window, slopes=slopes, key_padding_mask=mask
            ),
            q, k, v, grad, dtype, kernel_device,
        )  # fmt: skip

    for x, y in zip(run(), run(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    ("tq", "tk", "dtype"),
    [
        case(23, 23, FP32, id="23"),
        case(5, 23, FP32, id="5"),
        case(300, 333, FP32, id="gpu-300of333-fp32", gpu_sized=True),
        case(333, 333, BF16, id="gpu-333-bf16", gpu_sized=True),
    ],
)
def test_window_covering_every_key_is_plain_causal_flash(kernel_device, tq, tk, dtype):
    """A window ≥ Tk changes nothing: outputs and gradients equal the flash kernel's without
    a window, bit for bit (same blocks, same order; the window mask keeps everything)."""
    q, k, v, grad, pad = make_inputs(2, 4, 2, tq, tk, 16, seed=tq, pad_keys=4)
    slopes = torch.tensor(alibi_slopes(4)).to(kernel_device)
    bias, mask = DistanceBias(slopes), pad.to(kernel_device)

    def windowed(q, k, v):
        return sw.sliding_window_attention_triton(
            q, k, v, tk + 17, slopes=slopes, key_padding_mask=mask
        )

    def causal(q, k, v):
        return flash.flash_attention(q, k, v, causal=True, bias=bias, key_padding_mask=mask)

    got = forward_backward(windowed, q, k, v, grad, dtype, kernel_device)
    want = forward_backward(causal, q, k, v, grad, dtype, kernel_device)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)


def test_flash_rejects_a_bad_window():
    q, k, v, _, _ = make_inputs(1, 2, 1, 4, 4, 16)
    with pytest.raises(ValueError, match="causal"):
        flash.flash_attention(q, k, v, causal=False, window=2)
    with pytest.raises(ValueError, match="window"):
        flash.flash_attention(q, k, v, window=0)


def test_rejects_bad_arguments_and_takes_empty_queries():
    q, k, v, _, _ = make_inputs(1, 2, 1, 0, 4, 16)
    assert sw.sliding_window_attention_triton(q, k, v, 3).shape == (1, 2, 0, 16)
    with pytest.raises(ValueError, match="window"):
        sw.sliding_window_attention_triton(q, k, v, 0)
    q, k, v, _, _ = make_inputs(1, 3, 2, 4, 4, 16)
    with pytest.raises(ValueError, match="multiple"):
        sw.sliding_window_attention_triton(q, k, v, 3)
    q, k, v, _, _ = make_inputs(1, 2, 1, 4, 4, 16)
    with pytest.raises(ValueError, match="slopes"):
        sw.sliding_window_attention_triton(q, k, v, 3, slopes=torch.ones(3))
    with pytest.raises(ValueError, match="key_padding_mask"):
        sw.sliding_window_attention_triton(q, k, v, 3, key_padding_mask=torch.ones(1, 5).bool())


# --------------------------------------------------------------------------- the component

CTX = BuildContext(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=64, n_layers=1)


def _kernel_windows(monkeypatch):
    """``windows()``: the window of every call the component has made into the kernel."""
    calls = spy(monkeypatch, sw, "sliding_window_attention_triton")
    return lambda: [args[3] for args, _ in calls]


def test_component_dispatch(kernel_device, monkeypatch):
    """The kernel in eval and in training without dropout (padding included); the reference
    for dropout in training; bf16 takes the kernel on CUDA, the reference in the interpreter."""
    windows = _kernel_windows(monkeypatch)
    q, k, v, _, pad = (t.to(kernel_device) for t in make_inputs(2, 4, 2, 9, 9, 8, pad_keys=3))
    bias = DistanceBias(torch.tensor(alibi_slopes(4), device=kernel_device))
    layer = SlidingWindowAttention(SlidingWindowAttention.Options(window=4), CTX)
    out = layer.eval()(q, k, v, bias=bias, key_padding_mask=pad)
    assert windows() == [4]
    want = sliding_window_attention(q, k, v, 4, bias=bias, key_padding_mask=pad)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    layer.train()(q, k, v)
    assert windows() == [4, 4]

    dropping = SlidingWindowAttention(SlidingWindowAttention.Options(window=4, dropout=0.5), CTX)
    dropping.train()(q, k, v)
    assert windows() == [4, 4]
    low = dropping.eval()(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert low.dtype == torch.bfloat16
    assert windows() == ([4, 4, 4] if kernel_device.type == "cuda" else [4, 4])


def test_interpreter_sends_cpu_bf16_to_the_reference(monkeypatch):
    """Under TRITON_INTERPRET=1, CPU bf16 takes the reference path (the interpreter's bf16
    is wrong): no kernel launches, so this runs on every machine."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    windows = _kernel_windows(monkeypatch)
    q, k, v = (t.bfloat16() for t in make_inputs(1, 4, 2, 7, 7, 8)[:3])
    layer = SlidingWindowAttention(SlidingWindowAttention.Options(window=3), CTX).eval()
    out = layer(q, k, v)
    assert windows() == [] and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, sliding_window_attention(q, k, v, 3))


def test_component_reference_path_without_interpreter_logs_once(monkeypatch, caplog):
    """CPU tensors without the interpreter take the reference path (on every machine)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(runtime, "_announced", set())

    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on CPU without the interpreter")

    monkeypatch.setattr(sw, "sliding_window_attention_triton", boom)
    monkeypatch.setattr(flash, "flash_attention", boom)
    q, k, v, _, _ = make_inputs(1, 4, 2, 7, 7, 8)
    layer = SlidingWindowAttention(SlidingWindowAttention.Options(window=3), CTX).eval()
    with caplog.at_level(logging.INFO, logger="llmkit.kernels"):
        out = layer(q, k, v)
        layer(q, k, v)
    torch.testing.assert_close(out, sliding_window_attention(q, k, v, 3))
    notes = [r for r in caplog.records if "attention.sliding_window" in r.getMessage()]
    assert len(notes) == 1 and "reference" in notes[0].getMessage()


def test_runtime_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    line = SlidingWindowAttention.runtime_backend()
    assert line.startswith("attention.sliding_window:")
    assert ("Triton kernel on CUDA" if CUDA else "reference") in line
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in SlidingWindowAttention.runtime_backend()
