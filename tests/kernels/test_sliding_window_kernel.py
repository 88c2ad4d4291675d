"""The sliding-window attention Triton kernel (llmkit.kernels.sliding_window) and the
``sliding_window`` component's dispatch, run in the Triton interpreter without a GPU.

Accuracy criterion (as flash-attention's tests): the reference is the textbook formula in
float64 from explicit positions; the plain-PyTorch block-local implementation in the input
dtype ("pt") sets the error budget. For the output and each of dq, dk, dv::

    max|kernel − ref| ≤ 2 · max|pt − ref| + floor,   floor = 1e-5 (fp32), 2e-3 (fp16),
                                                      1e-2 (bf16, CUDA only)

bf16 is skipped in the interpreter: its bf16 arithmetic is wrong in triton 3.9. Interpreter
tiles are 16×16, so the shapes below (≤ 64 keys, batch·heads ≤ 8) still span several blocks
with ragged tails.
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
from tests.kernels.common import BF16_REASON, CUDA, DEVICE, assert_within_budget

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


def forward_backward(fn, q, k, v, grad, dtype):
    ins = [t.to(DEVICE, dtype).requires_grad_(True) for t in (q, k, v)]
    out = fn(*ins)
    grads = torch.autograd.grad(out, ins, grad.to(DEVICE, dtype))
    return [out.detach(), *grads]


def assert_grads_within_budget(got, pt, ref, dtype):
    assert_within_budget(("out", "dq", "dk", "dv"), got, pt, ref, FLOOR[dtype])


def test_in_interpreter_subprocess(rerun_in_interpreter):
    """Where this process cannot interpret Triton, run the module in a child that can."""
    rerun_in_interpreter(__file__)


# (b, hq, hkv, tq, tk, d, window, alibi, padded keys)
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


def _param(case: str, dtype: torch.dtype):
    skip = dtype == torch.bfloat16 and not CUDA
    marks = [pytest.mark.skip(reason=BF16_REASON)] if skip else []
    return pytest.param(case, dtype, marks=marks, id=f"{case}-{str(dtype).removeprefix('torch.')}")


MATRIX = [_param(case, torch.float32) for case in CASES] + [
    _param(case, dtype) for dtype in (torch.float16, torch.bfloat16) for case in LOW_PRECISION_CASES
]


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize(("case", "dtype"), MATRIX)
def test_kernel_matches_reference(case, dtype):
    b, hq, hkv, tq, tk, d, window, alibi, pad_keys = CASES[case]
    q, k, v, grad, pad = make_inputs(b, hq, hkv, tq, tk, d, seed=tq * tk, pad_keys=pad_keys)
    slopes = torch.tensor(alibi_slopes(hq)) if alibi else None
    dev_pad = None if pad is None else pad.to(DEVICE)
    dev_slopes = None if slopes is None else slopes.to(DEVICE)

    def kernel(q, k, v):
        return sw.sliding_window_attention_triton(
            q, k, v, window, slopes=dev_slopes, key_padding_mask=dev_pad
        )

    def plain(q, k, v):
        bias = None if slopes is None else DistanceBias(dev_slopes)
        return sliding_window_attention(q, k, v, window, bias=bias, key_padding_mask=dev_pad)

    got = forward_backward(kernel, q, k, v, grad, dtype)
    pt = forward_backward(plain, q, k, v, grad, dtype)
    ins = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref_out = textbook(*ins, window, slopes=slopes, pad=pad)
    ref = [ref_out.detach(), *torch.autograd.grad(ref_out, ins, grad.double())]
    assert_grads_within_budget(got, pt, [r.to(DEVICE) for r in ref], dtype)
    if pad_keys:  # queries whose whole window is padding return zeros
        empty = got[0][-1, :, : pad_keys - (tk - tq)]  # their newest key is padding
        assert empty.numel() and torch.equal(empty, torch.zeros_like(empty))


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize(("block_m", "block_n"), [(16, 32), (32, 16)])
def test_unequal_tiles(block_m, block_n):
    """Block bounds hold when query and key tiles differ in size."""
    q, k, v, grad, _ = make_inputs(1, 2, 1, 19, 50, 16, seed=3)
    slopes = torch.tensor(alibi_slopes(2)).to(DEVICE)

    def kernel(q, k, v):
        return sw.sliding_window_attention_triton(
            q, k, v, 13, slopes=slopes, block_m=block_m, block_n=block_n
        )

    got = forward_backward(kernel, q, k, v, grad, torch.float32)
    ins = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref_out = textbook(*ins, 13, slopes=slopes.cpu())
    ref = [ref_out.detach(), *torch.autograd.grad(ref_out, ins, grad.double())]
    for a, r in zip(got, ref, strict=True):
        torch.testing.assert_close(a.double().cpu(), r, atol=1e-5, rtol=0)


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("tq", [1, 16])
def test_only_window_blocks_are_read(tq):
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
        q, k, v, grad, torch.float32,
    )  # fmt: skip
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    assert torch.equal(dk[:, :, :cut], torch.zeros_like(dk[:, :, :cut]))
    assert torch.equal(dv[:, :, :cut], torch.zeros_like(dv[:, :, :cut]))
    ref = textbook(q, k[:, :, cut:], v[:, :, cut:], window)
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-5, rtol=0)


@pytest.mark.usefixtures("interpret")
def test_backward_is_deterministic():
    q, k, v, grad, pad = make_inputs(2, 4, 2, 30, 30, 16, seed=7, pad_keys=5)
    slopes = torch.tensor(alibi_slopes(4)).to(DEVICE)

    def run():
        return forward_backward(
            lambda q, k, v: sw.sliding_window_attention_triton(
                q, k, v, 9, slopes=slopes, key_padding_mask=pad.to(DEVICE)
            ),
            q, k, v, grad, torch.float32,
        )  # fmt: skip

    for a, b in zip(run(), run(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("tq", [23, 5])
def test_window_covering_every_key_is_plain_causal_flash(tq):
    """A window ≥ Tk changes nothing: outputs and gradients equal the flash kernel's without
    a window, bit for bit (same blocks, same order; the window mask keeps everything)."""
    q, k, v, grad, pad = make_inputs(2, 4, 2, tq, 23, 16, seed=tq, pad_keys=4)
    slopes = torch.tensor(alibi_slopes(4)).to(DEVICE)
    bias, mask = DistanceBias(slopes), pad.to(DEVICE)

    def windowed(q, k, v):
        return sw.sliding_window_attention_triton(q, k, v, 40, slopes=slopes, key_padding_mask=mask)

    def causal(q, k, v):
        return flash.flash_attention(q, k, v, causal=True, bias=bias, key_padding_mask=mask)

    got = forward_backward(windowed, q, k, v, grad, torch.float32)
    want = forward_backward(causal, q, k, v, grad, torch.float32)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


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


def _count_kernel_calls(monkeypatch) -> list[int]:
    """The window of every call into the Triton kernels."""
    calls: list[int] = []
    real = flash.FlashAttentionFunction.apply
    monkeypatch.setattr(
        flash.FlashAttentionFunction, "apply", lambda *a: calls.append(a[6]) or real(*a)
    )
    return calls


@pytest.mark.usefixtures("interpret")
def test_component_dispatch(monkeypatch):
    """The kernel in eval and in training without dropout (padding included); the reference
    for dropout in training, and for bf16 in the interpreter."""
    calls = _count_kernel_calls(monkeypatch)
    q, k, v, _, pad = (t.to(DEVICE) for t in make_inputs(2, 4, 2, 9, 9, 8, pad_keys=3))
    bias = DistanceBias(torch.tensor(alibi_slopes(4), device=DEVICE))
    layer = SlidingWindowAttention(SlidingWindowAttention.Options(window=4), CTX)
    out = layer.eval()(q, k, v, bias=bias, key_padding_mask=pad)
    assert calls == [4]
    want = sliding_window_attention(q, k, v, 4, bias=bias, key_padding_mask=pad)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    layer.train()(q, k, v)
    assert calls == [4, 4]

    dropping = SlidingWindowAttention(SlidingWindowAttention.Options(window=4, dropout=0.5), CTX)
    dropping.train()(q, k, v)
    assert calls == [4, 4]
    dropping.eval()(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert calls == [4, 4, 4] if CUDA else [4, 4]


def test_component_reference_path_without_interpreter_logs_once(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(runtime, "_announced", set())

    def boom(*args):
        raise AssertionError("the Triton kernel ran on CPU without the interpreter")

    monkeypatch.setattr(flash.FlashAttentionFunction, "apply", boom)
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
