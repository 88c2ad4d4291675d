"""Attention with dropout on the CPU: against float64 autograd with the same keep mask."""

from __future__ import annotations

import math

import pytest
import torch

from llmkit.components.attention.sdpa import SDPAttention, SDPAttentionOptions
from llmkit.components.position.alibi import alibi_slopes
from llmkit.contracts import BuildContext, DistanceBias
from llmkit.dropout import drop_rate, keep_masks
from llmkit.kernels import attention_dropout
from llmkit.kernels.attention_dropout import applies, dropout_attention, row_blocks
from llmkit.ops import attention_mask


def _reference(q, k, v, keep, p, *, causal, bias, pad):
    """softmax(q kᵀ/√d + bias, masked) ∘ keep/(1−p) · v by plain autograd, GQA expanded."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    tq, tk = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias.dense(tq, tk, causal=causal).to(s.dtype)[None]
    mask, empty = attention_mask(tq, tk, causal=causal, key_padding_mask=pad, device=q.device)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    out = (torch.softmax(s, -1) * keep / (1 - drop_rate(p))) @ v
    return out if empty is None else out.masked_fill(empty, 0.0)


CASES = {
    "causal": dict(tq=12, tk=12, hkv=4),
    "cached-keys": dict(tq=5, tk=12, hkv=4),
    "gqa": dict(tq=12, tk=12, hkv=2),
    "not-causal": dict(tq=12, tk=12, hkv=4, causal=False),
    "alibi": dict(tq=12, tk=12, hkv=4, alibi=True),
    "left-padding": dict(tq=12, tk=12, hkv=4, pad=True),
}


def _full_keep(b, h, tq, tk, p, causal):
    """The keep mask of a call drawn now, as one (B, H, Tq, Tk) tensor (False above the
    blocks, whose probabilities are zero anyway)."""
    blocks = row_blocks(tq, tk, causal)
    keep = torch.zeros(b, h, tq, tk, dtype=torch.bool)
    shapes = [(b * h, r1 - r0, keys) for r0, r1, keys in blocks]
    for (r0, r1, keys), m in zip(blocks, keep_masks(shapes, p, torch.float64), strict=True):
        keep[:, :, r0:r1, :keys] = m.view(b, h, r1 - r0, keys) != 0
    return keep


@pytest.mark.parametrize("block_rows", [4, 64], ids=["row-blocks", "one-block"])
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_autograd_with_the_same_mask(case, block_rows, monkeypatch):
    monkeypatch.setattr(attention_dropout, "BLOCK_ROWS", block_rows)
    c = {"causal": True, "alibi": False, "pad": False, **CASES[case]}
    b, hq, d, p = 2, 4, 8, 0.3
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    q, k, v = leaf(b, hq, c["tq"], d), leaf(b, c["hkv"], c["tk"], d), leaf(b, c["hkv"], c["tk"], d)
    slopes = torch.tensor(alibi_slopes(hq), dtype=torch.float64).requires_grad_()
    bias = DistanceBias(slopes) if c["alibi"] else None
    pad = None
    if c["pad"]:
        pad = torch.ones(b, c["tk"], dtype=torch.bool)
        pad[1, :4] = False  # sequence 1 starts with 4 padding keys: its first rows see nothing
    grad = torch.randn(b, hq, c["tq"], d, generator=gen, dtype=torch.float64)

    torch.manual_seed(7)
    out = dropout_attention(
        q, k, v, dropout_p=p, causal=c["causal"], bias=bias, key_padding_mask=pad
    )
    leaves = (q, k, v, slopes) if c["alibi"] else (q, k, v)
    got = torch.autograd.grad(out, leaves, grad)
    torch.manual_seed(7)
    keep = _full_keep(b, hq, c["tq"], c["tk"], p, c["causal"])
    assert 0 < keep.sum() < keep.numel()
    ref = _reference(q, k, v, keep, p, causal=c["causal"], bias=bias, pad=pad)
    want = torch.autograd.grad(ref, leaves, grad)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g_got, g_want in zip(got, want, strict=True):
        assert torch.isfinite(g_got).all()
        torch.testing.assert_close(g_got, g_want, rtol=1e-9, atol=1e-11)


def test_causal_row_blocks_cover_every_row_and_its_keys():
    assert row_blocks(256, 256, causal=False) == [(0, 256, 256)]
    assert row_blocks(100, 100, causal=True) == [(0, 100, 100)]
    blocks = row_blocks(256, 300, causal=True)
    assert [(r0, r1) for r0, r1, _ in blocks] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert [keys for *_, keys in blocks] == [108, 172, 236, 300]  # up to the block's last query
    assert len(row_blocks(4096, 4096, causal=True)) == 4


def test_sdpa_component_takes_it_in_training_on_the_cpu_only(monkeypatch):
    calls: list[torch.dtype] = []
    real = attention_dropout.dropout_attention

    def counting(q, *args, **kwargs):
        calls.append(q.dtype)
        return real(q, *args, **kwargs)

    monkeypatch.setattr(attention_dropout, "dropout_attention", counting)
    ctx = BuildContext(d_model=32, n_heads=4, n_kv_heads=4, head_dim=8, max_seq_len=16, n_layers=1)
    kernel = SDPAttention(SDPAttentionOptions(dropout=0.2), ctx)
    q = k = v = torch.randn(2, 4, 16, 8)
    kernel.train()
    out = kernel(q, k, v)
    assert calls == [torch.float32] and out.shape == q.shape
    assert kernel(q.bfloat16(), k.bfloat16(), v.bfloat16()).dtype == torch.bfloat16
    kernel.eval()
    kernel(q, k, v)  # no dropout: SDPA's fused path
    assert calls == [torch.float32, torch.bfloat16]
    assert applies(q, 0.2) and applies(q.half(), 0.2) and not applies(q, 0.0)
    assert not applies(q.to("meta"), 0.2)


def test_fp16_is_computed_in_fp32_even_under_autocast():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen) for _ in range(3))
    low = [t.half().requires_grad_() for t in (q, k, v)]
    full = [t.half().float().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(5)
    with torch.autocast("cpu", dtype=torch.float16):
        out = dropout_attention(*low, dropout_p=0.25)
    torch.manual_seed(5)
    ref = dropout_attention(*full, dropout_p=0.25)
    assert out.dtype == torch.float16
    # fp32 inside: the only difference is the final rounding to fp16.
    torch.testing.assert_close(out, ref.half(), rtol=0, atol=0)
    grad = torch.randn(ref.shape, generator=gen)
    out.backward(grad.half())
    ref.backward(grad.half().float())
    for a, b in zip(low, full, strict=True):
        assert a.grad.dtype == torch.float16
        torch.testing.assert_close(a.grad, b.grad.half(), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["causal", "alibi", "left-padding"])
def test_bf16_products_stay_within_bf16_rounding_of_float64(case, monkeypatch):
    """bf16 inputs run the products in bf16 and the rest in fp32: the output and every
    gradient within a few bf16 roundings of float64 autograd on the same values and mask."""
    monkeypatch.setattr(attention_dropout, "BLOCK_ROWS", 16)  # several row blocks
    c = {"causal": True, "alibi": False, "pad": False, **CASES[case]}
    b, hq, t, d, p = 2, 4, 64, 16, 0.2
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(b, hq, t, d, generator=gen).bfloat16() for _ in range(3))
    slopes = torch.tensor(alibi_slopes(hq)).requires_grad_()
    slopes64 = slopes.detach().double().requires_grad_()
    pad = None
    if c["pad"]:
        pad = torch.ones(b, t, dtype=torch.bool)
        pad[1, :4] = False
    grad = torch.randn(b, hq, t, d, generator=gen)
    low = [x.clone().requires_grad_() for x in (q, k, v)]
    wide = [x.double().requires_grad_() for x in (q, k, v)]
    torch.manual_seed(9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dropout_attention(
            *low,
            dropout_p=p,
            bias=DistanceBias(slopes) if c["alibi"] else None,
            key_padding_mask=pad,
        )
    assert out.dtype == torch.bfloat16
    out.backward(grad.bfloat16())
    torch.manual_seed(9)
    keep = _full_keep(b, hq, t, t, p, causal=True)
    bias64 = DistanceBias(slopes64) if c["alibi"] else None
    ref = _reference(*wide, keep, p, causal=True, bias=bias64, pad=pad)
    ref.backward(grad.bfloat16().double())
    got = [out, *(x.grad for x in low)] + ([slopes.grad] if c["alibi"] else [])
    want = [ref, *(x.grad for x in wide)] + ([slopes64.grad] if c["alibi"] else [])
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        err = (g.double() - w).abs().max() / w.abs().max()
        assert err < 2e-2, err


def test_what_the_backward_needs_goes_through_saved_tensor_hooks(monkeypatch):
    """Activation checkpointing and offloading see every saved tensor: q, k, v, the output,
    and P and P∘mask of each row block (nothing kept on the side)."""
    monkeypatch.setattr(attention_dropout, "BLOCK_ROWS", 4)
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    packed: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = dropout_attention(q, k, v, dropout_p=0.2)
    blocks = len(row_blocks(16, 16, causal=True))
    assert blocks == 4 and len(packed) == 4 + 2 * blocks
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("shape", [(0, 2, 4, 8), (1, 2, 0, 8)])
def test_empty_inputs_give_empty_outputs(shape):
    q = torch.randn(*shape, requires_grad=True)
    k = v = torch.randn(shape[0], 2, 4 if shape[2] == 0 else shape[2], 8, requires_grad=True)
    out = dropout_attention(q, k, v, dropout_p=0.2, causal=shape[2] != 0)
    assert out.shape == shape
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_a_rate_rounding_to_one_drops_everything():
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    out = dropout_attention(q, k, v, dropout_p=0.999995)
    assert torch.count_nonzero(out) == 0
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
