"""Normalization layers."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from llmkit.components.norm.layernorm import LayerNorm
from llmkit.components.norm.rmsnorm import RMSNorm
from llmkit.contracts import BuildContext, ComponentOptions


def ctx(bias: bool = True, dim: int = 0) -> BuildContext:
    return BuildContext(
        d_model=16,
        n_heads=2,
        n_kv_heads=2,
        head_dim=8,
        max_seq_len=8,
        n_layers=1,
        bias=bias,
        dim=dim,
    )


def test_layernorm_matches_torch_and_bias_options():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16) * 3 + 1
    ln = LayerNorm(LayerNorm.Options(), ctx())
    assert torch.equal(ln.weight, torch.ones(16)) and torch.equal(ln.bias, torch.zeros(16))
    with torch.no_grad():
        ln.weight.uniform_()
        ln.bias.uniform_()
    ref = torch.nn.LayerNorm(16, eps=1e-5)
    ref.load_state_dict(ln.state_dict())
    torch.testing.assert_close(ln(x), ref(x))

    no_bias = LayerNorm(LayerNorm.Options(bias=False), ctx(bias=True))
    assert no_bias.bias is None
    assert [n for n, _ in no_bias.named_parameters()] == ["weight"]
    assert LayerNorm(LayerNorm.Options(), ctx(bias=False)).bias is None
    assert LayerNorm(LayerNorm.Options(bias=True), ctx(bias=False)).bias is not None
    y = no_bias(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)


def test_rmsnorm_unit_rms_and_formula():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16) * 4
    norm = RMSNorm(RMSNorm.Options(), ctx())
    assert torch.equal(norm.weight, torch.ones(16))
    assert [n for n, _ in norm.named_parameters()] == ["weight"]
    y = norm(x)
    torch.testing.assert_close(y.pow(2).mean(-1).sqrt(), torch.ones(2, 5), atol=1e-4, rtol=0)
    with torch.no_grad():
        norm.weight.uniform_()
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), want)


def test_rmsnorm_keeps_dtype_and_computes_in_fp32():
    x = torch.randn(3, 16) * 100
    norm = RMSNorm(RMSNorm.Options(), ctx())
    y = norm(x.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), norm(x.bfloat16().float()), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_gradients_match_autograd_in_float64(offset: float, dtype: torch.dtype):
    """The CPU path's analytic backward against autograd through the formula in float64,
    for the input and the gain (Gemma's 1 + w included), fp32 and bf16 activations."""
    torch.manual_seed(0)
    norm = RMSNorm(RMSNorm.Options(offset=offset, eps=1e-5), ctx())
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 1.5)
    x = (torch.randn(3, 4, 16) * 3).to(dtype).requires_grad_(True)
    g = torch.randn(3, 4, 16)
    y = norm(x)
    assert y.dtype == dtype
    (y.float() * g).sum().backward()
    x64 = x.detach().double().requires_grad_(True)
    w64 = norm.weight.detach().double().requires_grad_(True)
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * (w64 + offset)
    (want * g.double()).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = max(1.0, x64.grad.abs().max().item())
    torch.testing.assert_close(y.double(), want.detach(), atol=tol * 4, rtol=tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=tol * scale, rtol=tol)
    torch.testing.assert_close(norm.weight.grad.double(), w64.grad, atol=tol * 10, rtol=tol)
    # The gain alone (frozen input) and the input alone (frozen gain) have their gradients.
    norm.weight.grad = None
    norm(x.detach()).sum().backward()
    assert norm.weight.grad is not None
    norm.weight.requires_grad_(False)
    x.grad = None
    norm(x).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_features_follow_ctx_dim(cls):
    norm = cls(cls.Options(), ctx(dim=8))
    assert norm.weight.shape == (8,)
    assert norm(torch.randn(2, 8)).shape == (2, 8)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_options_schema(cls):
    assert issubclass(cls.Options, ComponentOptions)
    schema = cls.Options.model_json_schema()
    assert all(p.get("description") for p in schema["properties"].values())
    with pytest.raises(ValidationError):
        cls.Options(eps=0)
    with pytest.raises(ValidationError):
        cls.Options(unknown=1)
