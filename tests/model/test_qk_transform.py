"""The ``qk_transform`` kind: q/k transforms run inside the attention module before rotary
positions and the kernel (QK-norm before RoPE), with every kernel and the KV cache."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from llmkit import hookimpl
from llmkit.contracts import AttentionInputs, ComponentOptions, QKTransform
from llmkit.model import build_model
from llmkit.registry import get_registry
from llmkit.spec import load_spec_dict
from llmkit.testing import check_component, check_model_combination
from llmkit.testing.qk_transform import check_qk_transform
from tests.helpers import registry_with, tiny_spec


class NormOptions(ComponentOptions):
    eps: float = Field(1e-6, gt=0)


class QKNorm(QKTransform):
    """RMSNorm of q and k over the head dimension with a learned gain per dimension."""

    Options = NormOptions

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.q_gain = nn.Parameter(torch.ones(ctx.head_dim))
        self.k_gain = nn.Parameter(torch.ones(ctx.head_dim))

    def forward(self, q, k):
        eps = self.options.eps
        return F.rms_norm(q, (q.shape[-1],), self.q_gain, eps), F.rms_norm(
            k, (k.shape[-1],), self.k_gain, eps
        )


class Centering(QKNorm):
    """Broken: subtracts the mean over positions (mixes tokens, so a cache cannot hold it)."""

    def forward(self, q, k):
        q, k = q * self.q_gain, k * self.k_gain
        return q - q.mean(2, keepdim=True), k - k.mean(2, keepdim=True)


class OneOutput(QKNorm):
    """Broken: returns only q."""

    def forward(self, q, k):
        return q


class Plugin:
    distribution = "llmkit-qk"
    name = "qk"

    @hookimpl
    def register_components(self, register):
        register("qk_transform", "qknorm", QKNorm, summary="RMSNorm of q and k")
        register("qk_transform", "centering", Centering, summary="broken")
        register("qk_transform", "one_output", OneOutput, summary="broken")


@pytest.fixture(scope="module")
def reg():
    return registry_with(Plugin())


def _model(reg, seed=0, **model):
    spec = tiny_spec(position={"name": "rope"}, n_kv_heads=2, **model)
    torch.manual_seed(seed)
    return build_model(load_spec_dict(spec, registry=reg)).eval()


def _random_gains(model):
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "qk_transform" in name:
                p.copy_(torch.rand(p.shape, generator=gen) * 2 + 0.2)


def test_the_kind_is_optional_and_per_layer():
    kind = get_registry().kinds["qk_transform"]
    assert (kind.section, kind.default, kind.per_layer) == ("model.qk_transform", None, True)
    model = build_model(load_spec_dict(tiny_spec()))
    assert all(a.qk_transform is None for a in model.attention_modules)
    assert not any("qk_transform" in k for k in model.state_dict())


def test_per_layer_choice_and_checkpoint_keys(reg):
    spec = tiny_spec(position={"name": "rope"})
    spec["model"]["overrides"] = [{"layers": [1], "qk_transform": {"name": "qknorm"}}]
    rs = load_spec_dict(spec, registry=reg)
    assert [plan.get("qk_transform") is None for plan in rs.layers] == [True, False]
    model = build_model(rs)
    assert model.layers[0].attn.qk_transform is None
    assert isinstance(model.layers[1].attn.qk_transform, QKNorm)
    assert [k for k in model.state_dict() if "qk_transform" in k] == [
        "layers.1.attn.qk_transform.q_gain",
        "layers.1.attn.qk_transform.k_gain",
    ]


# -- before RoPE ---------------------------------------------------------------------------------


def _rope(x, positions, theta=10000.0):
    """Rotate-half RoPE written out (Su et al. 2021), for (B, H, T, D)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = (positions.double()[:, None] * inv).float()
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def _rms(x, g, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def _by_hand(attn, x, positions, norm_first=True):
    """The attention module's output computed by hand: projections, QK-norm then RoPE (or
    the other order), causal softmax attention with grouped kv heads, output projection."""
    B, T, _ = x.shape
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = attn.qkv(x).split([H * D, Hkv * D, Hkv * D], -1)
    q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in (q, k, v))
    g = attn.qk_transform
    if norm_first:
        q, k = _rope(_rms(q, g.q_gain), positions), _rope(_rms(k, g.k_gain), positions)
    else:
        q, k = _rms(_rope(q, positions), g.q_gain), _rms(_rope(k, positions), g.k_gain)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = scores.softmax(-1) @ v
    return attn.out_proj(y.transpose(1, 2).reshape(B, T, H * D)), (q, k)


def test_qk_norm_runs_before_rope_as_a_hand_computation_says(reg):
    model = _model(reg, qk_transform={"name": "qknorm"})
    _random_gains(model)  # a gain per dimension does not commute with the rotation
    attn = model.attention_modules[0]
    x = torch.randn(2, 9, 32)
    positions = torch.arange(9)
    with torch.no_grad():
        got = attn(x, AttentionInputs(model.layer_position(0), positions))
        want, _ = _by_hand(attn, x, positions)
        other, _ = _by_hand(attn, x, positions, norm_first=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert (got - other).abs().max() > 1e-3  # the order matters, and ours is norm first


def test_keys_are_cached_after_the_transform_and_the_rotation(reg):
    model = _model(reg, qk_transform={"name": "qknorm"})
    _random_gains(model)
    x_ids = torch.randint(0, 64, (2, 6))
    cache = model.new_cache()
    with torch.no_grad():
        model(x_ids, cache=cache)
        block = model.layers[0]
        x = model.tok_emb(x_ids)
        _, (_, k) = _by_hand(block.attn, block.norm1(x), torch.arange(6))
    Hkv = model.config.kv_heads
    cached = cache.layers[0].keys()[0]
    torch.testing.assert_close(cached, k[:, :: k.shape[1] // Hkv], atol=1e-5, rtol=1e-4)


# -- every kernel ----------------------------------------------------------------------------

KERNELS = [
    {"name": "sdpa"},
    {"name": "dense"},
    {"name": "flash"},
    {"name": "sliding_window", "window": 32},
]


@pytest.mark.parametrize("attention", KERNELS, ids=lambda a: a["name"])
def test_every_kernel_gives_the_same_logits_with_the_transform(reg, attention):
    ref = _model(reg, qk_transform={"name": "qknorm"}, attention={"name": "dense"})
    _random_gains(ref)
    model = _model(reg, qk_transform={"name": "qknorm"}, attention=attention)
    model.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 64, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, ref(idx).logits, atol=2e-5, rtol=1e-4)
        plain = _model(reg, attention=attention)
        plain.load_state_dict(ref.state_dict(), strict=False)
        assert (plain(idx).logits - ref(idx).logits).abs().max() > 1e-3  # it acts


#: Every kernel with rotary q/k; windows smaller than the sequence with rotary and ALiBi.
DECODING = [(a, "rope") for a in KERNELS] + [
    ({"name": "sliding_window", "window": 3}, p) for p in ("rope", "alibi")
]


@pytest.mark.parametrize(
    ("attention", "position"),
    DECODING,
    ids=[f"{a['name']}{a.get('window', '')}-{p}" for a, p in DECODING],
)
def test_cached_decoding_equals_the_full_forward(reg, attention, position):
    check_model_combination(
        attention,
        position,
        "mlp",
        "rmsnorm",
        model={"qk_transform": {"name": "qknorm"}},
        registry=reg,
    )


# -- conformance -------------------------------------------------------------------------------


def test_a_conforming_transform_passes(reg):
    check_component(reg.get("qk_transform", "qknorm"), registry=reg)


@pytest.mark.parametrize(
    ("name", "error"),
    [("centering", "not position-wise"), ("one_output", "must return a \\(q, k\\) pair")],
)
def test_the_conformance_check_catches_broken_transforms(reg, name, error):
    with pytest.raises(AssertionError, match=error):
        check_qk_transform(reg.get("qk_transform", name))
