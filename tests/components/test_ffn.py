"""Feed-forward blocks: sizes, activations, gating, bias handling."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from llmkit.components.ffn.geglu import GeGLU
from llmkit.components.ffn.mlp import MLP
from llmkit.components.ffn.swiglu import SwiGLU
from llmkit.contracts import BuildContext, ComponentOptions

FFNS = {"mlp": MLP, "swiglu": SwiGLU, "geglu": GeGLU}


def ctx(d: int = 16, bias: bool = True) -> BuildContext:
    return BuildContext(
        d_model=d, n_heads=2, n_kv_heads=2, head_dim=d // 2, max_seq_len=8, n_layers=1, bias=bias
    )


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_mlp_gpt2_parameter_count():
    mlp = MLP(MLP.Options(), ctx(768))
    assert n_params(mlp) == 768 * 3072 + 3072 + 3072 * 768 + 768
    assert mlp.in_proj.out_features == 3072


@pytest.mark.parametrize(
    "activation,ref",
    [
        ("gelu", lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))),
        (
            "gelu_tanh",
            lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
        ),
        ("relu", lambda x: x.clamp(min=0)),
        ("relu2", lambda x: x.clamp(min=0) ** 2),
        ("silu", lambda x: x / (1 + torch.exp(-x))),
    ],
)
def test_mlp_activations(activation, ref):
    torch.manual_seed(0)
    mlp = MLP(MLP.Options(activation=activation, hidden=24), ctx())
    x = torch.randn(2, 5, 16)
    want = mlp.out_proj(ref(mlp.in_proj(x)))
    out = mlp(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    # Gradients (relu2 has its own backward) against autograd through the reference.
    g = torch.randn_like(out)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    grads = [torch.autograd.grad((y * g).sum(), (xi, mlp.in_proj.weight)) for y, xi in (
        (mlp(xa), xa), (mlp.out_proj(ref(mlp.in_proj(xb))), xb))]  # fmt: skip
    for got, exp in zip(*grads):
        torch.testing.assert_close(got, exp, atol=1e-6, rtol=1e-5)


def test_mlp_hidden_size_options():
    assert MLP(MLP.Options(hidden=40), ctx()).in_proj.out_features == 40
    assert MLP(MLP.Options(multiplier=2.5), ctx()).in_proj.out_features == 40
    assert MLP(MLP.Options(multiplier=2.5, multiple_of=32), ctx()).in_proj.out_features == 64


def test_swiglu_default_and_rounding():
    # LLaMA: int(2/3 · 4d) rounded up to multiple_of.
    assert SwiGLU(SwiGLU.Options(), ctx(768)).gate_proj.out_features == 2048
    assert SwiGLU(SwiGLU.Options(), ctx(64)).gate_proj.out_features == 170
    swiglu = SwiGLU(SwiGLU.Options(multiple_of=32), ctx(64))
    assert swiglu.gate_proj.out_features == swiglu.up_proj.out_features == 192
    assert swiglu.out_proj.in_features == 192
    assert SwiGLU(SwiGLU.Options(hidden=100, multiple_of=32), ctx(64)).up_proj.out_features == 100


def test_swiglu_math():
    torch.manual_seed(0)
    m = SwiGLU(SwiGLU.Options(hidden=12), ctx())
    x = torch.randn(3, 4, 16)
    g = m.gate_proj(x)
    torch.testing.assert_close(m(x), m.out_proj(g * torch.sigmoid(g) * m.up_proj(x)))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_geglu_math(approximate):
    torch.manual_seed(0)
    m = GeGLU(GeGLU.Options(hidden=12, approximate=approximate), ctx())
    x = torch.randn(3, 4, 16)
    want = m.out_proj(F.gelu(m.gate_proj(x), approximate=approximate) * m.up_proj(x))
    torch.testing.assert_close(m(x), want)
    other = "tanh" if approximate == "none" else "none"
    wrong = m.out_proj(F.gelu(m.gate_proj(x), approximate=other) * m.up_proj(x))
    assert not torch.allclose(m(x), wrong, atol=1e-7, rtol=0)


@pytest.mark.parametrize("name", list(FFNS))
def test_bias_follows_context_unless_set(name):
    cls = FFNS[name]
    for ctx_bias, opt, want in [
        (True, None, True),
        (False, None, False),
        (False, True, True),
        (True, False, False),
    ]:
        m = cls(cls.Options(bias=opt), ctx(bias=ctx_bias))
        linears = [mod for mod in m.modules() if isinstance(mod, nn.Linear)]
        assert linears and all((lin.bias is not None) == want for lin in linears)


@pytest.mark.parametrize("name", list(FFNS))
def test_out_proj_and_gradients(name):
    cls = FFNS[name]
    m = cls(cls.Options(), ctx())
    assert isinstance(m.out_proj, nn.Linear) and m.out_proj.out_features == 16
    x = torch.randn(2, 3, 16, requires_grad=True)
    m(x).sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in m.parameters())
    assert not any(isinstance(mod, nn.Dropout) for mod in m.modules())


@pytest.mark.parametrize("name", list(FFNS))
def test_options_schema(name):
    opts = FFNS[name].Options
    assert issubclass(opts, ComponentOptions)
    schema = opts.model_json_schema()
    assert all(p.get("description") for p in schema["properties"].values())
    for bad in ({"unknown": 1}, {"multiplier": 0}, {"multiple_of": 0}, {"hidden": 0}):
        with pytest.raises(ValidationError):
            opts(**bad)


@pytest.mark.parametrize("name", list(FFNS))
@pytest.mark.parametrize("bias", [True, False])
def test_the_options_count_the_parameters_and_resolve_the_hidden_size(name, bias):
    """The contract facts of an ffn's options: ``parameter_count`` is the block's count and
    ``effective`` spells out the hidden size and the bias in place of what derives them."""
    cls = FFNS[name]
    options = cls.Options(multiplier=2.5, multiple_of=8)
    m = cls(options, ctx(bias=bias))
    assert options.parameter_count(16, bias) == sum(p.numel() for p in m.parameters())
    effective = options.effective(16, bias)
    assert effective["hidden"] == m.out_proj.in_features == 40
    assert effective["bias"] is bias
    assert "multiplier" not in effective and "multiple_of" not in effective
    assert effective == cls.Options(hidden=40, bias=bias).effective(16, not bias)
