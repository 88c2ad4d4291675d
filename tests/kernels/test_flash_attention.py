"""The fused flash-attention Triton kernel (llmkit.kernels.flash_attention) and the ``flash``
component, run in the Triton interpreter on CPU.

Interpreter: triton builds its language library interpreted or compiled once, when first
imported; tests/conftest.py imports it for the interpreter on machines without CUDA, and this
module's kernels are jitted per mode at launch. So the ``in_interpreter`` fixture only sets
``TRITON_INTERPRET=1`` for the test (the rest of the suite keeps the reference paths). Where
this process's triton is compiled (a GPU machine), those tests skip and
``test_in_interpreter_subprocess`` reruns this module in a child started with
``TRITON_INTERPRET=1``.

Accuracy criterion (as flash-attention's own tests): the reference is the textbook formula
in float64 on the same inputs; a plain-PyTorch implementation in the input dtype ("pt") sets
the error budget. For the output and for each of dq, dk, dv::

    max|kernel − ref| ≤ 2 · max|pt − ref| + floor,   floor = 5e-6 (fp32), 5e-4 (fp16),
                                                      4e-3 (bf16, CUDA only)

bf16 is checked only with CUDA: the interpreter's bf16 arithmetic is wrong in triton 3.9 (the
component takes the reference path for bf16 in the interpreter).
Shapes stay tiny (batch·heads ≤ 8, sequences ≤ 100): the interpreter is ~1000× slower than
PyTorch. Tiles are 16×16 in the interpreter, so lengths 17, 33, 37, 100 span several blocks
with ragged tails.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from llmkit.components.attention.flash import FlashAttention
from llmkit.components.position.alibi import alibi_slopes
from llmkit.contracts import BuildContext, DistanceBias, NoOptions
from llmkit.kernels import runtime
from llmkit.ops import sdpa_attention
from tests.kernels.common import CUDA, assert_within_budget, interpreter_ready

fa = pytest.importorskip("llmkit.kernels.flash_attention", reason="needs triton")

FLOOR = {torch.float32: 5e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}


pytestmark = pytest.mark.usefixtures("one_thread")


def math_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    dtype: torch.dtype,
    causal: bool = True,
    slopes: Tensor | None = None,
    pad: Tensor | None = None,
) -> Tensor:
    """Textbook attention computed in ``dtype`` from explicit positions (query i at key
    position Tk − Tq + i); kv heads repeated for GQA; rows with no key give 0."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    qpos = torch.arange(tk - tq, tk, device=q.device)[:, None]
    kpos = torch.arange(tk, device=q.device)[None, :]
    allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed & (kpos <= qpos)
    allowed = allowed[None, None].expand(b, hq, tq, tk)
    if pad is not None:
        allowed = allowed & pad[:, None, None, :]
    empty = ~allowed.any(-1, keepdim=True)
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    if slopes is not None:
        dist = (qpos - kpos).to(dtype)
        dist = dist.clamp(min=0) if causal else dist.abs()
        scores = scores - slopes.to(dtype)[None, :, None, None] * dist
    scores = scores.masked_fill(~(allowed | empty), float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)
    return probs @ v


def make_inputs(b, hq, hkv, tq, tk, d, *, dtype=torch.float32, seed=0, layout="bhtd"):
    """q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D); ``layout="bthd"`` returns transposed views of
    (B, T, H, D) buffers, as the model's projections produce them (non-contiguous strides)."""
    g = torch.Generator().manual_seed(seed)

    def rand(h, t):
        if layout == "bthd":
            return torch.randn(b, t, h, d, generator=g).to(dtype).transpose(1, 2)
        return torch.randn(b, h, t, d, generator=g).to(dtype)

    return rand(hq, tq), rand(hkv, tk), rand(hkv, tk)


def _grads(fn, q, k, v, dout, **kw):
    ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*ins, **kw)
    return (out, *torch.autograd.grad(out, ins, dout))


def check_against_reference(q, k, v, *, causal=True, slopes=None, pad=None, blocks=None):
    """Output and dq/dk/dv of the kernel within the documented budget of the fp64 reference."""
    dtype = q.dtype
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
    dout = dout.to(device=q.device, dtype=dtype)
    bias = DistanceBias(slopes) if slopes is not None else None
    got = _grads(
        fa.flash_attention,
        q,
        k,
        v,
        dout,
        causal=causal,
        bias=bias,
        key_padding_mask=pad,
        blocks=blocks,
    )
    kw = {"causal": causal, "slopes": slopes, "pad": pad}
    ref = _grads(math_attention, q, k, v, dout.double(), dtype=torch.float64, **kw)
    pt = _grads(math_attention, q, k, v, dout, dtype=dtype, **kw)
    assert_within_budget(("out", "dq", "dk", "dv"), got, pt, ref, FLOOR[dtype])
    return got


@pytest.fixture
def in_interpreter(monkeypatch):
    """Run this test's Triton kernels in the interpreter (CPU tensors take the kernel)."""
    if not interpreter_ready():
        pytest.skip("triton is compiled here: test_in_interpreter_subprocess runs this test")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_in_interpreter_subprocess():
    """Where this process's triton cannot interpret, rerun the module in a child that can."""
    if interpreter_ready():
        pytest.skip("the interpreter tests ran in this process")
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0 and " passed" in proc.stdout, tail


# --------------------------------------------------------------------------- accuracy

# (B, Hq, Hkv, Tq, Tk, D, causal, alibi, dtype): every case has B > 1 or Hq > 1; lengths are
# ragged against the 16-wide interpreter tiles.
CASES = [
    pytest.param(2, 2, 2, 33, 33, 32, True, False, torch.float32, id="b2h2-causal-33"),
    pytest.param(2, 4, 2, 17, 17, 32, False, False, torch.float32, id="gqa2-noncausal-17"),
    pytest.param(1, 4, 1, 100, 100, 32, True, True, torch.float32, id="gqa4-alibi-100"),
    pytest.param(1, 8, 1, 17, 17, 32, False, True, torch.float32, id="mqa8-noncausal-alibi"),
    pytest.param(2, 2, 1, 1, 1, 32, True, False, torch.float32, id="length1"),
    pytest.param(2, 4, 2, 1, 37, 32, True, True, torch.float32, id="decode-tq1-alibi"),
    pytest.param(1, 4, 2, 5, 37, 64, True, False, torch.float32, id="decode-tq5-d64"),
    pytest.param(1, 4, 2, 5, 37, 32, False, True, torch.float32, id="decode-tq5-noncausal"),
    pytest.param(2, 2, 1, 33, 33, 64, True, False, torch.float16, id="fp16-causal-d64"),
    pytest.param(1, 4, 2, 5, 37, 32, False, True, torch.float16, id="fp16-decode-noncausal"),
    pytest.param(1, 2, 1, 20, 20, 128, True, False, torch.float32, id="d128"),
    pytest.param(2, 2, 2, 9, 9, 24, True, False, torch.float32, id="d24-padded-to-32"),
]


@pytest.mark.parametrize(("b", "hq", "hkv", "tq", "tk", "d", "causal", "alibi", "dtype"), CASES)
def test_matches_reference(in_interpreter, b, hq, hkv, tq, tk, d, causal, alibi, dtype):
    q, k, v = make_inputs(b, hq, hkv, tq, tk, d, dtype=dtype, seed=tq + tk + d)
    slopes = torch.tensor(alibi_slopes(hq)) if alibi else None
    check_against_reference(q, k, v, causal=causal, slopes=slopes)


@pytest.mark.parametrize("causal", [True, False])
def test_key_padding_with_empty_rows(in_interpreter, causal):
    """Left padding (a batched KV cache): sample 1's first queries see no key → zeros."""
    b, hq, hkv, tq, tk, d = 2, 4, 2, 9, 23, 32
    q, k, v = make_inputs(b, hq, hkv, tq, tk, d, seed=11)
    pad = torch.ones(b, tk, dtype=torch.bool)
    pad[1, : tk - tq + 3] = False  # queries 0..2 of sample 1 have no visible key (causal)
    if not causal:
        pad[1] = False  # non-causal: every row of sample 1 is empty
    slopes = torch.tensor(alibi_slopes(hq))
    out, dq, dk, _dv = check_against_reference(q, k, v, causal=causal, slopes=slopes, pad=pad)
    rows = slice(0, 3) if causal else slice(None)
    assert torch.equal(out[1, :, rows], torch.zeros_like(out[1, :, rows]))
    assert torch.equal(dq[1, :, rows], torch.zeros_like(dq[1, :, rows]))
    assert torch.equal(dk[1, :, : tk - tq + 3], torch.zeros_like(dk[1, :, : tk - tq + 3]))


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)])
def test_unequal_tiles_and_strided_inputs(in_interpreter, blocks):
    """BLOCK_M ≠ BLOCK_N (as on a GPU) with the causal diagonal inside a tile, on
    (B, T, H, D)-strided views like the model's projections."""
    q, k, v = make_inputs(2, 2, 1, 50, 50, 32, seed=3, layout="bthd")
    assert not q.is_contiguous()
    check_against_reference(q, k, v, blocks=blocks)
    check_against_reference(q[:, :, -7:], k, v, slopes=torch.tensor([0.5, 0.25]), blocks=blocks)


def test_backward_is_deterministic(in_interpreter):
    """No atomics: rerunning backward gives bit-identical gradients (GQA sums included)."""
    q, k, v = make_inputs(2, 2, 1, 33, 33, 32, seed=5)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    first = _grads(fa.flash_attention, q, k, v, dout)
    second = _grads(fa.flash_attention, q, k, v, dout)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_no_quadratic_tensor(in_interpreter):
    """Forward and backward allocate O(B·H·T·D) tensors, never a T×T one."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    t, d = 96, 8
    q, k, v = make_inputs(1, 1, 1, t, t, d)
    ins = [x.requires_grad_(True) for x in (q, k, v)]
    with Largest() as probe:
        fa.flash_attention(*ins).sum().backward()
    # The interpreter views fp32 tensors as bytes: 4·T·D elements at most, far below T².
    assert probe.largest <= 4 * t * d <= t * t // 3


# --------------------------------------------------------------------------- dispatch


CTX = BuildContext(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=64, n_layers=1)


def test_component_runs_the_kernel_when_interpreting(in_interpreter, monkeypatch):
    calls = []
    real = fa.FlashAttentionFunction.apply
    monkeypatch.setattr(fa.FlashAttentionFunction, "apply", lambda *a: calls.append(1) or real(*a))
    kernel = FlashAttention(NoOptions(), CTX)
    q, k, v = make_inputs(2, 4, 2, 19, 19, 16)
    out = kernel(q, k, v)
    assert calls
    torch.testing.assert_close(out, sdpa_attention(q, k, v), atol=1e-5, rtol=1e-5)
    # The interpreter's bf16 is wrong: CPU bf16 takes the reference path instead.
    calls.clear()
    low = kernel(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert not calls and low.dtype == torch.bfloat16
    assert FlashAttention.runtime_backend() == runtime.describe_backend("attention.flash")
    assert "interpreter" in FlashAttention.runtime_backend()


def test_component_falls_back_to_reference_and_says_so(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(runtime, "_announced", set())

    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel must not run on CPU without the interpreter")

    monkeypatch.setattr(fa, "flash_attention", boom)
    kernel = FlashAttention(NoOptions(), CTX)
    q, k, v = make_inputs(2, 4, 2, 7, 11, 16)
    slopes = torch.tensor(alibi_slopes(4))
    with caplog.at_level(logging.INFO, logger="llmkit.kernels"):
        out = kernel(q, k, v, bias=DistanceBias(slopes))
        kernel(q, k, v)
    notes = [r for r in caplog.records if "attention.flash" in r.getMessage()]
    assert len(notes) == 1 and "reference path" in notes[0].getMessage()
    want = math_attention(q, k, v, dtype=torch.float64, slopes=slopes)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    assert "reference path" in FlashAttention.runtime_backend()


def test_tiny_model_with_flash_matches_sdpa(in_interpreter):
    """A GQA + ALiBi model: flash and sdpa give the same logits, loss and gradients."""
    from llmkit.model import build_model
    from llmkit.spec import load_spec_dict
    from tests.helpers import tiny_spec

    def model(name):
        spec = tiny_spec(
            attention={"name": name}, position={"name": "alibi"}, n_kv_heads=2, max_seq_len=20
        )
        torch.manual_seed(0)
        return build_model(load_spec_dict(spec))

    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(2))
    results = []
    for name in ("flash", "sdpa"):
        net = model(name)
        out = net(idx, idx)
        out.loss.backward()
        results.append((out.logits, {n: p.grad for n, p in net.named_parameters()}))
    (logits, grads), (want_logits, want_grads) = results
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_conformance_suite_in_interpreter(in_interpreter):
    """llmkit.testing's attention contract and a tiny ALiBi model decoding through the KV
    cache, with the kernel doing the work."""
    from llmkit.registry import get_registry
    from llmkit.testing import check_component, check_model_combination

    check_component(get_registry().get("attention", "flash"))
    check_model_combination("flash", "alibi", "mlp", "layernorm")


# --------------------------------------------------------------------------- launch configs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_block_configs(monkeypatch, dtype):
    """GPU tiles: powers of two ≥ 16 (tl.dot's minimum), shrinking as head rows grow."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for kernel in ("fwd", "dkdv", "dq"):
        prev = None
        for d in (16, 32, 64, 128, 256):
            cfg = fa.block_config(kernel, d, dtype)
            for size in (cfg.block_m, cfg.block_n):
                assert size >= 16 and size & (size - 1) == 0, (kernel, d, cfg)
            assert cfg.num_warps in (4, 8) and cfg.num_stages >= 1
            area = cfg.block_m * cfg.block_n
            assert prev is None or area <= prev, (kernel, d, cfg)
            prev = area
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fa.block_config("fwd", 64, dtype)[:2] == (16, 16)
    with pytest.raises(ValueError, match="unknown kernel"):
        fa.block_config("bwd", 64, dtype)


@pytest.mark.skipif(
    not CUDA or runtime.interpreting(), reason="bf16 and compiled kernels need a CUDA GPU"
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_matches_reference(dtype, causal):
    """Compiled kernels with the GPU tile sizes (several tiles, ragged tails, GQA, ALiBi,
    padding with empty rows) under the same error budget."""
    q, k, v = (t.cuda() for t in make_inputs(2, 8, 2, 300, 300, 128, dtype=dtype, seed=4))
    check_against_reference(q, k, v, causal=causal)
    q, k, v = (t.cuda() for t in make_inputs(2, 4, 1, 77, 333, 64, dtype=dtype, seed=5))
    pad = torch.ones(2, 333, dtype=torch.bool, device="cuda")
    pad[1, :270] = False
    slopes = torch.tensor(alibi_slopes(4), device="cuda")
    check_against_reference(q, k, v, causal=causal, slopes=slopes, pad=pad)
