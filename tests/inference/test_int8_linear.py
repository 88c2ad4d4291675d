"""The int8 layers (:mod:`llmkit.inference.int8_linear`): per-channel values, fbgemm's
packing and state dict, and the two-digit product's precision."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmkit.inference.int8_linear import (
    PACKED_BYTES_PER_CHANNEL,
    DynamicInt8Linear,
    Int8DigitsLinear,
    Int8Linear,
    digits_available,
    dynamic_available,
)

needs_fbgemm = pytest.mark.skipif(not dynamic_available(), reason="no fbgemm int8 linear")
needs_digits = pytest.mark.skipif(not digits_available(), reason="no fbgemm int8 product")


def test_int8_linear_is_per_channel_symmetric():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    with torch.no_grad():
        lin.weight[0] *= 100  # one large row must not cost the others their precision
    q = Int8Linear.from_float(lin)
    assert q.weight.dtype == torch.int8 and q.scale.shape == (8,)
    assert int(q.weight.abs().max()) == 127
    err = (q.dequantized() - lin.weight).abs()
    assert bool((err <= q.scale[:, None] / 2 + 1e-7).all())  # round-to-nearest, per row
    x = torch.randn(3, 5, 16)
    exact = F.linear(x, q.dequantized(), lin.bias)
    torch.testing.assert_close(q(x), exact, atol=1e-5, rtol=1e-5)
    assert float(q.scale[1:].max()) < float(q.scale[0]) / 20  # small rows keep small steps
    assert q.weight_nbytes() == 16 * 8 + 8 * 4


def test_the_digits_run_wherever_fbgemm_does():
    """The digits tests below skip where ``digits_available()`` is False: it must not be
    False on an fbgemm build (a broken layer would fail its own probe and hide)."""
    if dynamic_available() and torch.backends.quantized.engine in ("x86", "fbgemm"):
        assert digits_available()


@needs_digits
def test_digits_are_exact_on_activations_they_can_hold():
    """Rows that are exactly (hi + lo/126) digit units (hi, lo integers within ±63, the
    largest element 63 units) give the exact product on the dequantized weight: each digit,
    its scale and the bias are checked to float rounding."""
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    ref, q = Int8Linear.from_float(lin), Int8DigitsLinear.from_float(lin)
    hi = torch.randint(-62, 63, (5, 96)).double()
    lo = torch.randint(-63, 64, (5, 96)).double()
    hi[:, 0], lo[:, 0] = 63, 0  # the row's largest magnitude: exactly 63 units
    unit = torch.tensor([1.0, 2.0**-10, 8.0, 2.0**-20, 256.0], dtype=torch.float64)[:, None]
    x = ((hi + lo / 126) * unit).float()
    assert torch.equal(x.abs().amax(1, keepdim=True).double(), 63 * unit)
    with torch.no_grad():
        exact = F.linear(x.double(), ref.dequantized().double(), lin.bias.double()).float()
        got = q(x)
    scale = (x.abs().amax(1, keepdim=True) * ref.dequantized().abs().sum(1)).clamp(min=1)
    assert float(((got - exact).abs() / scale).max()) < 1e-6


@needs_digits
@pytest.mark.parametrize("features", [(64, 48), (40, 24), (13, 5)])
def test_digits_linear_is_weight_only_grade(features):
    """Two 7-bit digits per activation row: each output within 8e-5 of its bound (row max ×
    the weight row's absolute sum; the digits' worst case is 1/(2·63·126) = 6.3e-5) of the
    exact product on the dequantized weight, where w8a8 is off by about 1e-2; rows of any
    magnitude keep that precision (one scale per row), zero rows give the bias, an empty
    batch gives an empty result."""
    torch.manual_seed(0)
    lin = nn.Linear(*features)
    ref, q = Int8Linear.from_float(lin), Int8DigitsLinear.from_float(lin)
    w, scale = q.int8_weight()
    assert torch.equal(w, ref.weight) and torch.allclose(scale, ref.scale)
    x = torch.randn(3, 4, features[0])
    x[0, 1] *= 1e4
    x[1, 2] *= 1e-4
    x[2, 3] = 0
    with torch.no_grad():
        exact = F.linear(x, ref.dequantized(), lin.bias)
        got = q(x)
        bound = (x.abs().amax(-1, keepdim=True) * ref.dequantized().abs().sum(1)) * 8e-5
    assert got.shape == exact.shape and got.dtype == torch.float32
    assert bool(((got - exact).abs() <= bound).all())
    torch.testing.assert_close(got[2, 3], lin.bias.detach())
    if dynamic_available():  # the w8a8 product of the same values is far coarser
        dyn = DynamicInt8Linear.from_float(lin)
        with torch.no_grad():
            assert (dyn(x[2]) - exact[2]).abs().max() > 20 * (got[2] - exact[2]).abs().max()
    assert q(x.bfloat16()).dtype == torch.bfloat16
    with torch.no_grad():
        assert q(torch.randn(0, features[0])).shape == (0, features[1])
    assert q.weight_nbytes() == features[1] * (features[0] + PACKED_BYTES_PER_CHANNEL)
    assert "two-digit" in repr(q)


@needs_fbgemm
@pytest.mark.parametrize("cls", [DynamicInt8Linear, pytest.param("digits", marks=needs_digits)])
def test_fbgemm_layers_keep_their_weights_in_the_state_dict(cls):
    """fbgemm's packed weight is opaque: the state dict holds Int8Linear's ``weight`` and
    ``scale`` (and ``bias``), loads back into the packing, and reports what is missing."""
    cls = Int8DigitsLinear if cls == "digits" else cls
    torch.manual_seed(0)
    a, b = cls.from_float(nn.Linear(64, 48)), cls.from_float(nn.Linear(64, 48))
    plain = Int8Linear.from_float(nn.Linear(64, 48))
    x = torch.randn(3, 64)
    state = a.state_dict()
    assert sorted(state) == ["bias", "scale", "weight"] and state["weight"].dtype == torch.int8
    with torch.no_grad():
        assert not torch.equal(a(x), b(x))
        b.load_state_dict(state)
        assert torch.equal(a(x), b(x))
        b.load_state_dict(plain.state_dict())  # the same keys as the plain layer's
        assert torch.equal(b.int8_weight()[0], plain.weight)
    with pytest.raises(RuntimeError, match=r'Missing key.*"scale"'):
        b.load_state_dict({"weight": state["weight"], "bias": state["bias"]})
    with pytest.raises(RuntimeError, match="size mismatch"):
        b.load_state_dict({**state, "scale": state["scale"][:3]})
    with pytest.raises(RuntimeError, match="loads int8 values"):
        b.load_state_dict({**state, "weight": state["weight"].float()})


@needs_fbgemm
def test_dynamic_linear_packs_the_same_int8_values_and_quantizes_activations():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    ref, dyn = Int8Linear.from_float(lin), DynamicInt8Linear.from_float(lin)
    w, scale = dyn.int8_weight()
    assert torch.equal(w, ref.weight) and torch.allclose(scale, ref.scale)
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        exact = F.linear(x, ref.dequantized(), lin.bias)
        got = dyn(x)
    assert got.shape == exact.shape and got.dtype == torch.float32
    # activations are quantized per tensor to 7 bits: close, not equal
    assert 0 < float((got - exact).abs().max()) < 0.02 * float(exact.abs().max())
    assert dyn.weight_nbytes() == 48 * (64 + PACKED_BYTES_PER_CHANNEL) + 48 * 4
