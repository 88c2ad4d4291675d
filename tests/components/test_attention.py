"""Attention kernels against a float64 naive reference, and sliding-window's O(L·W) claim."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from llmkit.components.attention.dense import DenseAttention
from llmkit.components.attention.sdpa import SDPAttention
from llmkit.components.attention.sliding_window import (
    SlidingWindowAttention,
    default_chunk,
    sliding_window_attention,
)
from llmkit.components.position.alibi import alibi_slopes
from llmkit.contracts import AttentionKernel, BuildContext, ComponentOptions, DistanceBias
from llmkit.kernels import block_local
from llmkit.ops import reference_attention, sdpa_attention

ATOL = 1e-5
CTX = BuildContext(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=64, n_layers=1)
KERNELS = {
    "dense": DenseAttention,
    "sdpa": SDPAttention,
    "sliding_window": SlidingWindowAttention,
}


def naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    slopes: Tensor | None = None,
    pad: Tensor | None = None,
    window: int | None = None,
) -> Tensor:
    """Textbook attention in float64 from explicit absolute positions; empty rows give 0."""
    q, k, v = q.double(), k.double(), v.double()
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    qpos = torch.arange(tk - tq, tk)[:, None]
    kpos = torch.arange(tk)[None, :]
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        allowed &= kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    allowed = allowed[None, None].expand(b, hq, tq, tk)
    if pad is not None:
        allowed = allowed & pad[:, None, None, :]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if slopes is not None:
        dist = (qpos - kpos).double()
        dist = dist.clamp(min=0) if causal else dist.abs()
        scores = scores - slopes.double()[None, :, None, None] * dist
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs @ v


def make_qkv(b: int, hq: int, hkv: int, tq: int, tk: int, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g)
    k = torch.randn(b, hkv, tk, d, generator=g)
    v = torch.randn(b, hkv, tk, d, generator=g)
    return q, k, v


def left_padding(b: int, tk: int, pads: list[int]) -> Tensor:
    mask = torch.ones(b, tk, dtype=torch.bool)
    for i, p in enumerate(pads):
        mask[i, :p] = False
    return mask


# --------------------------------------------------------------------------- dense / sdpa


@pytest.mark.parametrize("fn", [reference_attention, sdpa_attention], ids=["dense", "sdpa"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("tq,tk", [(7, 7), (3, 10), (1, 6)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_pad", [False, True])
def test_kernels_match_naive(fn, causal, groups, tq, tk, with_bias, with_pad):
    hkv = 2
    hq = hkv * groups
    q, k, v = make_qkv(2, hq, hkv, tq, tk)
    slopes = torch.tensor(alibi_slopes(hq)) if with_bias else None
    bias = DistanceBias(slopes) if with_bias else None
    # Sample 1 is left-padded so far that its first queries see no key at all.
    pad = left_padding(2, tk, [0, tk - tq + 1]) if with_pad else None
    out = fn(q, k, v, causal=causal, bias=bias, key_padding_mask=pad)
    ref = naive(q, k, v, causal=causal, slopes=slopes, pad=pad)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [1, 3, 16])
@pytest.mark.parametrize("tq,tk", [(1, 12), (5, 12), (9, 9)])
@pytest.mark.parametrize("with_pad", [False, True])
def test_reference_with_a_window_matches_naive(window, tq, tk, with_pad):
    q, k, v = make_qkv(2, 4, 2, tq, tk, seed=window)
    slopes = torch.tensor(alibi_slopes(4))
    pad = left_padding(2, tk, [0, tk - tq + 1]) if with_pad else None
    out = reference_attention(
        q, k, v, bias=DistanceBias(slopes), key_padding_mask=pad, window=window
    )
    ref = naive(q, k, v, slopes=slopes, pad=pad, window=window)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=0)
    # causal=False ignores the window (it is a causal notion), as the conformance suite expects
    torch.testing.assert_close(
        reference_attention(q, k, v, causal=False, window=window),
        reference_attention(q, k, v, causal=False),
    )
    with pytest.raises(ValueError, match="window"):
        reference_attention(q, k, v, window=0)


def test_dense_and_sdpa_agree():
    q, k, v = make_qkv(2, 4, 1, 9, 9, seed=3)
    for causal in (True, False):
        torch.testing.assert_close(
            reference_attention(q, k, v, causal=causal),
            sdpa_attention(q, k, v, causal=causal),
            atol=ATOL,
            rtol=0,
        )


def test_naive_reference_is_causal():
    # Guard the guard: the reference must not see the future.
    q, k, v = make_qkv(1, 2, 2, 6, 6)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 5.0
    v2[:, :, -1] -= 5.0
    a, b = naive(q, k, v), naive(q, k2, v2)
    torch.testing.assert_close(a[:, :, :-1], b[:, :, :-1])
    assert not torch.allclose(a[:, :, -1], b[:, :, -1])


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("groups", [1, 4])
def test_cache_alignment(name, groups):
    """The last m rows of full causal attention equal the last m queries over all keys."""
    t, m = 11, 3
    q, k, v = make_qkv(2, 2 * groups, 2, t, t, seed=1)
    slopes = torch.tensor(alibi_slopes(2 * groups))
    opts = {"window": 4} if name == "sliding_window" else {}
    kernel = KERNELS[name](KERNELS[name].Options(**opts), CTX).eval()
    for bias in (None, DistanceBias(slopes)):
        full = kernel(q, k, v, bias=bias)
        tail = kernel(q[:, :, -m:], k, v, bias=bias)
        torch.testing.assert_close(tail, full[:, :, -m:], atol=ATOL, rtol=0)
        step = kernel(q[:, :, -1:], k, v, bias=bias)
        torch.testing.assert_close(step, full[:, :, -1:], atol=ATOL, rtol=0)


def _sliding4(q: Tensor, k: Tensor, v: Tensor, **kw) -> Tensor:
    return sliding_window_attention(q, k, v, 4, **kw)


@pytest.mark.parametrize(
    "fn", [reference_attention, sdpa_attention, _sliding4], ids=["dense", "sdpa", "sliding_window"]
)
@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_fully_padded_rows_are_zero_without_nans(fn):
    q, k, v = make_qkv(2, 2, 2, 5, 5)
    for t in (q, k, v):
        t.requires_grad_(True)
    pad = left_padding(2, 5, [0, 3])
    # Anomaly mode fails on any NaN produced in backward, even one masked away later.
    with torch.autograd.detect_anomaly(check_nan=True):
        out = fn(q, k, v, key_padding_mask=pad)
        assert torch.equal(out[1, :, :3], torch.zeros_like(out[1, :, :3]))
        out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_shape_errors():
    q, k, v = make_qkv(1, 3, 2, 4, 4)
    with pytest.raises(ValueError, match="multiple"):
        reference_attention(q, k, v)
    q, k, v = make_qkv(1, 2, 2, 5, 4)
    with pytest.raises(ValueError, match="fewer keys"):
        sdpa_attention(q, k, v)


# --------------------------------------------------------------------------- sliding window


@pytest.mark.parametrize("window", [1, 3, 16, 40])
@pytest.mark.parametrize("t", [1, 5, 17, 33])
@pytest.mark.parametrize("chunk", [None, 4, 7])
def test_sliding_window_matches_reference(window, t, chunk):
    q, k, v = make_qkv(2, 4, 2, t, t, seed=window + t)
    out = sliding_window_attention(q, k, v, window, chunk=chunk)
    torch.testing.assert_close(out.double(), naive(q, k, v, window=window), atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [1, 3, 16, 64])
@pytest.mark.parametrize("tq,tk", [(1, 20), (5, 20), (9, 9), (13, 30)])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("chunk", [None, 4])
def test_sliding_window_cache_gqa_bias_padding(window, tq, tk, groups, chunk):
    hq = 2 * groups
    q, k, v = make_qkv(2, hq, 2, tq, tk, seed=tq * tk)
    slopes = torch.tensor(alibi_slopes(hq))
    pad = left_padding(2, tk, [0, tk - tq + 2])
    out = sliding_window_attention(
        q, k, v, window, bias=DistanceBias(slopes), key_padding_mask=pad, chunk=chunk
    )
    ref = naive(q, k, v, slopes=slopes, pad=pad, window=window)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=0)


def test_sliding_window_at_least_length_is_dense_causal():
    q, k, v = make_qkv(2, 4, 2, 19, 19)
    for window in (19, 1000):
        torch.testing.assert_close(
            sliding_window_attention(q, k, v, window, chunk=5),
            reference_attention(q, k, v),
            atol=ATOL,
            rtol=0,
        )


def _sliding_window_vs_naive(q, k, v, window, pads, grad_seed, **kwargs):
    """(output, dq, dk, dv) of ``sliding_window_attention`` with ALiBi and left padding
    ``pads``, and the same from the float64 naive reference."""
    slopes = torch.tensor(alibi_slopes(q.shape[1]))
    pad = left_padding(q.shape[0], k.shape[2], pads)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(grad_seed))
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = sliding_window_attention(
        *ins, window, bias=DistanceBias(slopes), key_padding_mask=pad, **kwargs
    )
    grads = torch.autograd.grad(out, ins, grad_out)
    ref_ins = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = naive(*ref_ins, slopes=slopes, pad=pad, window=window)
    ref_grads = torch.autograd.grad(ref, ref_ins, grad_out.double())
    return (out, *grads), (ref, *ref_grads)


def test_sliding_window_gradients_match_reference():
    q, k, v = make_qkv(2, 4, 2, 21, 21, seed=5)
    got, want = _sliding_window_vs_naive(q, k, v, 6, [0, 4], grad_seed=9, chunk=4)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=0)


def _grads_vs_reference(
    q, k, v, window, *, slopes=None, pad=None, chunk=None, seed=0, grad=None, atol=2e-5
):
    """Output and dq, dk, dv of the block-local path against float64 autograd through the
    naive reference (the output gradient ``grad``, else random from ``seed``); returns the
    output and the gradients."""
    out_shape = (*q.shape[:-1], v.shape[-1])
    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out_shape, generator=gen) if grad is None else grad
    ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    bias = None if slopes is None else DistanceBias(slopes)
    out = sliding_window_attention(*ins, window, bias=bias, key_padding_mask=pad, chunk=chunk)
    grads = torch.autograd.grad(out, ins, grad_out)
    ref_ins = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = naive(*ref_ins, slopes=slopes, pad=pad, window=window)
    ref_grads = torch.autograd.grad(ref, ref_ins, grad_out.double())
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert got.shape == want.shape and got.dtype == q.dtype, name
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=0, msg=name)
    return out, grads


@pytest.mark.parametrize("step_scores", [1, 1 << 19], ids=["one-chunk-steps", "multi-chunk"])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize(
    "window,tq,tk,chunk",
    [
        (1, 12, 12, 4),
        (3, 17, 17, 4),
        (6, 21, 21, None),
        (5, 9, 30, 2),
        (4, 1, 13, None),
        (40, 19, 19, 5),
        (8, 23, 23, 3),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("with_pad", [False, True], ids=["", "padded"])
def test_sliding_window_gradients(
    monkeypatch, step_scores, groups, window, tq, tk, chunk, with_bias, with_pad
):
    """dq, dk, dv of the custom backward against float64 autograd: causal windows (1, longer
    than the sequence), GQA, ALiBi, left padding with empty rows, Tq < Tk and Tq = 1, chunks
    run one per step and several per step."""
    monkeypatch.setattr(block_local, "STEP_SCORES", step_scores)
    hq = 2 * groups
    q, k, v = make_qkv(2, hq, 2, tq, tk, seed=tq * tk + window)
    slopes = torch.tensor(alibi_slopes(hq)) if with_bias else None
    # Sample 1 loses its first keys: with Tq < Tk some of its queries see no key at all.
    pad = left_padding(2, tk, [0, tk - tq + 2]) if with_pad else None
    _grads_vs_reference(q, k, v, window, slopes=slopes, pad=pad, chunk=chunk, seed=tq)


def test_sliding_window_gradients_dtypes_and_layouts():
    """Non-contiguous (B, T, H, D)-transposed inputs; float64 and bfloat16 inputs return
    their dtype (bfloat16 is computed in float32)."""
    b, t, hq, hkv, d = 2, 19, 4, 2, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, t, hq, d, generator=g).transpose(1, 2)
    k = torch.randn(b, t, hkv, d, generator=g).transpose(1, 2)
    v = torch.randn(b, t, hkv, d, generator=g).transpose(1, 2)
    assert not q.is_contiguous()
    _grads_vs_reference(q, k, v, 5, chunk=4)
    _grads_vs_reference(q.double(), k.double(), v.double(), 5, chunk=4)
    low = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
    out = sliding_window_attention(*low, 5)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in low)
    ref = naive(*(t.detach() for t in low), window=5)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)


def test_sliding_window_dropout_path_gradients():
    """The dropout path (plain autograd through the same steps): with p → 0 it matches the
    reference, gradients included, and padded rows give zeros, not NaN."""
    q, k, v = make_qkv(2, 4, 2, 9, 14, seed=2)
    got, want = _sliding_window_vs_naive(q, k, v, 4, [0, 7], grad_seed=1, dropout_p=1e-12, chunk=2)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=0)


def test_sliding_window_autograd_saves_only_linear_tensors():
    """Without dropout the graph keeps q, k, v and the output (O(L·D)), never the
    (L, C+W) probabilities per head that plain autograd through the chunks would save."""
    b, hq, hkv, length, d, window = 1, 4, 2, 512, 8, 128
    q, k, v = (t.requires_grad_(True) for t in make_qkv(b, hq, hkv, length, length, d=d))
    saved: list[int] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sliding_window_attention(q, k, v, window)
    linear = sum(t.numel() * t.element_size() for t in (q, k, v, out))
    assert sum(saved) <= linear, (saved, linear)
    chunk = default_chunk(window)
    banded = b * hq * length * (chunk + window) * 4  # fp32 probabilities, one per pair
    assert sum(saved) * 4 < banded
    out.sum().backward()  # and the graph still differentiates
    # Dropout keeps plain autograd: it does save the probabilities.
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sliding_window_attention(q, k, v, window, dropout_p=0.1)
    assert sum(saved) > banded / 2


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest(fn, *inputs: Tensor) -> int:
    ins = [t.clone().requires_grad_(True) for t in inputs]
    with _LargestTensor() as probe:
        fn(*ins).sum().backward()
    return probe.largest


def test_sliding_window_memory_is_linear_in_length():
    b, h, d, window = 1, 2, 4, 8
    length = 512
    q, k, v = make_qkv(b, h, h, length, length, d=d)
    quadratic = b * h * length * length
    # The probe catches a full L×L score matrix ...
    assert _largest(reference_attention, q, k, v) >= quadratic
    # ... and sliding-window attention never builds one: everything is O(L·(C+W)).
    c = default_chunk(window)
    banded = b * h * length * (c + window)
    largest = _largest(lambda q, k, v: sliding_window_attention(q, k, v, window), q, k, v)
    assert largest <= 2 * banded, (largest, banded)
    assert largest * 16 < quadratic
    # Doubling L at most doubles the largest intermediate (plus one chunk's scores: the
    # first chunk runs alone) instead of quadrupling it.
    q2, k2, v2 = make_qkv(b, h, h, 2 * length, 2 * length, d=d)
    largest2 = _largest(lambda q, k, v: sliding_window_attention(q, k, v, window), q2, k2, v2)
    assert largest2 <= 2 * largest + b * h * c * (c + window)


def test_sliding_window_module_contract():
    kernel = SlidingWindowAttention(SlidingWindowAttention.Options(window=5), CTX)
    assert isinstance(kernel, AttentionKernel)
    assert kernel.cache_window == 5
    q, k, v = make_qkv(1, 4, 2, 6, 6)
    with pytest.raises(ValueError, match="causal"):
        kernel(q, k, v, causal=False)
    with pytest.raises(ValidationError):
        SlidingWindowAttention.Options(window=0)
    assert DenseAttention(DenseAttention.Options(), CTX).cache_window is None


# --------------------------------------------------------------------------- modules


@pytest.mark.parametrize("name", list(KERNELS))
def test_dropout_only_in_training(name):
    cls = KERNELS[name]
    q, k, v = make_qkv(2, 4, 2, 8, 8)
    plain = cls(cls.Options(), CTX).eval()(q, k, v)
    kernel = cls(cls.Options(dropout=0.5), CTX)
    kernel.eval()
    torch.testing.assert_close(kernel(q, k, v), plain)
    kernel.train()
    torch.manual_seed(0)
    assert not torch.allclose(kernel(q, k, v), plain)


@pytest.mark.parametrize("name", list(KERNELS))
def test_options_schema(name):
    opts = KERNELS[name].Options
    assert issubclass(opts, ComponentOptions)
    schema = opts.model_json_schema()
    assert all(p.get("description") for p in schema["properties"].values())
    with pytest.raises(ValidationError):
        opts(unknown=1)
    with pytest.raises(ValidationError):
        opts(dropout=1.0)


def _sdpa_dtypes(monkeypatch) -> list[torch.dtype]:
    """The dtype of every sdpa_attention call the SDPA component makes from now on."""
    from llmkit.components.attention import sdpa as sdpa_module

    seen: list[torch.dtype] = []

    def spy(q, *args, **kwargs):
        seen.append(q.dtype)
        return sdpa_attention(q, *args, **kwargs)

    monkeypatch.setattr(sdpa_module, "sdpa_attention", spy)
    return seen


@pytest.mark.parametrize(
    ("tq", "tk", "d", "widened"),
    [(16, 16, 64, True), (256, 256, 32, True), (256, 256, 64, False), (1, 256, 64, False)],
    ids=["short", "narrow", "kept", "decoding-a-long-cache"],
)
def test_sdpa_widens_short_or_narrow_bf16_calls_on_a_cpu(monkeypatch, tq, tk, d, widened):
    seen = _sdpa_dtypes(monkeypatch)
    ctx = BuildContext(
        d_model=2 * d, n_heads=2, n_kv_heads=2, head_dim=d, max_seq_len=tk, n_layers=1
    )
    kernel = SDPAttention(SDPAttention.Options(), ctx).train()
    gen = torch.Generator().manual_seed(0)

    def leaf(t):
        return torch.randn(1, 2, t, d, generator=gen).bfloat16().requires_grad_()

    q, k, v = leaf(tq), leaf(tk), leaf(tk)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kernel(q, k, v)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and q.grad.dtype == torch.bfloat16
    assert seen == [torch.float32 if widened else torch.bfloat16]
    want = sdpa_attention(q.detach().float(), k.detach().float(), v.detach().float())
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    if widened:  # fp32 inside: only the final rounding differs
        torch.testing.assert_close(out, want.bfloat16(), atol=0, rtol=0)


def test_the_built_in_kernels_say_they_compute_the_reference_attention():
    """``full_causal``: a Hugging Face export treats them as one, by window and softcap."""
    from llmkit.components.attention.flash import FlashAttention

    kernels = (DenseAttention, SDPAttention, SlidingWindowAttention, FlashAttention)
    assert all(k.full_causal for k in kernels) and not AttentionKernel.full_causal
    for kernel in (DenseAttention, SDPAttention, SlidingWindowAttention):
        assert kernel.Options.training_only == {"dropout"}
