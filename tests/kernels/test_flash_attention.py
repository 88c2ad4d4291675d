"""The fused flash-attention Triton kernel (llmkit.kernels.flash_attention) and the ``flash``
component: compiled on CUDA tensors with a GPU, in the Triton interpreter on CPU without one.

Where the kernels run is the ``kernel_device`` fixture (tests/kernels/conftest.py). With a CUDA
GPU every test below runs the compiled kernels on CUDA tensors, at the GPU's own tile sizes
(64–128 rows for fp16/bf16), and adds bf16 and GPU-sized cases (lengths 300, 333, 1000, head
dims up to 256: several tiles with ragged tails). Without one it sets ``TRITON_INTERPRET=1``
for the test and runs the kernels in the interpreter on CPU tensors, on tiny shapes only
(batch·heads ≤ 8, sequences ≤ 100: the interpreter is ~1000× slower than PyTorch); its tiles
are 16×16, so lengths 17, 33, 37, 100 span several blocks with ragged tails. The bf16 and
GPU-sized cases skip there, saying why. ``test_in_interpreter_subprocess`` matters only where
this process's triton was imported compiled without a GPU: it reruns the module in a child
under ``TRITON_INTERPRET=1``; elsewhere it skips.

Accuracy criterion (as flash-attention's own tests): the reference is the textbook formula
in float64 on the same inputs (on the same device); a plain-PyTorch implementation in the
input dtype ("pt") sets the error budget. For the output and for each of dq, dk, dv::

    max|kernel − ref| ≤ 2 · max|pt − ref| + floor,   floor = 5e-6 (fp32), 5e-4 (fp16),
                                                      4e-3 (bf16, CUDA only)

bf16 is checked only on CUDA: the interpreter's bf16 arithmetic is wrong in triton 3.9, so
the component takes the reference path for CPU bf16 under the interpreter (checked on every
machine, without launching a kernel).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import Tensor

from llmkit.components.attention.flash import FlashAttention
from llmkit.components.position.alibi import alibi_slopes
from llmkit.contracts import BuildContext, DistanceBias, NoOptions
from llmkit.kernels import runtime
from llmkit.ops import sdpa_attention
from tests.kernels.common import assert_within_budget, case, dtype_id, spy

fa = pytest.importorskip("llmkit.kernels.flash_attention", reason="needs triton")

FLOOR = {torch.float32: 5e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}
FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16


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


def make_inputs(b, hq, hkv, tq, tk, d, *, dtype=torch.float32, seed=0, layout="bhtd", device="cpu"):
    """q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D), drawn on the CPU from a seeded generator and
    moved to ``device``; ``layout="bthd"`` returns transposed views of (B, T, H, D) buffers,
    as the model's projections produce them (non-contiguous strides)."""
    g = torch.Generator().manual_seed(seed)

    def rand(h, t):
        if layout == "bthd":
            return torch.randn(b, t, h, d, generator=g).to(device, dtype).transpose(1, 2)
        return torch.randn(b, h, t, d, generator=g).to(device, dtype)

    return rand(hq, tq), rand(hkv, tk), rand(hkv, tk)


def _grads(fn, q, k, v, dout, **kw):
    ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*ins, **kw)
    return (out, *torch.autograd.grad(out, ins, dout))


def check_against_reference(q, k, v, *, causal=True, slopes=None, pad=None, blocks=None):
    """Output and dq/dk/dv of the kernel within the documented budget of the fp64 reference
    (computed on q's device)."""
    dtype, device = q.dtype, q.device
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
    dout = dout.to(device=device, dtype=dtype)
    slopes = None if slopes is None else slopes.to(device)
    pad = None if pad is None else pad.to(device)
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


def test_in_interpreter_subprocess(rerun_in_interpreter):
    """Where this process can run the kernels neither compiled nor interpreted, rerun the
    module in a child that can interpret them."""
    rerun_in_interpreter(__file__)


# --------------------------------------------------------------------------- accuracy

# (B, Hq, Hkv, Tq, Tk, D, causal, alibi, dtype): every case has B > 1 or Hq > 1. Tiny cases
# run everywhere (lengths ragged against the 16-wide interpreter tiles; bf16 only on CUDA).
CASES = [
    case(2, 2, 2, 33, 33, 32, True, False, FP32, id="b2h2-causal-33"),
    case(2, 4, 2, 17, 17, 32, False, False, FP32, id="gqa2-noncausal-17"),
    case(1, 4, 1, 100, 100, 32, True, True, FP32, id="gqa4-alibi-100"),
    case(1, 8, 1, 17, 17, 32, False, True, FP32, id="mqa8-noncausal-alibi"),
    case(2, 2, 1, 1, 1, 32, True, False, FP32, id="length1"),
    case(2, 4, 2, 1, 37, 32, True, True, FP32, id="decode-tq1-alibi"),
    case(1, 4, 2, 5, 37, 64, True, False, FP32, id="decode-tq5-d64"),
    case(1, 4, 2, 5, 37, 32, False, True, FP32, id="decode-tq5-noncausal"),
    case(2, 2, 1, 33, 33, 64, True, False, FP16, id="fp16-causal-d64"),
    case(1, 4, 2, 5, 37, 32, False, True, FP16, id="fp16-decode-noncausal"),
    case(1, 2, 1, 20, 20, 128, True, False, FP32, id="d128"),
    case(2, 2, 2, 9, 9, 24, True, False, FP32, id="d24-padded-to-32"),
    case(2, 2, 1, 33, 33, 64, True, False, BF16, id="bf16-causal-d64"),
    case(1, 4, 2, 5, 37, 32, False, True, BF16, id="bf16-decode-noncausal"),
    case(1, 4, 1, 100, 100, 32, True, True, BF16, id="bf16-gqa4-alibi-100"),
    case(2, 2, 1, 1, 1, 32, True, False, BF16, id="bf16-length1"),
]
# GPU-sized (CUDA only): lengths spanning several 64–128-row GPU tiles with ragged tails, in
# fp32, fp16 and bf16.
GPU_SHAPES = {
    "b2h8-gqa4-300-d128": (2, 8, 2, 300, 300, 128, True, False),
    "b2h8-gqa4-300-d128-noncausal": (2, 8, 2, 300, 300, 128, False, False),
    "mqa4-alibi-77of333-d64": (2, 4, 1, 77, 333, 64, True, True),
    "alibi-1000-d64": (1, 4, 4, 1000, 1000, 64, True, True),
    "noncausal-alibi-333of1000-d96": (1, 4, 2, 333, 1000, 96, False, True),
    "decode-tq1-1000-d128": (2, 4, 2, 1, 1000, 128, True, False),
    "d256-300": (1, 2, 1, 300, 300, 256, True, False),
}
CASES += [
    case(*shape, dtype, id=f"gpu-{name}-{dtype_id(dtype)}", gpu_sized=True)
    for dtype in (FP32, FP16, BF16)
    for name, shape in GPU_SHAPES.items()
]


@pytest.mark.parametrize(("b", "hq", "hkv", "tq", "tk", "d", "causal", "alibi", "dtype"), CASES)
def test_matches_reference(kernel_device, b, hq, hkv, tq, tk, d, causal, alibi, dtype):
    q, k, v = make_inputs(
        b, hq, hkv, tq, tk, d, dtype=dtype, seed=tq + tk + d, device=kernel_device
    )
    slopes = torch.tensor(alibi_slopes(hq)) if alibi else None
    check_against_reference(q, k, v, causal=causal, slopes=slopes)


# (B, Hq, Hkv, Tq, Tk, D, empty rows of sample 1 when causal, dtype)
PAD_CASES = [
    case(2, 4, 2, 9, 23, 32, 3, FP32, id="tiny"),
    *(
        case(2, 4, 1, 77, 333, 64, 14, dtype, id=f"gpu-77of333-{dtype_id(dtype)}", gpu_sized=True)
        for dtype in (FP32, FP16, BF16)
    ),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("b", "hq", "hkv", "tq", "tk", "d", "empty", "dtype"), PAD_CASES)
def test_key_padding_with_empty_rows(kernel_device, b, hq, hkv, tq, tk, d, empty, dtype, causal):
    """Left padding (a batched KV cache): sample 1's first queries see no key → zeros."""
    q, k, v = make_inputs(b, hq, hkv, tq, tk, d, dtype=dtype, seed=11, device=kernel_device)
    pad = torch.ones(b, tk, dtype=torch.bool)
    pad[1, : tk - tq + empty] = False  # queries 0..empty-1 of sample 1 see no key (causal)
    if not causal:
        pad[1] = False  # non-causal: every row of sample 1 is empty
    slopes = torch.tensor(alibi_slopes(hq))
    out, dq, dk, _dv = check_against_reference(q, k, v, causal=causal, slopes=slopes, pad=pad)
    rows = slice(0, empty) if causal else slice(None)
    keys = slice(0, tk - tq + empty)
    assert torch.equal(out[1, :, rows], torch.zeros_like(out[1, :, rows]))
    assert torch.equal(dq[1, :, rows], torch.zeros_like(dq[1, :, rows]))
    assert torch.equal(dk[1, :, keys], torch.zeros_like(dk[1, :, keys]))


@pytest.mark.parametrize(
    ("blocks", "t", "dtype"),
    [
        case((32, 16), 50, FP32, id="32x16"),
        case((16, 32), 50, FP32, id="16x32"),
        case((128, 64), 333, BF16, id="gpu-128x64-bf16", gpu_sized=True),
        case((64, 128), 333, BF16, id="gpu-64x128-bf16", gpu_sized=True),
    ],
)
def test_unequal_tiles_and_strided_inputs(kernel_device, blocks, t, dtype):
    """BLOCK_M ≠ BLOCK_N (as on a GPU) with the causal diagonal inside a tile, on
    (B, T, H, D)-strided views like the model's projections."""
    q, k, v = make_inputs(
        2, 2, 1, t, t, 32, dtype=dtype, seed=3, layout="bthd", device=kernel_device
    )
    assert not q.is_contiguous()
    check_against_reference(q, k, v, blocks=blocks)
    check_against_reference(q[:, :, -7:], k, v, slopes=torch.tensor([0.5, 0.25]), blocks=blocks)


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "t", "d", "dtype"),
    [
        case(2, 2, 1, 33, 32, FP32, id="tiny"),
        case(2, 8, 2, 1000, 64, BF16, id="gpu-1000-bf16", gpu_sized=True),
    ],
)
def test_backward_is_deterministic(kernel_device, b, hq, hkv, t, d, dtype):
    """No atomics: rerunning backward gives bit-identical gradients (GQA sums included)."""
    q, k, v = make_inputs(b, hq, hkv, t, t, d, dtype=dtype, seed=5, device=kernel_device)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    dout = dout.to(kernel_device, dtype)
    first = _grads(fa.flash_attention, q, k, v, dout)
    second = _grads(fa.flash_attention, q, k, v, dout)
    for x, y in zip(first, second, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    ("t", "d"), [case(96, 8, id="tiny"), case(1000, 64, id="gpu-1000", gpu_sized=True)]
)
def test_no_quadratic_tensor(kernel_device, t, d):
    """Forward and backward allocate O(B·H·T·D) tensors, never a T×T one."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in tree_flatten(out)[0]:
                if isinstance(x, Tensor):
                    self.largest = max(self.largest, x.numel())
            return out

    q, k, v = make_inputs(1, 1, 1, t, t, d, device=kernel_device)
    ins = [x.requires_grad_(True) for x in (q, k, v)]
    with Largest() as probe:
        fa.flash_attention(*ins).sum().backward()
    # The interpreter views fp32 tensors as bytes: 4·T·D elements at most, far below T².
    assert probe.largest <= 4 * t * d <= t * t // 3


# --------------------------------------------------------------------------- dispatch


CTX = BuildContext(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=64, n_layers=1)


def test_component_runs_the_kernel(kernel_device, monkeypatch):
    """The component calls the kernel for fp32 on the kernel device; for bf16 too on CUDA,
    while in the interpreter bf16 takes the reference path."""
    calls = spy(monkeypatch, fa, "flash_attention")
    kernel = FlashAttention(NoOptions(), CTX)
    q, k, v = make_inputs(2, 4, 2, 19, 19, 16, device=kernel_device)
    out = kernel(q, k, v)
    assert len(calls) == 1
    torch.testing.assert_close(out, sdpa_attention(q, k, v), atol=1e-5, rtol=1e-5)
    calls.clear()
    low = kernel(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert len(calls) == (1 if kernel_device.type == "cuda" else 0)
    assert low.dtype == torch.bfloat16 and low.device == q.device
    assert FlashAttention.runtime_backend() == runtime.describe_backend("attention.flash")
    on_gpu = kernel_device.type == "cuda"
    assert (
        "Triton kernel on CUDA" if on_gpu else "interpreter"
    ) in FlashAttention.runtime_backend()


def test_interpreter_sends_cpu_bf16_to_the_reference(monkeypatch):
    """Under TRITON_INTERPRET=1, CPU bf16 takes the reference path (the interpreter's bf16
    is wrong): no kernel launches, so this runs on every machine."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = spy(monkeypatch, fa, "flash_attention")
    q, k, v = make_inputs(2, 4, 2, 7, 7, 16, dtype=torch.bfloat16)
    out = FlashAttention(NoOptions(), CTX)(q, k, v)
    assert not calls and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, sdpa_attention(q, k, v))


def test_component_falls_back_to_reference_and_says_so(monkeypatch, caplog):
    """CPU tensors without the interpreter take the reference path (on every machine)."""
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
    # No GPU: "PyTorch reference path …"; a GPU: "… (CPU tensors use the PyTorch reference path)"
    assert "reference path" in FlashAttention.runtime_backend()


def test_tiny_model_with_flash_matches_sdpa(kernel_device):
    """A GQA + ALiBi model: flash and sdpa give the same logits, loss and gradients."""
    from llmkit.model import build_model
    from llmkit.spec import load_spec_dict
    from tests.helpers import tiny_spec

    def model(name):
        spec = tiny_spec(
            attention={"name": name}, position={"name": "alibi"}, n_kv_heads=2, max_seq_len=20
        )
        torch.manual_seed(0)
        return build_model(load_spec_dict(spec)).to(kernel_device)

    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(2))
    idx = idx.to(kernel_device)
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


def test_conformance_suite(kernel_device):
    """llmkit.testing's attention contract and a tiny ALiBi model decoding through the KV
    cache, with the kernel doing the work on the kernel device."""
    from llmkit.registry import get_registry
    from llmkit.testing import check_component, check_model_combination

    check_component(get_registry().get("attention", "flash"), device=kernel_device)
    check_model_combination("flash", "alibi", "mlp", "layernorm", device=kernel_device)


# --------------------------------------------------------------------------- launch configs


@pytest.mark.parametrize("dtype", [FP16, BF16, FP32], ids=dtype_id)
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
