"""The mixture-of-experts ffn: the sorted-segment fast path against a plain masked loop over
experts (outputs, gradients, dropped tokens), routing variants, capacity, shared experts,
auxiliary losses and metrics, KV-cache decoding, per-layer use and parameter accounting."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from llmkit.components.ffn.moe import EXPERT_BLOCKS, MoE, MoEOptions
from llmkit.contracts import BuildContext
from llmkit.errors import SpecError
from llmkit.model import build_model
from llmkit.spec import load_spec, load_spec_dict
from llmkit.testing import check_model_combination, tiny_model_spec
from tests.conftest import SPECS

pytestmark = pytest.mark.usefixtures("one_thread")


def ctx(d: int = 16, bias: bool = True, n_layers: int = 2) -> BuildContext:
    return BuildContext(
        d_model=d, n_heads=2, n_kv_heads=2, head_dim=d // 2, max_seq_len=64, n_layers=n_layers,
        bias=bias,
    )  # fmt: skip


def make(d: int = 16, bias: bool = True, seed: int = 0, std: float = 0.3, **options) -> MoE:
    """An MoE with weights large enough that routing and outputs are far from trivial."""
    torch.manual_seed(seed)
    moe = MoE(MoEOptions(**options), ctx(d, bias))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, std)
    return moe


# -- the reference: a plain loop over experts, every expert on every token -------------------


def expert_call(moe: MoE, e: int, x: Tensor) -> Tensor:
    """Expert ``e`` computed by the existing ffn class (mlp/swiglu/geglu) holding views of
    the MoE's weights, so gradients reach the MoE's parameters."""
    o = moe.options.expert
    h, d = moe.hidden, moe.w_out.shape[1]
    block = EXPERT_BLOCKS[o.name](o.model_copy(update={"hidden": h}), ctx(d, moe.b_in is not None))
    w_in = moe.w_in[e]
    b_in = None if moe.b_in is None else moe.b_in.view(moe.num_experts, -1)[e]
    params = {"out_proj.weight": moe.w_out[e]}
    if moe.b_out is not None:
        params["out_proj.bias"] = moe.b_out.view(moe.num_experts, -1)[e]
    if o.name == "mlp":
        params["in_proj.weight"] = w_in
        if b_in is not None:
            params["in_proj.bias"] = b_in
    else:
        params["gate_proj.weight"], params["up_proj.weight"] = w_in[:h], w_in[h:]
        if b_in is not None:
            params["gate_proj.bias"], params["up_proj.bias"] = b_in[:h], b_in[h:]
    return functional_call(block, params, (x,))


def reference_keep(experts: Tensor, num_experts: int, capacity: int | None) -> Tensor:
    """(N, k) bool: which assignments survive capacity. First choices have priority over
    second choices, then earlier tokens over later ones (GShard)."""
    N, k = experts.shape
    keep = torch.ones(N, k, dtype=torch.bool)
    if capacity is None:
        return keep
    used = [0] * num_experts
    for r in range(k):
        for n in range(N):
            e = int(experts[n, r])
            if used[e] < capacity:
                used[e] += 1
            else:
                keep[n, r] = False
    return keep


def reference_moe(moe: MoE, x: Tensor) -> tuple[Tensor, Tensor]:
    """The block as a plain masked loop: every expert runs on every token and is weighted by
    its (kept) routing weight. Returns the output and the (N, k) keep mask."""
    o = moe.options
    flat = x.reshape(-1, x.shape[-1])
    logits = flat.float() @ moe.router.weight.float().t()
    if moe.router.bias is not None:
        logits = logits + moe.router.bias.float()
    if o.routing == "topk_softmax":
        top, experts = logits.topk(o.top_k, dim=-1)
        weights = top.softmax(-1)
    else:
        weights, experts = logits.softmax(-1).topk(o.top_k, dim=-1)
    keep = reference_keep(experts, o.num_experts, moe.capacity(flat.shape[0]))
    out = torch.zeros_like(flat)
    for e in range(o.num_experts):
        gate = (weights * ((experts == e) & keep)).sum(-1)
        out = out + gate.unsqueeze(-1).to(flat.dtype) * expert_call(moe, e, flat)
    if moe.shared is not None:
        out = out + moe.shared(flat)
    return out.view_as(x), keep


def grads(module: nn.Module, x: Tensor, fn, weights: Tensor) -> dict[str, Tensor]:
    module.zero_grad(set_to_none=True)
    xg = x.detach().clone().requires_grad_(True)
    out = fn(xg)
    (out * weights).sum().backward()
    got = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    got["input"] = xg.grad.clone()
    return got


CASES = [
    {"expert": {"name": "swiglu"}},
    {"expert": {"name": "mlp", "activation": "relu2"}, "routing": "softmax_topk"},
    {"expert": {"name": "geglu", "approximate": "tanh"}, "top_k": 1, "routing": "softmax_topk"},
    {"expert": "mlp", "top_k": 3, "shared_experts": 2},
    {"capacity_factor": 0.5},
    {"capacity_factor": 1.0, "top_k": 1, "routing": "softmax_topk", "expert": "mlp"},
    {"capacity_factor": 0.75, "shared_experts": 1, "expert": "geglu", "routing": "softmax_topk"},
]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("options", CASES, ids=[str(c) for c in CASES])
def test_fast_path_matches_the_reference_loop(options, bias):
    moe = make(bias=bias, num_experts=4, **{"top_k": 2, **options}).train()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 10, 16, generator=gen)
    weights = torch.randn(3, 10, 16, generator=gen)
    out = moe(x)
    ref, keep = reference_moe(moe, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if options.get("capacity_factor"):
        assert not keep.all(), "the case should drop something"
        n, k = keep.shape
        dropped = moe.pop_side_outputs()[1]["dropped_fraction"]
        assert float(dropped) * n * k == pytest.approx(int((~keep).sum()))
    fast = grads(moe, x, moe, weights)
    slow = grads(moe, x, lambda inp: reference_moe(moe, inp)[0], weights)
    assert fast.keys() == slow.keys()
    for name in fast:
        torch.testing.assert_close(fast[name], slow[name], atol=1e-5, rtol=1e-4, msg=name)


def test_routing_variants_differ_as_expected():
    soft_topk = make(num_experts=6, top_k=2, routing="softmax_topk")
    topk_soft = make(num_experts=6, top_k=2, routing="topk_softmax")
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(2))
    logits_a, experts_a, w_a = soft_topk.route(x)
    logits_b, experts_b, w_b = topk_soft.route(x)
    torch.testing.assert_close(logits_a, logits_b)
    assert torch.equal(experts_a, experts_b)  # the same experts are chosen...
    torch.testing.assert_close(w_b.sum(-1), torch.ones(20))  # ...renormalized over the top k
    assert bool((w_a.sum(-1) < 1 - 1e-3).all())  # ...or the full softmax's probabilities
    torch.testing.assert_close(w_a, logits_a.softmax(-1).gather(-1, experts_a))
    torch.testing.assert_close(w_b, w_a / w_a.sum(-1, keepdim=True))
    assert (soft_topk(x) - topk_soft(x)).abs().max() > 1e-3


def skewed(**options) -> MoE:
    """Every token's first choice is expert 0 and its second expert 1."""
    moe = make(num_experts=4, top_k=2, router_bias=True, bias=False, **options)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.bias.copy_(torch.tensor([4.0, 2.0, 0.0, 0.0]))
    return moe


def test_capacity_drops_the_overflow_and_keeps_the_earliest_tokens():
    moe = skewed(capacity_factor=0.5).train()  # capacity ceil(0.5 · 24 · 2 / 4) = 6
    assert moe.capacity(24) == 6
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(3))
    out = moe(x).view(24, 16)
    _, metrics = moe.pop_side_outputs()
    assert float(metrics["dropped_fraction"]) == pytest.approx((24 - 6) * 2 / 48)
    assert float(metrics["expert_load_max"]) == pytest.approx(0.5)  # f before dropping
    assert bool((out[:6].abs().sum(-1) > 0).all())
    assert torch.equal(out[6:], torch.zeros_like(out[6:]))  # both choices dropped
    torch.testing.assert_close(out.view(2, 12, 16), reference_moe(moe, x)[0])


def test_first_choices_have_priority_over_second_choices():
    # 8 tokens, E = 2, k = 2: each expert gets 8 assignments (first choices of some tokens,
    # second choices of the others); capacity 4 keeps first choices before second ones.
    moe = make(num_experts=2, top_k=2, capacity_factor=0.5, routing="softmax_topk").train()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(4))
    _, experts, _ = moe.route(x)
    keep = reference_keep(experts, 2, moe.capacity(8))
    firsts = [int((experts[:, 0] == e).sum()) for e in range(2)]
    for e in range(2):
        kept_first = int((keep[:, 0] & (experts[:, 0] == e)).sum())
        assert kept_first == min(firsts[e], 4)
    torch.testing.assert_close(moe(x), reference_moe(moe, x)[0])


def test_no_drop_mode_drops_nothing_even_when_skewed():
    moe = skewed().train()  # capacity_factor unset
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(5))
    out = moe(x)
    _, metrics = moe.pop_side_outputs()
    assert float(metrics["dropped_fraction"]) == 0.0
    assert bool((out.abs().sum(-1) > 0).all())
    assert moe.capacity(24) is None


def test_capacity_is_for_training_unless_an_eval_factor_is_set():
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(6))
    train_only = skewed(capacity_factor=0.5).eval()
    train_only(x)
    assert float(train_only.pop_side_outputs()[1]["dropped_fraction"]) == 0.0
    both = skewed(capacity_factor=0.5, eval_capacity_factor=0.5).eval()
    both(x)
    assert float(both.pop_side_outputs()[1]["dropped_fraction"]) == pytest.approx(0.75)


def test_shared_expert_is_applied_to_every_token():
    moe = make(num_experts=4, top_k=2, shared_experts=2, expert={"name": "mlp", "hidden": 12})
    assert isinstance(moe.shared, nn.Module) and moe.shared.in_proj.out_features == 24
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = moe(x)
        moe.w_out.zero_()
        moe.b_out.zero_()
        shared_only = moe(x)
    torch.testing.assert_close(shared_only, moe.shared(x))
    assert (full - shared_only).abs().max() > 1e-3
    sized = make(shared_experts=1, shared_hidden=40)
    assert sized.shared.gate_proj.out_features == 40


def test_aux_losses_match_hand_computed_values():
    # d = 2, E = 2, top-1, router = identity: logits are the inputs themselves.
    moe = MoE(
        MoEOptions(
            num_experts=2, top_k=1, routing="softmax_topk", expert="mlp",
            load_balance_coef=1.0, z_loss_coef=1.0,
        ),
        BuildContext(d_model=2, n_heads=1, n_kv_heads=1, head_dim=2, max_seq_len=4, n_layers=1),
    )  # fmt: skip
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(2))
    rows = [[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [3.0, 0.0]]
    moe(torch.tensor(rows))
    losses, metrics = moe.pop_side_outputs()
    losses = {k: v.detach() for k, v in losses.items()}
    f = [3 / 4, 1 / 4]  # tokens 0, 2, 3 to expert 0; token 1 to expert 1
    probs = [[math.exp(a) / (math.exp(a) + math.exp(b)), math.exp(b) / (math.exp(a) + math.exp(b))]
             for a, b in rows]  # fmt: skip
    P = [sum(p[i] for p in probs) / 4 for i in range(2)]
    assert float(losses["load_balance"]) == pytest.approx(2 * (f[0] * P[0] + f[1] * P[1]))
    z = sum(math.log(math.exp(a) + math.exp(b)) ** 2 for a, b in rows) / 4
    assert float(losses["z_loss"]) == pytest.approx(z)
    entropy = -sum(p * math.log(p) for row in probs for p in row) / 4
    assert float(metrics["router_entropy"]) == pytest.approx(entropy, rel=1e-5)
    assert float(metrics["expert_load_max"]) == pytest.approx(0.75)
    assert float(metrics["expert_load_min"]) == pytest.approx(0.25)
    assert float(metrics["expert_load_cv"]) == pytest.approx(0.5)  # std 0.25 / mean 0.5


def test_balanced_load_balance_loss_is_the_coefficient():
    moe = make(num_experts=4, top_k=2, load_balance_coef=0.01, std=0.0)  # uniform router
    moe(torch.randn(16, 16, generator=torch.Generator().manual_seed(8)))
    losses = {k: v.detach() for k, v in moe.pop_side_outputs()[0].items()}
    # Uniform probabilities P_i = 1/E: E · Σ f_i / E = Σ f_i = 1 whatever the ties do.
    assert float(losses["load_balance"]) == pytest.approx(0.01)
    assert float(losses["z_loss"]) == pytest.approx(0.001 * math.log(4) ** 2)


def test_losses_are_differentiable_and_metrics_detached():
    moe = make(num_experts=4, load_metrics="per_expert", load_balance_coef=0.1)
    moe(torch.randn(12, 16, generator=torch.Generator().manual_seed(9)))
    losses, metrics = moe.pop_side_outputs()
    assert set(losses) == {"load_balance", "z_loss"}
    expected = {"expert_load_max", "expert_load_min", "expert_load_cv", "dropped_fraction",
                "router_entropy", *(f"expert_load.{i}" for i in range(4))}  # fmt: skip
    assert set(metrics) == expected
    assert all(isinstance(v, Tensor) and not v.requires_grad for v in metrics.values())
    assert sum(float(metrics[f"expert_load.{i}"]) for i in range(4)) == pytest.approx(1.0)
    assert float(metrics["router_entropy"]) <= math.log(4) + 1e-6
    for name in ("load_balance", "z_loss"):  # each reaches the router on its own
        moe.zero_grad(set_to_none=True)
        losses[name].backward(retain_graph=True)
        assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    quiet = make(load_balance_coef=0.0, z_loss_coef=0.0)
    quiet(torch.randn(4, 16))
    assert quiet.pop_side_outputs()[0] == {}


def test_jitter_is_training_only():
    moe = make(num_experts=4, jitter=0.2)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(10))
    moe.eval()
    assert torch.equal(moe(x), moe(x))
    moe.train()
    torch.manual_seed(0)
    a = moe(x)
    b = moe(x)
    assert (a - b).abs().max() > 0
    calm = make(num_experts=4).train()
    assert torch.equal(calm(x), calm(x))


def test_eval_without_capacity_is_position_wise():
    moe = make(num_experts=4, top_k=2, capacity_factor=0.5).eval()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        y = moe(x)
        x2 = x.clone()
        x2[1, 3] += 1.0
        y2 = moe(x2)
        others = torch.ones(2, 8, dtype=torch.bool)
        others[1, 3] = False
        torch.testing.assert_close(y2[others], y[others], atol=1e-6, rtol=1e-5)
        singles = torch.cat([moe(x[:, t : t + 1]) for t in range(8)], dim=1)
        torch.testing.assert_close(singles, y, atol=1e-6, rtol=1e-5)
        # With capacity (training), one token's routing can drop another token.
        moe.train()
        x3 = x.clone()
        x3[:, :4] = x[:, :1]  # crowd one expert
        assert (moe(x3)[:, 4:] - moe(x)[:, 4:]).abs().max() > 0


def test_dispatch_runs_each_expert_once_on_its_tokens_only(monkeypatch):
    moe = make(num_experts=8, top_k=2)
    rows: list[int] = []
    original = MoE.expert_forward

    def counting(self, x, weights):
        rows.append(x.shape[0])
        return original(self, x, weights)

    monkeypatch.setattr(MoE, "expert_forward", counting)
    moe(torch.randn(4, 25, 16, generator=torch.Generator().manual_seed(12)))
    assert sum(rows) == 100 * 2  # tokens × k, not tokens × E
    assert len(rows) <= 8 and all(r > 0 for r in rows)


def test_expert_options_pass_through():
    relu2 = MoE(MoEOptions(expert={"name": "mlp", "activation": "relu2", "hidden": 20}), ctx())
    assert relu2.hidden == 20 and not relu2.gated and relu2.w_in.shape == (8, 20, 16)
    x = torch.linspace(-2, 2, 5)
    torch.testing.assert_close(relu2.act(x), F.relu(x).square())
    glu = MoE(MoEOptions(expert={"name": "swiglu", "multiplier": 2.0, "multiple_of": 8}), ctx())
    assert glu.hidden == 32 and glu.w_in.shape == (8, 64, 16)
    assert MoEOptions(expert="geglu").expert.name == "geglu"
    assert MoEOptions(expert={"hidden": 8}).expert.name == "swiglu"
    unbiased = MoE(MoEOptions(expert={"name": "mlp", "bias": False}), ctx(bias=True))
    assert unbiased.b_in is None and unbiased.b_out is None
    biased = MoE(MoEOptions(), ctx(bias=True))
    assert biased.b_in.ndim == 1 and biased.b_out.ndim == 1  # 1-D: no weight decay


def spec(**ffn) -> dict:
    return tiny_model_spec("sdpa", "rope", {"name": "moe", **ffn}, "rmsnorm")


def test_bad_options_are_refused_with_their_path():
    with pytest.raises(SpecError, match=r"model\.ffn.*top_k \(3\) must not exceed"):
        load_spec_dict(spec(num_experts=2, top_k=3))
    with pytest.raises(SpecError, match=r"model\.ffn\.expert"):
        load_spec_dict(spec(expert={"name": "mlp", "activaton": "relu"}))
    with pytest.raises(SpecError, match=r"model\.ffn\.expert"):
        load_spec_dict(spec(expert={"name": "attention"}))
    rs = load_spec_dict(spec(expert={"name": "mlp"}), ["model.ffn.expert.activation='silu'"])
    assert rs.layers[0].ffn.options.expert.activation == "silu"
    dumped = rs.layers[0].ffn.to_dict()  # what run directories store
    assert dumped["expert"]["name"] == "mlp"
    again = load_spec_dict(spec(**{k: v for k, v in dumped.items() if k != "name"}))
    assert again.layers[0].ffn.options == rs.layers[0].ffn.options


def test_kv_cache_decoding_with_moe_on_every_other_layer():
    model = check_model_combination(
        "sdpa",
        "rope",
        "swiglu",
        "rmsnorm",
        model={
            "n_layers": 4,
            "overrides": [
                {
                    "layers": "1::2",
                    "ffn": {"name": "moe", "num_experts": 4, "top_k": 2, "shared_experts": 1,
                            "capacity_factor": 1.0, "expert": {"name": "mlp", "hidden": 24}},
                }
            ],
        },
    )  # fmt: skip
    kinds = [type(block.ffn).__name__ for block in model.layers]
    assert kinds == ["SwiGLU", "MoE", "SwiGLU", "MoE"]
    out = model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    assert {"layers.1.ffn.load_balance", "layers.3.ffn.z_loss"} <= set(out.aux_losses)
    assert "layers.3.ffn.expert_load_cv" in out.metrics
    total = out.loss + sum(out.aux_losses.values())
    torch.testing.assert_close(out.total_loss, total)


def test_active_parameters_count_k_experts_router_and_shared():
    moe = MoE(MoEOptions(num_experts=8, top_k=2, shared_experts=1, expert="mlp"), ctx(bias=True))
    h = moe.hidden
    per_expert = 16 * h + h + h * 16 + 16
    router = 16 * 8
    shared = per_expert
    assert sum(p.numel() for p in moe.parameters()) == router + 8 * per_expert + shared
    assert moe.active_parameters() == router + 2 * per_expert + shared
    # Top-1 of 8 experts of the dense block's size: active = dense + the routers.
    rs = load_spec_dict(spec(num_experts=8, top_k=1, routing="softmax_topk"))
    model = build_model(rs)
    dense = build_model(load_spec_dict(tiny_model_spec("sdpa", "rope", "swiglu", "rmsnorm")))
    routers = 2 * 32 * 8
    assert model.active_params() == dense.active_params() + routers
    assert model.num_params() > model.active_params()
    flops = model.flops_per_token(16)["forward"] - dense.flops_per_token(16)["forward"]
    assert flops == 2 * routers


def test_mixtral_style_has_the_published_parameter_counts():
    rs = load_spec(SPECS / "mixtral-style.toml")
    with torch.device("meta"):
        model = build_model(rs)
    total, active = model.num_params(), model.active_params()
    # Mixtral-8x7B (Jiang et al. 2024): 46.7B parameters, 12.9B active per token.
    assert total == 46_702_792_704 and round(total / 1e9, 1) == 46.7
    assert active == 12_879_925_248 and round(active / 1e9, 1) == 12.9
    m = rs.model
    assert (m.d_model, m.n_layers, m.n_heads, m.kv_heads, m.vocab_size) == (4096, 32, 32, 8, 32000)
    assert m.max_seq_len == 32768 and not m.bias and not m.tie_embeddings
    assert rs.position.options.theta == 1e6 and rs.norm.options.eps == 1e-5
    ffn = rs.layers[0].ffn.options
    assert (ffn.num_experts, ffn.top_k, ffn.expert.name, ffn.expert.hidden) == (
        8,
        2,
        "swiglu",
        14336,
    )
    assert ffn.capacity_factor is None


def test_router_logits_stay_float32_under_autocast_and_bf16():
    moe = make(num_experts=4)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(13))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _, _ = moe.route(x)
        assert moe(x).shape == x.shape
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x @ moe.router.weight.t())
    assert type(moe.router) is not nn.Linear  # int8 passes over nn.Linear leave it alone
    low = make(num_experts=4).to(torch.bfloat16)
    assert low.route(x.bfloat16())[0].dtype == torch.float32


def test_moe_options_count_their_parameters_and_say_what_takes_effect():
    options = MoEOptions(
        num_experts=4,
        top_k=2,
        routing="softmax_topk",
        expert={"name": "geglu", "multiplier": 2, "bias": True},
        shared_experts=2,
        shared_expert_gate=True,
        router_bias=True,
    )
    m = MoE(options, ctx(bias=False))
    assert options.parameter_count(16, False) == sum(p.numel() for p in m.parameters())
    effective = options.effective(16, False)
    assert effective["expert"]["hidden"] == 32 and effective["expert"]["bias"] is True
    assert effective["shared_hidden"] == 64 and effective["renormalize"] is False
    assert {"load_balance_coef", "z_loss_coef"} == MoEOptions.training_only
