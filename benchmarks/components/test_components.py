"""Forward+backward time of every registered attention, ffn and norm component, and the step
time of every registered optimizer.

Parametrized over the registry: a plugin's component joins without edits here.
Run ``pytest benchmarks`` (``LLMKIT_BENCH=full`` for the larger shapes).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.conftest import FULL, SPECS
from llmkit.contracts import BuildContext
from llmkit.model import build_model
from llmkit.registry import get_registry
from llmkit.spec import load_spec, load_spec_dict
from tests.helpers import tiny_spec

SEQ = [256, 1024, 4096] if FULL else [64]
HEAD_DIM = [64, 128] if FULL else [32]


def _records(kind):
    return [pytest.param(r, id=r.name) for r in get_registry().list(kind)]


def _ctx(d_model: int, heads: int, head_dim: int, seq: int) -> BuildContext:
    return BuildContext(
        d_model=d_model,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=head_dim,
        max_seq_len=seq,
        n_layers=1,
    )


@pytest.mark.parametrize("seq", SEQ)
@pytest.mark.parametrize("head_dim", HEAD_DIM)
@pytest.mark.parametrize("record", _records("attention"))
def test_attention_forward_backward(benchmark, record, seq, head_dim):
    heads = 4
    kernel = record.load()(record.options_model()(), _ctx(heads * head_dim, heads, head_dim, seq))
    q, k, v = (torch.randn(1, heads, seq, head_dim, requires_grad=True) for _ in range(3))
    flops = 4 * heads * seq * seq * head_dim * 0.5 * 3.5  # causal fwd + bwd (2.5× fwd)

    def step():
        out = kernel(q, k, v, causal=True)
        out.sum().backward()
        return out

    out = benchmark(step)
    assert out.shape == q.shape and torch.isfinite(out).all()
    if benchmark.stats:
        benchmark.extra_info["GFLOP/s"] = flops / benchmark.stats.stats.median / 1e9


@pytest.mark.parametrize("kind", ["ffn", "norm"])
def test_kind_has_components(kind):
    assert get_registry().list(kind)


@pytest.mark.parametrize("record", _records("ffn") + _records("norm"))
def test_ffn_and_norm_forward_backward(benchmark, record):
    d_model, tokens = (768, 4096) if FULL else (64, 128)
    ctx = _ctx(d_model, 4, d_model // 4, tokens)
    module = record.load()(record.options_model()(), ctx)
    x = torch.randn(1, tokens, d_model, requires_grad=True)

    def step():
        out = module(x)
        out.sum().backward()
        return out

    out = benchmark(step)
    assert out.shape == x.shape and torch.isfinite(out).all()


def _optimizer_cases():
    records = get_registry().list("optimizer")
    cases = [pytest.param(r, {}, id=r.name) for r in records]
    cases += [
        pytest.param(r, {"fused": False}, id="adamw-unfused") for r in records if r.name == "adamw"
    ]
    return cases


@pytest.mark.benchmark(group="optimizer-step")
@pytest.mark.parametrize(("record", "options"), _optimizer_cases())
def test_optimizer_step(benchmark, record, options):
    """One optimizer step over a model's parameters with fixed gradients: the baby GPT
    (10.7M parameters) in full mode, a tiny model in quick mode."""
    spec = load_spec(SPECS / "baby-gpt.toml") if FULL else load_spec_dict(tiny_spec())
    torch.manual_seed(0)
    model = build_model(spec)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt = record.load()(model, record.options_model()(**options))
    before = model.layers[0].ffn.in_proj.weight.detach().clone()
    benchmark(opt.step)
    assert not torch.equal(model.layers[0].ffn.in_proj.weight, before)
    benchmark.extra_info["parameters"] = sum(p.numel() for p in model.parameters())


#: (B, H, L, D): the baby GPT's attention (nanoGPT's shakespeare-char config) in full mode.
DROPOUT_SHAPE = (16, 6, 256, 64) if FULL else (2, 2, 64, 32)


@pytest.mark.benchmark(group="attention-dropout")
@pytest.mark.parametrize("path", ["sdpa-math-path", "llmkit-attention-dropout"])
def test_attention_dropout_forward_backward(benchmark, path):
    """Causal attention with dropout 0.2 on the probabilities, fwd+bwd: torch's SDPA (which
    leaves its fused kernel for the math path when dropout is on, on a CPU) against
    :mod:`llmkit.kernels.attention_dropout`, which the ``sdpa`` component runs there."""
    from llmkit.kernels.attention_dropout import dropout_attention

    q, k, v = (torch.randn(*DROPOUT_SHAPE, requires_grad=True) for _ in range(3))
    grad = torch.randn(*DROPOUT_SHAPE)

    def step():
        if path == "sdpa-math-path":
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=0.2, is_causal=True
            )
        else:
            out = dropout_attention(q, k, v, dropout_p=0.2)
        out.backward(grad)
        return out

    out = benchmark(step)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert (q.grad != 0).any()
