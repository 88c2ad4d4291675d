"""Each component computes what its paper says."""

from __future__ import annotations

import math

import pytest
import torch
from llmkit_extras.ademamix import AdEMAMix, alpha_at, beta3_at
from llmkit_extras.ademamix import Options as AdEMAMixOptions
from llmkit_extras.dyt import DynamicTanh, DyTOptions
from llmkit_extras.qk_norm import QKNorm, QKNormOptions
from llmkit_extras.rex import Options as RexOptions
from llmkit_extras.rex import build as build_rex
from llmkit_extras.rex import rex
from llmkit_extras.scalenorm import ScaleNorm, ScaleNormOptions

from llmkit import get_registry, reference_attention
from llmkit.testing import small_context


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster and steadier
    yield
    torch.set_num_threads(threads)


def _qkv(hq=4, hkv=2, t=10, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, hq, t, d, generator=g),
        torch.randn(2, hkv, t, d, generator=g),
        torch.randn(2, hkv, t, d, generator=g),
    )


def _rms(x):
    return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()


@pytest.mark.parametrize(
    "options",
    [{"gain": "vector"}, {"gain": "scalar"}, {"gain": "none"}, {"shared": True}],
    ids=["vector", "scalar", "none", "shared"],
)
def test_qk_norm_is_rms_norm_over_the_head_dim_times_the_gain(options):
    qk = QKNorm(QKNormOptions(**options), small_context())
    for p in qk.parameters():
        with torch.no_grad():
            p.uniform_(0.5, 2.0)
    gq = qk.gain if qk.options.shared else (qk.q_gain if qk.q_gain is not None else 1.0)
    gk = qk.gain if qk.options.shared else (qk.k_gain if qk.k_gain is not None else 1.0)
    q, k, _ = _qkv()
    with torch.no_grad():
        got_q, got_k = qk(q, k)
    torch.testing.assert_close(got_q, _rms(q) * gq)
    torch.testing.assert_close(got_k, _rms(k) * gk)
    shapes = {n: tuple(p.shape) for n, p in qk.named_parameters()}
    width = {"vector": 8, "scalar": 1}.get(options.get("gain", "vector"))
    if options.get("shared"):
        assert shapes == {"gain": (8,)}
    else:
        assert shapes == ({"q_gain": (width,), "k_gain": (width,)} if width else {})


def test_qk_norm_bounds_logits_whatever_the_scale_of_q_and_k():
    qk = QKNorm(QKNormOptions(), small_context())
    q, k, v = _qkv()
    with torch.no_grad():
        small = reference_attention(*qk(q, k), v)
        huge = reference_attention(*qk(q * 1e4, k * 1e4), v)
        plain = reference_attention(q * 1e4, k * 1e4, v)  # without QK-norm: one-hot rows
    assert torch.allclose(small, huge, atol=1e-5)
    assert (plain - small).abs().max() > 0.1


def test_qk_norm_before_rope_keeps_scores_relative_with_a_gain_per_dimension():
    """Normalized first, rotated after (how llmkit's attention module applies a q/k
    transform): shifting every position leaves the output unchanged, for every gain."""
    ctx = small_context(head_dim=8)
    rope_record = get_registry().get("position", "rope")  # built-ins come from the registry
    rope = rope_record.load()(rope_record.parse_options({}), ctx)
    q, k, v = _qkv()
    pos = torch.arange(10)
    for gain in ("vector", "scalar"):
        qk = QKNorm(QKNormOptions(gain=gain), ctx)
        with torch.no_grad():
            qk.q_gain.copy_(torch.linspace(0.5, 2.0, qk.q_gain.numel()))
            qk.k_gain.copy_(torch.linspace(2.0, 0.5, qk.k_gain.numel()))
            a = reference_attention(*rope.rotate(*qk(q, k), pos), v)
            b = reference_attention(*rope.rotate(*qk(q, k), pos + 17), v)
        assert torch.allclose(a, b, atol=1e-5), gain


def test_qk_norm_in_a_model_runs_before_rope_for_every_kernel():
    """The same weights give the same logits with sdpa, dense, flash and a sliding window
    wider than the sequence: the transform sits in the attention module, not in a kernel."""
    from llmkit import Registry, build_model, load_spec_dict

    reg = Registry()
    reg.load_entry_points(["extras"])  # llmkit's built-in plugin and this one

    def model(attention):
        spec = {
            "model": {
                "vocab_size": 64,
                "d_model": 32,
                "n_layers": 2,
                "n_heads": 4,
                "n_kv_heads": 2,
                "max_seq_len": 16,
                "position": {"name": "rope"},
                "attention": attention,
                "qk_transform": {"name": "qk_norm"},
            }
        }
        torch.manual_seed(0)
        return build_model(load_spec_dict(spec, registry=reg)).eval()

    ref = model({"name": "dense"})
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "qk_transform" in n:
                p.uniform_(0.5, 2.0)
    idx = torch.randint(0, 64, (2, 16))
    for attention in (
        {"name": "sdpa"},
        {"name": "flash"},
        {"name": "sliding_window", "window": 16},
    ):
        other = model(attention)
        other.load_state_dict(ref.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(other(idx).logits, ref(idx).logits, atol=2e-5, rtol=1e-4)


def test_dyt_is_weight_tanh_alpha_x_plus_bias():
    norm = DynamicTanh(DyTOptions(alpha_init=0.7, bias=True), small_context())
    with torch.no_grad():
        norm.weight.uniform_(-1, 1)
        norm.bias.uniform_(-1, 1)
    x = torch.randn(2, 5, 32)
    want = norm.weight * torch.tanh(0.7 * x) + norm.bias
    assert torch.allclose(norm(x), want, atol=1e-6)
    assert norm.alpha.shape == (1,) and norm.alpha.item() == pytest.approx(0.7)
    assert DynamicTanh(DyTOptions(), small_context(bias=False)).bias is None  # follows the model


def test_scalenorm_projects_onto_a_sphere_of_learned_radius():
    norm = ScaleNorm(ScaleNormOptions(), small_context())
    assert norm.scale.item() == pytest.approx(math.sqrt(32))
    x = torch.randn(2, 5, 32) * 7
    y = norm(x)
    assert torch.allclose(y.norm(dim=-1), torch.full((2, 5), math.sqrt(32)), atol=1e-4)
    assert torch.allclose(y / y.norm(dim=-1, keepdim=True), x / x.norm(dim=-1, keepdim=True))
    assert torch.isfinite(norm(torch.zeros(1, 1, 32))).all()  # eps guards the zero vector


def _train(make_opt, steps=5):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def test_ademamix_without_the_slow_ema_is_adamw():
    kw = {"lr": 1e-2, "eps": 1e-8, "weight_decay": 0.1}
    a = _train(lambda p: AdEMAMix(p, betas=(0.9, 0.999, 0.9999), alpha=0.0, **kw))
    b = _train(lambda p: torch.optim.AdamW(p, betas=(0.9, 0.999), **kw))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6)


def test_ademamix_step_matches_the_paper():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = AdEMAMix([p], lr=0.1, betas=(0.9, 0.99, 0.999), alpha=3.0, eps=1e-8, weight_decay=0.01)
    m1 = m2 = nu = torch.zeros(2)
    want = p.detach().clone()
    for t, g in enumerate((torch.tensor([0.5, 1.0]), torch.tensor([-1.0, 2.0])), start=1):
        p.grad = g.clone()
        opt.step()
        m1 = 0.9 * m1 + 0.1 * g
        m2 = 0.999 * m2 + 0.001 * g
        nu = 0.99 * nu + 0.01 * g * g
        m1_hat, nu_hat = m1 / (1 - 0.9**t), nu / (1 - 0.99**t)
        want = want - 0.1 * ((m1_hat + 3.0 * m2) / (nu_hat.sqrt() + 1e-8) + 0.01 * want)
        assert torch.allclose(p.detach(), want, atol=1e-6), t


def test_ademamix_warmup_schedulers():
    assert alpha_at(0, 8.0, 100) == 0.0 and alpha_at(50, 8.0, 100) == 4.0
    assert alpha_at(100, 8.0, 100) == alpha_at(7, 8.0, None) == 8.0
    assert beta3_at(0, 0.9, 0.9999, 100) == pytest.approx(0.9)
    assert beta3_at(100, 0.9, 0.9999, 100) == 0.9999
    # linear in half-life: half way, the half-life is the mean of the two half-lives
    half_life = lambda b: math.log(0.5) / math.log(b)  # noqa: E731
    mid = half_life(beta3_at(50, 0.9, 0.9999, 100))
    assert mid == pytest.approx((half_life(0.9) + half_life(0.9999)) / 2)
    values = [beta3_at(t, 0.9, 0.9999, 100) for t in range(101)]
    assert values == sorted(values)


def test_ademamix_options_refuse_a_warmup_without_beta1():
    with pytest.raises(ValueError, match="β1 > 0"):
        AdEMAMixOptions(betas=(0.0, 0.999, 0.9999), alpha_beta3_warmup=10)


def test_rex_curve():
    assert rex(0.0) == 1.0 and rex(1.0) == 0.0 and rex(0.5) == pytest.approx(2 / 3)
    f = build_rex(RexOptions(warmup_steps=10, min_lr_ratio=0.1), total_steps=110)
    assert f(0) == pytest.approx(0.1) and f(9) == 1.0 and f(10) == 1.0
    assert f(60) == pytest.approx(0.1 + 0.9 * 2 / 3)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
