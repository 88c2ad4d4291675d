"""The CPU dropout of 16-bit masks: its rate, its scaling, its gradient, and where it is used."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from llmkit.dropout import Dropout, drop_rate, dropout, keep_mask, keep_masks


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_keep_mask_drops_p_of_the_elements_in_every_lane(p):
    torch.manual_seed(0)
    keep = keep_mask((1 << 20,), p)
    sigma = math.sqrt(p * (1 - p) / keep.numel())
    assert abs((1 - keep.float().mean().item()) - p) < 5 * sigma
    # Each int64 word gives four elements: every lane must drop p on its own.
    lanes = keep.view(-1, 4).float().mean(0)
    assert ((1 - lanes) - p).abs().max().item() < 5 * sigma * 2


def test_the_mask_follows_torchs_seed():
    torch.manual_seed(3)
    a = keep_mask((64, 64), 0.2)
    torch.manual_seed(3)
    assert torch.equal(a, keep_mask((64, 64), 0.2))
    assert not torch.equal(a, keep_mask((64, 64), 0.2))


def test_keep_masks_are_scaled_views_of_one_draw():
    torch.manual_seed(4)
    a, b = keep_masks([(3, 5), (7,)], 0.3, torch.float32)
    torch.manual_seed(4)
    whole = keep_mask((22,), 0.3)
    assert a.dtype == torch.float32 and a.shape == (3, 5) and b.shape == (7,)
    want = whole.float() / (1 - drop_rate(0.3))
    assert torch.equal(torch.cat([a.flatten(), b]), want)


def test_a_float_mask_is_the_bool_one():
    torch.manual_seed(6)
    as_bool = keep_mask((40, 30), 0.2)
    torch.manual_seed(6)
    as_bf16 = keep_mask((40, 30), 0.2, dtype=torch.bfloat16)
    assert torch.equal(as_bf16, as_bool.bfloat16())


def test_drop_rate_is_p_to_sixteen_bits():
    assert drop_rate(0.2) == 13107 / 65536
    assert drop_rate(0.5) == 0.5
    assert abs(drop_rate(0.3) - 0.3) < 2**-17


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_kept_values_are_scaled_and_the_gradient_uses_the_same_mask(dtype):
    torch.manual_seed(0)
    x = (torch.rand(64, 96) + 0.5).to(dtype).requires_grad_()
    torch.manual_seed(11)
    y = dropout(x, 0.2)
    torch.manual_seed(11)
    keep = keep_mask((64, 96), 0.2)
    assert y.dtype == dtype
    scale = 1 / (1 - drop_rate(0.2))
    torch.testing.assert_close(y, (x * scale).masked_fill(~keep, 0).detach())
    g = torch.randn(64, 96).to(dtype)
    y.backward(g)
    torch.testing.assert_close(x.grad, (g * scale).masked_fill(~keep, 0))


def test_the_mean_is_kept():
    torch.manual_seed(1)
    x = torch.ones(1 << 18)
    assert abs(dropout(x, 0.3).mean().item() - 1.0) < 0.01


def test_identity_in_eval_and_at_zero_and_zeros_at_one():
    x = torch.randn(8, 8)
    assert dropout(x, 0.5, training=False) is x
    assert dropout(x, 0.0) is x
    assert torch.count_nonzero(dropout(x, 1.0)) == 0


def test_the_module_is_a_torch_dropout_that_takes_the_fast_path(monkeypatch):
    m = Dropout(0.25)
    assert isinstance(m, nn.Dropout) and m.p == 0.25 and m.state_dict() == {}
    monkeypatch.setattr(nn.functional, "dropout", lambda *a, **k: pytest.fail("torch's path"))
    x = torch.randn(4, 16)
    assert m(x).shape == x.shape
    m.eval()
    assert m(x) is x


def test_models_use_it_for_residual_and_embedding_dropout():
    from llmkit.model import build_model
    from llmkit.spec import load_spec
    from tests.conftest import SPECS

    model = build_model(load_spec(SPECS / "baby-gpt.toml", ["model.n_layers=1"]))
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert drops and all(isinstance(m, Dropout) and m.p == 0.2 for m in drops)


def test_rates_out_of_range_are_refused_and_a_rate_rounding_to_one_zeroes():
    x = torch.randn(16)
    for p in (-0.1, 1.5):
        with pytest.raises(ValueError, match="between 0 and 1"):
            dropout(x, p)
    assert drop_rate(0.999995) == 1.0
    assert torch.count_nonzero(dropout(x, 0.999995)) == 0


def test_torch_compile_traces_torchs_dropout(monkeypatch):
    calls = []
    real = nn.functional.dropout
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(nn.functional, "dropout", lambda *a, **k: calls.append(1) or real(*a, **k))
    dropout(torch.randn(8), 0.5)
    assert calls == [1]


def test_only_the_mask_is_kept_for_the_backward():
    x = torch.randn(32, 32, requires_grad=True)
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = dropout(x, 0.3)
    scale = 1 / (1 - drop_rate(0.3))
    assert len(kept) == 1 and kept[0] is not x
    assert torch.isin(kept[0], torch.tensor([0.0, scale])).all()
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept[0])
