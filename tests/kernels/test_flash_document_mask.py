"""Packed documents in the flash Triton kernels (``document_ids``; varlen attention): forward,
dK/dV and dQ keep each query inside its document, skip the key blocks of other documents, and
a tiny model on the kernels gives each document of a packed row the logits it gets alone.

Where the kernels run is the ``kernel_device`` fixture (tests/kernels/conftest.py): compiled on
a CUDA GPU, else in the Triton interpreter on CPU tensors (16×16 tiles, tiny shapes).
Accuracy as in test_flash_attention.py: within 2·|pt − ref| + 5e-6 of the fp64 textbook
formula, "pt" the same formula in fp32.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from llmkit.contracts import DistanceBias
from llmkit.model import build_model, document_ids_from_bounds
from llmkit.ops import attention_mask
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec
from tests.kernels.common import assert_within_budget

fa = pytest.importorskip("llmkit.kernels.flash_attention", reason="needs triton")

pytestmark = pytest.mark.usefixtures("one_thread")

FLOOR = 5e-6
SLOPES = (0.5, 0.25, 0.125, 0.0625)


def textbook(q, k, v, *, dtype, causal=True, window=None, slopes=None, pad=None, ids=None):
    """softmax(q kᵀ/√d − slope·distance) v in ``dtype`` under ops.attention_mask (documents,
    window, padding, bottom-right causal); kv heads repeated; a row with no key gives 0."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    _, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    if slopes is not None:
        dist = torch.arange(tk - tq, tk)[:, None] - torch.arange(tk)[None, :]
        dist = (dist.clamp(min=0) if causal else dist.abs()).to(q.device, dtype)
        scores = scores - slopes.to(dtype)[None, :, None, None] * dist
    mask, empty = attention_mask(
        tq,
        tk,
        causal=causal,
        key_padding_mask=pad,
        device=q.device,
        window=window,
        document_ids=ids,
    )
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, -1)
    if empty is not None:
        probs = probs.masked_fill(empty, 0.0)
    return probs @ v


def _grads(fn, q, k, v, dout, **kw):
    ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*ins, **kw)
    return (out, *torch.autograd.grad(out, ins, dout))


def _inputs(b, hq, hkv, tq, tk, d, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g).to(device)
    k, v = (torch.randn(b, hkv, tk, d, generator=g).to(device) for _ in range(2))
    return q, k, v, torch.randn(b, hq, tq, d, generator=g).to(device)


CASES = {
    # name: (B, Hq, Hkv, Tq, Tk, each row's document lengths, keyword arguments)
    "causal": (2, 2, 2, 37, 37, ((5, 11, 21), (37,)), {}),
    "gqa": (2, 4, 2, 33, 33, ((16, 17), (1, 7, 1, 24)), {}),
    "mqa-noncausal": (1, 4, 1, 40, 40, ((3, 17, 1, 19),), {"causal": False}),
    "window-alibi": (1, 4, 2, 40, 40, ((3, 17, 20),), {"window": 7, "alibi": True}),
    "fewer-queries": (2, 2, 2, 9, 33, ((20, 13), (5, 28)), {}),
    "padding": (2, 2, 1, 33, 33, ((16, 17), (4, 29)), {"pad": True, "alibi": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_documents_match_the_textbook_formula(kernel_device, case):
    b, hq, hkv, tq, tk, lengths, kw = CASES[case]
    q, k, v, dout = _inputs(b, hq, hkv, tq, tk, 16, kernel_device)
    starts = [[sum(row[:i]) for i in range(len(row))] for row in lengths]
    ids = document_ids_from_bounds(starts, tk, device=kernel_device)
    causal, window = kw.get("causal", True), kw.get("window")
    slopes = torch.tensor(SLOPES[:hq], device=kernel_device) if kw.get("alibi") else None
    pad = None
    if kw.get("pad"):
        pad = torch.ones(b, tk, dtype=torch.bool, device=kernel_device)
        pad[-1, :3] = False
    got = _grads(
        fa.flash_attention,
        q,
        k,
        v,
        dout,
        causal=causal,
        window=window,
        bias=None if slopes is None else DistanceBias(slopes),
        key_padding_mask=pad,
        document_ids=ids,
    )
    same = {"causal": causal, "window": window, "slopes": slopes, "pad": pad, "ids": ids}
    ref = _grads(textbook, q, k, v, dout.double(), dtype=torch.float64, **same)
    pt = _grads(textbook, q, k, v, dout, dtype=torch.float32, **same)
    assert_within_budget(("out", "dq", "dk", "dv"), got, pt, ref, FLOOR)
    plain = fa.flash_attention(q, k, v, causal=causal, window=window, key_padding_mask=pad)
    assert (plain - got[0]).abs().max() > 1e-3  # the documents changed something


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's max over NaN rows
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("poisoned", [0, 1], ids=["first-poisoned", "second-poisoned"])
def test_blocks_of_other_documents_are_never_read(kernel_device, causal, poisoned):
    """Two documents of 32 tokens, 16×16 tiles: every tile lies in one document. NaN in one
    document's q, k, v and output gradient would reach the other's results through any tile
    of it a program visits (a product with NaN is NaN even where the mask zeroes P)."""
    q, k, v, dout = _inputs(1, 2, 1, 64, 64, 16, kernel_device)
    ids = document_ids_from_bounds([[32]], 64, device=kernel_device)
    bad, good = (slice(0, 32), slice(32, 64)) if poisoned == 0 else (slice(32, 64), slice(0, 32))
    for t in (q, k, v, dout):
        t[:, :, bad] = float("nan")
    kw = {"causal": causal, "blocks": (16, 16)}
    out, dq, dk, dv = _grads(fa.flash_attention, q, k, v, dout, document_ids=ids, **kw)
    part = (slice(None), slice(None), good)
    alone = _grads(fa.flash_attention, q[part], k[part], v[part], dout[part], **kw)
    for name, a, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), alone, strict=True):
        assert torch.isfinite(a[part]).all(), f"{name}: a tile of the other document was read"
        torch.testing.assert_close(a[part], want, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    "attention",
    [{"name": "flash"}, {"name": "sliding_window", "window": 8}],
    ids=["flash", "sliding_window"],
)
def test_a_model_on_the_kernels_gives_each_document_its_own_logits(kernel_device, attention):
    spec = tiny_spec(attention=attention, position={"name": "rope"}, n_kv_heads=2, vocab_size=50)
    torch.manual_seed(0)
    model = build_model(load_spec_dict(spec)).to(kernel_device).eval()
    lengths = (5, 11, 16)
    starts = [0, 5, 16]
    idx = torch.randint(0, 50, (1, 32), generator=torch.Generator().manual_seed(1))
    idx = idx.to(kernel_device)
    ids = document_ids_from_bounds([starts], 32, device=kernel_device)
    calls = []
    real = fa.flash_attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fa, "flash_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
        with torch.no_grad():
            packed = model(idx, document_ids=ids).logits
            alone = torch.cat(
                [model(idx[:, s : s + n]).logits for s, n in zip(starts, lengths, strict=True)],
                dim=1,
            )
    assert calls and calls[0]["document_ids"] is not None  # the kernel ran, with documents
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_the_operators_with_documents_pass_opcheck(kernel_device):
    q, k, v, dout = _inputs(2, 4, 2, 9, 21, 16, kernel_device)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    ids = document_ids_from_bounds([[4, 15], [9]], 21, device=kernel_device)
    docs = fa._document_spans(ids, 2, 21, kernel_device)
    args = (q, k, v, None, None, True, 0, 0, 0, docs)
    result = torch.library.opcheck(torch.ops.llmkit.flash_attention_fwd.default, args)
    assert all(r == "SUCCESS" for r in result.values()), result
    o, lse = fa.flash_attention_fwd(*(t.detach() if isinstance(t, Tensor) else t for t in args))
    bwd = (dout, q.detach(), k.detach(), v.detach(), o, lse, None, None, True, 0, 0, 0, docs)
    result = torch.library.opcheck(torch.ops.llmkit.flash_attention_bwd.default, bwd)
    assert all(r == "SUCCESS" for r in result.values()), result


def test_a_model_with_documents_compiles_with_fullgraph(kernel_device):
    """The custom operators take the document spans: no graph break, eager's loss and grads."""
    spec = tiny_spec(attention={"name": "flash"}, position={"name": "rope"}, max_seq_len=24)
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    idx = idx.to(kernel_device)
    ids = document_ids_from_bounds([[5, 11], [20]], 24, device=kernel_device)
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        net = build_model(load_spec_dict(spec)).to(kernel_device)
        backend = "inductor" if kernel_device.type == "cuda" else "aot_eager"
        run = torch.compile(net, fullgraph=True, backend=backend) if compiled else net
        loss = run(idx, idx, document_ids=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in net.named_parameters()}))
    (loss, grads), (want_loss, want_grads) = results[1], results[0]
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_document_spans():
    ids = torch.tensor([[0, 0, 1, 1, 1, 4], [2, 2, 2, 2, 2, 2]])
    spans = fa._document_spans(ids, 2, 6, torch.device("cpu"))
    assert spans.dtype == torch.int32 and spans.is_contiguous()
    assert spans[0].tolist() == [[0, 0, 2, 2, 2, 5], [2, 2, 5, 5, 5, 6]]
    assert spans[1].tolist() == [[0] * 6, [6] * 6]
    with pytest.raises(ValueError, match="document_ids must be"):
        fa._document_spans(ids[:, :5], 2, 6, torch.device("cpu"))


def test_in_interpreter_subprocess(rerun_in_interpreter):
    """Where this process can run the kernels neither compiled nor interpreted, rerun the
    module in a child that can interpret them."""
    rerun_in_interpreter(__file__)
