"""The Triton kernels as PyTorch custom operators: what torch.compile relies on.

Each kernel (flash attention with and without a window, RMSNorm, SwiGLU) is registered as a
``llmkit::*`` custom operator with a fake implementation and an autograd formula.
:func:`torch.library.opcheck` checks the schema, the fake tensors against the real kernel,
the autograd registration and AOT dispatch; then a model with every Triton component is
compiled with ``fullgraph=True`` (no graph break) and must match the eager model's loss and
gradients.

Where the kernels run: with CUDA, the compiled kernels on CUDA tensors (and the compile
through Inductor); without, the Triton interpreter on tiny CPU shapes (and the ``aot_eager``
backend, which exercises the same tracing, fake tensors and autograd without generating
code).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.common import CUDA, interpreter_ready

fa = pytest.importorskip("llmkit.kernels.flash_attention", reason="needs triton")
from llmkit.kernels import rmsnorm, swiglu  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def device(monkeypatch) -> torch.device:
    """CUDA when present (compiled kernels), else the CPU under the Triton interpreter."""
    if CUDA:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return torch.device("cuda")
    if not interpreter_ready():
        pytest.skip("triton was imported in compiled mode without a GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch.device("cpu")


def _rand(*shape, device, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)


def _opcheck(op, args) -> None:
    result = torch.library.opcheck(op, args)
    failed = {name: r for name, r in result.items() if r != "SUCCESS"}
    assert not failed, failed


@pytest.mark.parametrize(
    ("causal", "window", "alibi", "pad"),
    [(True, 0, False, False), (False, 0, True, True), (True, 5, True, False)],
    ids=["causal", "noncausal-alibi-padding", "window"],
)
def test_flash_ops_pass_opcheck(device, causal, window, alibi, pad):
    b, hq, hkv, tq, tk, d = 2, 4, 2, 9, 21, 32
    q = _rand(b, hq, tq, d, device=device, seed=1, grad=True)
    k = _rand(b, hkv, tk, d, device=device, seed=2, grad=True)
    v = _rand(b, hkv, tk, d, device=device, seed=3, grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=device) if alibi else None
    kpm = None
    if pad:
        kpm = torch.ones(b, tk, dtype=torch.uint8, device=device)
        kpm[1, :4] = 0
    fwd_args = (q, k, v, slopes, kpm, causal, window, 0, 0)
    _opcheck(torch.ops.llmkit.flash_attention_fwd.default, fwd_args)
    o, lse = fa.flash_attention_fwd(*(t.detach() if torch.is_tensor(t) else t for t in fwd_args))
    do = _rand(b, hq, tq, d, device=device, seed=4)
    bwd_args = (do, q.detach(), k.detach(), v.detach(), o, lse, slopes, kpm, causal, window, 0, 0)
    _opcheck(torch.ops.llmkit.flash_attention_bwd.default, bwd_args)


def test_norm_and_ffn_ops_pass_opcheck(device):
    x = _rand(3, 5, 48, device=device, seed=1, grad=True)
    w = _rand(48, device=device, seed=2, grad=True)
    _opcheck(torch.ops.llmkit.rms_norm_fwd.default, (x, w, 1e-5))
    _, rstd = rmsnorm.rms_norm_fwd(x.detach(), w.detach(), 1e-5)
    dy = _rand(3, 5, 48, device=device, seed=3)
    _opcheck(torch.ops.llmkit.rms_norm_bwd.default, (dy, x.detach(), w.detach(), rstd))
    gate = _rand(4, 7, 40, device=device, seed=4, grad=True)
    up = _rand(4, 7, 40, device=device, seed=5, grad=True)
    _opcheck(torch.ops.llmkit.swiglu_fwd.default, (gate, up))
    dh = _rand(4, 7, 40, device=device, seed=6)
    _opcheck(torch.ops.llmkit.swiglu_bwd.default, (dh, gate.detach(), up.detach()))


def test_fake_outputs_match_the_kernels_on_strided_inputs(device):
    """(B, T, H, D) views, as the model's projections make them: the fake outputs have the
    real ones' shapes, dtypes and (contiguous) strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def views(seed):
        return _rand(2, 13, 4, 16, device=device, seed=seed).transpose(1, 2)

    q, k, v = views(1), views(2), views(3)
    real = fa.flash_attention_fwd(q, k, v, None, None, True, 0, 0, 0)
    real_bwd = fa.flash_attention_bwd(real[0], q, k, v, *real, None, None, True, 0, 0, 0)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = fa.flash_attention_fwd(fq, fk, fv, None, None, True, 0, 0, 0)
        fake_bwd = fa.flash_attention_bwd(fake[0], fq, fk, fv, *fake, None, None, True, 0, 0, 0)
    for r, f in zip((*real, *real_bwd), (*fake, *fake_bwd), strict=True):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def _model(attention: dict, device: torch.device):
    from llmkit.model import build_model
    from llmkit.spec import load_spec_dict
    from tests.helpers import tiny_spec

    spec = tiny_spec(
        attention=attention,
        norm={"name": "rmsnorm_triton"},
        ffn={"name": "swiglu_triton"},
        position={"name": "rope"},
        n_kv_heads=2,
        max_seq_len=24,
    )
    torch.manual_seed(0)
    return build_model(load_spec_dict(spec)).to(device)


@pytest.mark.parametrize(
    "attention",
    [{"name": "flash"}, {"name": "sliding_window", "window": 7}],
    ids=["flash", "sliding_window"],
)
def test_model_compiles_with_fullgraph_and_matches_eager(device, attention, monkeypatch):
    """Every Triton component in one model; ``fullgraph=True`` fails on any graph break."""
    calls: list[str] = []
    for module, name in (
        (fa, "flash_attention_fwd"),
        (rmsnorm, "rms_norm_fwd"),
        (swiglu, "swiglu_fwd"),
    ):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    torch._dynamo.reset()
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2)).to(device)
    results = []
    for compiled in (False, True):
        net = _model(attention, device)
        run = torch.compile(net, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
        out = (run if compiled else net)(idx, idx)
        out.loss.backward()
        grads = {n: p.grad for n, p in net.named_parameters()}
        results.append((out.loss.detach(), grads))
    assert set(calls) == {"flash_attention_fwd", "rms_norm_fwd", "swiglu_fwd"}, calls
    (loss, grads), (want_loss, want_grads) = results[1], results[0]
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_measured_tiles_file_replaces_the_table(tmp_path, monkeypatch):
    """LLMKIT_FLASH_TILES (flash_tune --tiles) replaces 16-bit tiles per kernel, head dim and
    windowing; fp32 and the other keys keep the table's."""
    import json

    table = fa.block_config("fwd", 64, torch.bfloat16)
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"fwd-D64-W0": [64, 32, 4, 5], "dq-D128-W1": [32, 32, 4, 2]}))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(fa.TILES_ENV, str(path))
    monkeypatch.setattr(fa, "_measured_tiles", None)
    assert fa.block_config("fwd", 64, torch.bfloat16) == fa.BlockConfig(64, 32, 4, 5)
    assert fa.block_config("fwd", 64, torch.bfloat16, windowed=True) != (64, 32, 4, 5)
    assert fa.block_config("dq", 128, torch.float16, windowed=True) == (32, 32, 4, 2)
    assert fa.block_config("fwd", 64, torch.float32) != (64, 32, 4, 5)
    monkeypatch.setattr(fa, "_measured_tiles", None)
    monkeypatch.delenv(fa.TILES_ENV)
    assert fa.block_config("fwd", 64, torch.bfloat16) == table
