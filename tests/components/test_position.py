"""Positional schemes: RoPE, ALiBi, learned, sinusoidal, none."""

from __future__ import annotations

import importlib
import math
import tomllib
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor

from llmkit.components.position.alibi import ALiBi, alibi_slopes
from llmkit.components.position.learned import LearnedPosition
from llmkit.components.position.none import NoPosition
from llmkit.components.position.rope import RotaryPosition
from llmkit.components.position.sinusoidal import SinusoidalPosition
from llmkit.contracts import (
    POSITION_SITES,
    BuildContext,
    ComponentOptions,
    DistanceBias,
    PositionalScheme,
)

REGISTRY = Path(__file__).resolve().parents[2] / "llmkit" / "registry.toml"


def ctx(head_dim: int = 8, n_heads: int = 2, max_seq_len: int = 16, d: int = 16) -> BuildContext:
    return BuildContext(
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=head_dim,
        max_seq_len=max_seq_len,
        n_layers=1,
    )


def rope(head_dim: int = 8, max_seq_len: int = 16, **opts) -> RotaryPosition:
    return RotaryPosition(RotaryPosition.Options(**opts), ctx(head_dim, max_seq_len=max_seq_len))


def naive_rope(x: Tensor, positions: Tensor, rot_dim: int, base: float) -> Tensor:
    """Rotate-half RoPE from explicit float64 angles; ``positions`` may be fractional."""
    h = rot_dim // 2
    inv_freq = base ** (-torch.arange(h, dtype=torch.float64) * 2 / rot_dim)
    ang = positions.double()[:, None] * inv_freq[None]
    cos, sin = ang.cos(), ang.sin()
    xd = x.double()
    x1, x2 = xd[..., :h], xd[..., h:rot_dim]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, xd[..., rot_dim:]), dim=-1)


def close64(got: Tensor, want: Tensor) -> None:
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- RoPE


def test_rope_dot_product_depends_only_on_distance():
    torch.manual_seed(0)
    r = rope()
    q = torch.randn(1, 1, 1, 8).expand(1, 1, 6, 8)
    k = torch.randn(1, 1, 1, 8).expand(1, 1, 6, 8)
    for start in (0, 3, 10, 40):  # 40 is past the cache: computed on the fly
        positions = torch.arange(start, start + 6)
        qr, kr = r.rotate(q, k, positions)
        dots = qr[0, 0] @ kr[0, 0].T  # dots[i, j] = q at p_i · k at p_j
        if start == 0:
            base = dots
        torch.testing.assert_close(dots, base, atol=1e-5, rtol=0)
    # ... and it does depend on the distance.
    assert not torch.allclose(base[0, 0], base[0, 1])
    torch.testing.assert_close(base.diagonal(), torch.full((6,), float(q[0, 0, 0] @ k[0, 0, 0])))


def test_rope_matches_naive_rotate_half():
    torch.manual_seed(0)
    r = rope(theta=500.0)
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    positions = torch.tensor([0, 1, 7, 15, 30])  # the last one past max_seq_len
    qr, kr = r.rotate(q, k, positions)
    close64(qr, naive_rope(q, positions, 8, 500.0))
    close64(kr, naive_rope(k, positions, 8, 500.0))


def test_rope_batched_positions():
    torch.manual_seed(0)
    r = rope()
    q, k = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)
    positions = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    qr, kr = r.rotate(q, k, positions)
    for b in range(2):
        qb, kb = r.rotate(q[b : b + 1], k[b : b + 1], positions[b])
        torch.testing.assert_close(qr[b : b + 1], qb)
        torch.testing.assert_close(kr[b : b + 1], kb)


def test_rope_cos_sin_computed_once_per_positions_tensor():
    r = rope()
    positions = torch.arange(6)
    first = r.cos_sin(positions)
    again = r.cos_sin(positions)
    assert again[0] is first[0] and again[1] is first[1]  # the layers of one forward share it
    positions.add_(3)  # changed in place: recomputed
    moved = r.cos_sin(positions)
    fresh = rope().cos_sin(torch.arange(3, 9))
    torch.testing.assert_close(moved[0], fresh[0])
    torch.testing.assert_close(moved[1], fresh[1])
    with torch.inference_mode():  # no version counter: computed every time
        p = torch.arange(4)
        assert r.cos_sin(p)[0] is not r.cos_sin(p)[0]


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_gradients_match_the_naive_formula(fraction: float):
    """The analytic backward of rotate-half (the inverse rotation) against autograd through
    the float64 formula, for q and k of other head counts, and for (B, T) positions."""
    torch.manual_seed(0)
    r = rope(head_dim=8, rotary_fraction=fraction, theta=300.0)
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    flat = torch.tensor([0, 2, 7, 15, 21])  # the last one past max_seq_len
    batched = torch.stack((flat, flat + 3))
    for positions in (flat, batched):
        qg, kg = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        qr, kr = r.rotate(qg, kg, positions)
        ((qr * gq).sum() + (kr * gk).sum()).backward()
        q64, k64 = q.double().requires_grad_(True), k.double().requires_grad_(True)
        rows = [positions] * 2 if positions.dim() == 1 else list(positions)
        want_q = torch.stack([naive_rope(q64[b], rows[b], r.rot_dim, 300.0) for b in range(2)])
        want_k = torch.stack([naive_rope(k64[b], rows[b], r.rot_dim, 300.0) for b in range(2)])
        ((want_q * gq.double()).sum() + (want_k * gk.double()).sum()).backward()
        close64(qr, want_q.detach())
        close64(qg.grad, q64.grad)
        close64(kg.grad, k64.grad)
    # bf16 q/k: computed in fp32, returned (and differentiated) in bf16.
    qb = q.bfloat16().requires_grad_(True)
    out, _ = r.rotate(qb, k.bfloat16(), flat)
    (out.float() * gq).sum().backward()
    assert out.dtype == qb.grad.dtype == torch.bfloat16
    want = _grad_of(r, q, k, gq)
    torch.testing.assert_close(qb.grad.float(), want, atol=3e-2 * want.abs().max().item(), rtol=0)


def _grad_of(r: RotaryPosition, q: Tensor, k: Tensor, gq: Tensor) -> Tensor:
    qg = q.clone().requires_grad_(True)
    out, _ = r.rotate(qg, k, torch.tensor([0, 2, 7, 15, 21]))
    (out * gq).sum().backward()
    assert qg.grad is not None
    return qg.grad


def test_rope_partial_rotary_leaves_tail():
    torch.manual_seed(0)
    r = rope(head_dim=16, rotary_fraction=0.25)
    assert r.rot_dim == 4
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    positions = torch.arange(3, 8)
    qr, kr = r.rotate(q, k, positions)
    assert torch.equal(qr[..., 4:], q[..., 4:]) and torch.equal(kr[..., 4:], k[..., 4:])
    assert not torch.allclose(qr[..., :4], q[..., :4])
    close64(qr, naive_rope(q, positions, 4, 10000.0))


def test_rope_linear_scaling_is_position_interpolation():
    torch.manual_seed(0)
    factor = 4.0
    r = rope(scaling="linear", scaling_factor=factor)
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    positions = torch.tensor([0, 1, 5, 9, 15, 33])
    qr, kr = r.rotate(q, k, positions)
    close64(qr, naive_rope(q, positions / factor, 8, 10000.0))
    close64(kr, naive_rope(k, positions / factor, 8, 10000.0))
    # Integer positions that divide evenly equal plain RoPE at the smaller position.
    plain = rope()
    pq, pk = plain.rotate(q[:, :, :2], k[:, :, :2], torch.tensor([1, 2]))
    sq, sk = r.rotate(q[:, :, :2], k[:, :, :2], torch.tensor([4, 8]))
    torch.testing.assert_close(sq, pq)
    torch.testing.assert_close(sk, pk)


def test_rope_ntk_scaling_changes_base():
    factor, rot = 8.0, 8
    r = rope(scaling="ntk", scaling_factor=factor)
    assert math.isclose(r.base, 10000.0 * factor ** (rot / (rot - 2)))
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    positions = torch.arange(4)
    qr, _ = r.rotate(q, k, positions)
    close64(qr, naive_rope(q, positions, 8, r.base))
    # The highest frequency (dims 0 and rot/2) is unchanged: theta^0 = 1 either way.
    plain, _ = rope().rotate(q, k, positions)
    torch.testing.assert_close(qr[..., [0, 4]], plain[..., [0, 4]])


def test_rope_invalid_dimensions():
    with pytest.raises(ValueError, match=r"head_dim 6 .* rotary_fraction 0.5 .* rot_dim 3"):
        rope(head_dim=6, rotary_fraction=0.5)
    with pytest.raises(ValueError, match="rot_dim 0"):
        rope(head_dim=8, rotary_fraction=0.1)
    with pytest.raises(ValidationError):
        RotaryPosition.Options(rotary_fraction=0)
    with pytest.raises(ValidationError):
        RotaryPosition.Options(scaling="linear", scaling_factor=0.5)
    with pytest.raises(ValidationError, match="no effect"):
        RotaryPosition.Options(scaling_factor=2.0)


def test_rope_keeps_dtype_and_caches_nonpersistent():
    r = rope()
    q, k = torch.randn(1, 2, 3, 8).bfloat16(), torch.randn(1, 2, 3, 8).bfloat16()
    qr, kr = r.rotate(q, k, torch.arange(3))
    assert qr.dtype == kr.dtype == torch.bfloat16
    assert r.state_dict() == {}
    assert r.cos_cached.shape == (16, 4)


# --------------------------------------------------------------------------- ALiBi


def test_alibi_slopes_power_of_two():
    assert alibi_slopes(8) == [2.0**-i for i in range(1, 9)]
    assert alibi_slopes(1) == [2.0**-8]
    torch.testing.assert_close(
        torch.tensor(alibi_slopes(16)), torch.tensor([2.0 ** (-i / 2) for i in range(1, 17)])
    )


@pytest.mark.parametrize("n", [3, 5, 6, 12, 20, 24])
def test_alibi_slopes_other_counts(n):
    slopes = alibi_slopes(n)
    assert len(slopes) == n
    assert len(set(slopes)) == n
    assert all(0 < s < 1 for s in slopes)


def test_alibi_slopes_interpolation_rule():
    # 12 heads: the 8-head slopes, then the odd-indexed slopes of 16 heads.
    want = [2.0**-i for i in range(1, 9)] + [2.0 ** -(i + 0.5) for i in range(4)]
    torch.testing.assert_close(torch.tensor(alibi_slopes(12)), torch.tensor(want))


def test_alibi_score_bias():
    alibi = ALiBi(ALiBi.Options(), ctx(n_heads=8))
    bias = alibi.score_bias()
    assert isinstance(bias, DistanceBias)
    assert bias.slopes.shape == (8,) and bias.slopes.dtype == torch.float32
    assert alibi.state_dict() == {}
    dense = bias.dense(3, 5)
    assert dense.shape == (8, 3, 5)
    assert float(dense[0, 2, 0]) == -0.5 * 4  # query at position 4, key 0, slope 1/2
    x = torch.randn(1, 3, 16)
    assert torch.equal(alibi.embed(x, torch.arange(3)), x)


# --------------------------------------------------------------------------- absolute


def test_learned_position():
    learned = LearnedPosition(LearnedPosition.Options(), ctx(max_seq_len=10))
    assert learned.wpe.weight.shape == (10, 16)
    x = torch.randn(2, 4, 16)
    out = learned.embed(x, torch.arange(3, 7))
    torch.testing.assert_close(out, x + learned.wpe.weight[3:7])
    batched = learned.embed(x, torch.tensor([[0, 1, 2, 3], [6, 7, 8, 9]]))
    torch.testing.assert_close(batched[1], x[1] + learned.wpe.weight[6:10])
    with pytest.raises(ValueError, match="max_seq_len=10"):
        learned.embed(x, torch.arange(7, 11))


def test_sinusoidal_position():
    sin = SinusoidalPosition(SinusoidalPosition.Options(), ctx(max_seq_len=8, d=6))
    assert sin.state_dict() == {}
    x = torch.zeros(1, 3, 6)
    positions = torch.tensor([1, 7, 20])  # 20 is past the table
    out = sin.embed(x, positions)
    for row, p in enumerate(positions.tolist()):
        for i in range(3):
            angle = p / 10000 ** (2 * i / 6)
            assert math.isclose(float(out[0, row, 2 * i]), math.sin(angle), abs_tol=1e-5)
            assert math.isclose(float(out[0, row, 2 * i + 1]), math.cos(angle), abs_tol=1e-5)
    odd = SinusoidalPosition(SinusoidalPosition.Options(base=100.0), ctx(d=5))
    assert odd.embed(torch.zeros(1, 2, 5), torch.arange(2)).shape == (1, 2, 5)


def test_no_position_is_identity():
    none = NoPosition(NoPosition.Options(), ctx())
    x, q, k = torch.randn(1, 3, 16), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    positions = torch.arange(3)
    assert torch.equal(none.embed(x, positions), x)
    assert none.rotate(q, k, positions) == (q, k)
    assert none.score_bias() is None
    assert none.acts_on == frozenset()


# --------------------------------------------------------------------------- catalogue


def test_acts_on_matches_catalogue():
    entries = tomllib.loads(REGISTRY.read_text())["component"]
    positions = [e for e in entries if e["kind"] == "position"]
    assert {e["name"] for e in positions} >= {"learned", "sinusoidal", "rope", "alibi", "none"}
    for entry in positions:
        module, attr = entry["target"].split(":")
        cls = getattr(importlib.import_module(module), attr)
        assert issubclass(cls, PositionalScheme)
        assert issubclass(cls.Options, ComponentOptions)
        assert cls.acts_on == frozenset(entry["capabilities"]["acts_on"]), entry["name"]
        assert cls.acts_on <= set(POSITION_SITES)
        schema = cls.Options.model_json_schema()
        assert all(p.get("description") for p in schema.get("properties", {}).values())
