"""The MoE block's Hugging Face routing variants: parity (outputs and gradients) with
transformers' Mixtral, Qwen2-MoE (gated shared expert), Qwen3-MoE (norm_topk_prob) and
DeepSeek-V3 (sigmoid scores, correction bias, group-limited routing, routed scaling) blocks,
with weights copied from their per-expert checkpoint names; option validation; gradients to
the shared gate and the router; the balance loss and metrics with sigmoid routing."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor, nn

from llmkit.components.ffn.moe import MoE, MoEOptions
from llmkit.contracts import BuildContext
from llmkit.errors import SpecError
from llmkit.spec import load_spec_dict
from llmkit.testing import tiny_model_spec

pytestmark = pytest.mark.usefixtures("one_thread")

D, H, SHARED_H = 32, 16, 24


def ctx(d: int = D) -> BuildContext:
    return BuildContext(
        d_model=d, n_heads=2, n_kv_heads=2, head_dim=d // 2, max_seq_len=64, n_layers=2,
        bias=False,
    )  # fmt: skip


def randomize(module: nn.Module, seed: int, std: float = 0.2) -> None:
    """transformers' expert tensors start uninitialized (torch.empty): fill everything."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std)


# -- transformers' blocks as checkpoints: per-expert names, then a copy into llmkit -----------


def checkpoint_state(block: nn.Module, gate: str, up: str, down: str) -> dict[str, Tensor]:
    """The block's tensors under the names of the published checkpoints: transformers 5.x
    fuses the experts into ``experts.gate_up_proj`` (E, 2h, C) (gate rows first) and
    ``experts.down_proj`` (E, C, h) when loading; split them back into
    ``experts.<i>.<gate|up|down>.weight`` (Mixtral: w1/w3/w2; Qwen, DeepSeek:
    gate_proj/up_proj/down_proj)."""
    state = {k: v.detach().clone() for k, v in block.state_dict().items()}
    gate_up, down_proj = state.pop("experts.gate_up_proj"), state.pop("experts.down_proj")
    h = down_proj.shape[-1]
    for i in range(gate_up.shape[0]):
        state[f"experts.{i}.{gate}.weight"] = gate_up[i, :h]
        state[f"experts.{i}.{up}.weight"] = gate_up[i, h:]
        state[f"experts.{i}.{down}.weight"] = down_proj[i]
    return state


def load_hf_moe(
    moe: MoE,
    state: dict[str, Tensor],
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    shared: str | None = None,
) -> None:
    """Copy a transformers MoE block's checkpoint tensors into llmkit's MoE:

    - ``gate.weight`` → ``router.weight``; ``gate.e_score_correction_bias`` →
      ``router.score_correction_bias``;
    - ``experts.<i>.<gate>.weight`` → ``w_in[i, :h]``, ``experts.<i>.<up>.weight`` →
      ``w_in[i, h:]``, ``experts.<i>.<down>.weight`` → ``w_out[i]``;
    - ``<shared>.gate_proj/up_proj/down_proj.weight`` →
      ``shared.gate_proj/up_proj/out_proj.weight``; ``shared_expert_gate.weight`` →
      ``shared_gate.weight``.
    """
    gate, up, down = names
    h = moe.hidden
    state = dict(state)
    with torch.no_grad():
        moe.router.weight.copy_(state.pop("gate.weight"))
        if "gate.e_score_correction_bias" in state:
            assert moe.router.score_correction_bias is not None
            moe.router.score_correction_bias.copy_(state.pop("gate.e_score_correction_bias"))
        for i in range(moe.num_experts):
            moe.w_in[i, :h].copy_(state.pop(f"experts.{i}.{gate}.weight"))
            moe.w_in[i, h:].copy_(state.pop(f"experts.{i}.{up}.weight"))
            moe.w_out[i].copy_(state.pop(f"experts.{i}.{down}.weight"))
        if shared is not None:
            assert moe.shared is not None
            for src, dst in (("gate_proj", "gate_proj"), ("up_proj", "up_proj"),
                             ("down_proj", "out_proj")):  # fmt: skip
                getattr(moe.shared, dst).weight.copy_(state.pop(f"{shared}.{src}.weight"))
        if "shared_expert_gate.weight" in state:
            assert moe.shared_gate is not None
            moe.shared_gate.weight.copy_(state.pop("shared_expert_gate.weight"))
    assert not state, f"not copied: {sorted(state)}"


def compare(hf: nn.Module, moe: MoE, pairs: dict[str, Tensor], seed: int = 0) -> None:
    """Outputs match to 1e-5 and gradients (input, router, shared gate, experts) to 1e-4."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, D, generator=gen)
    w = torch.randn(2, 7, D, generator=gen)
    results = []
    for module in (hf, moe):
        module.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        out = module(xg)
        out = out[0] if isinstance(out, tuple) else out
        (out * w).sum().backward()
        results.append((out.detach(), xg.grad))
    (ref, ref_dx), (got, dx) = results
    assert (got - ref).abs().max() <= 1e-5
    assert ref.abs().max() > 1e-2  # a real comparison, not zeros against zeros
    torch.testing.assert_close(dx, ref_dx, atol=1e-4, rtol=1e-4)
    hf_params = dict(hf.named_parameters())
    ours = dict(moe.named_parameters())
    for hf_name, ours_name in pairs.items():
        ref_g, got_g = hf_params[hf_name].grad, ours[ours_name].grad
        assert got_g is not None and float(got_g.abs().sum()) > 0, ours_name
        torch.testing.assert_close(got_g, ref_g, atol=1e-4, rtol=1e-4, msg=ours_name)
    if moe.options.routing != "topk_softmax":  # experts: fused gate_up ↔ w_in, same layout
        torch.testing.assert_close(
            moe.w_in.grad, hf_params["experts.gate_up_proj"].grad, atol=1e-4, rtol=1e-4
        )


def transformers_module(name: str):
    pytest.importorskip("transformers")
    import importlib

    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def eager(config):
    """Standalone expert modules: ask for the plain loop implementation."""
    config._experts_implementation = "eager"
    return config


# -- parity -----------------------------------------------------------------------------------


def test_mixtral_parity_topk_softmax():
    tm = transformers_module("mixtral")
    from transformers import MixtralConfig

    config = MixtralConfig(
        hidden_size=D, intermediate_size=H, num_local_experts=4, num_experts_per_tok=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    hf = tm.MixtralSparseMoeBlock(eager(config)).eval()
    randomize(hf, 0)
    moe = MoE(MoEOptions(num_experts=4, top_k=2, expert={"hidden": H}), ctx()).eval()
    load_hf_moe(moe, checkpoint_state(hf, "w1", "w3", "w2"), names=("w1", "w3", "w2"))
    compare(hf, moe, {"gate.weight": "router.weight"})


@pytest.mark.parametrize("norm", [True, False])
def test_qwen2_moe_parity_gated_shared_expert(norm):
    tm = transformers_module("qwen2_moe")
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(
        hidden_size=D, moe_intermediate_size=H, shared_expert_intermediate_size=SHARED_H,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm, intermediate_size=40,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    hf = tm.Qwen2MoeSparseMoeBlock(eager(config)).eval()
    randomize(hf, 1)
    options = MoEOptions(
        num_experts=4, top_k=2, routing="softmax_topk", renormalize=norm,
        expert={"name": "swiglu", "hidden": H}, shared_experts=1, shared_hidden=SHARED_H,
        shared_expert_gate=True,
    )  # fmt: skip
    moe = MoE(options, ctx()).eval()
    assert moe.shared_gate is not None and moe.shared_gate.weight.shape == (1, D)
    load_hf_moe(moe, checkpoint_state(hf, "gate_proj", "up_proj", "down_proj"),
                shared="shared_expert")  # fmt: skip
    compare(hf, moe, {
        "gate.weight": "router.weight",
        "shared_expert_gate.weight": "shared_gate.weight",
        "shared_expert.gate_proj.weight": "shared.gate_proj.weight",
    })  # fmt: skip
    # The gate matters: without it the shared block would be added with weight 1.
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        gated = moe(x)
        moe.shared_gate = None
        assert (moe(x) - gated).abs().max() > 1e-3


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_parity_softmax_topk_renormalize(norm):
    tm = transformers_module("qwen3_moe")
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=D, moe_intermediate_size=H, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=norm, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    hf = tm.Qwen3MoeSparseMoeBlock(eager(config)).eval()
    randomize(hf, 2)
    moe = MoE(
        MoEOptions(num_experts=4, top_k=2, routing="softmax_topk", renormalize=norm,
                   expert={"hidden": H}),
        ctx(),
    ).eval()  # fmt: skip
    load_hf_moe(moe, checkpoint_state(hf, "gate_proj", "up_proj", "down_proj"))
    compare(hf, moe, {"gate.weight": "router.weight"})
    _, _, weights = moe.route(torch.randn(6, D))
    sums = weights.sum(-1)
    assert bool(torch.allclose(sums, torch.ones(6))) == norm


def deepseek(norm: bool = True, n_group: int = 4, topk_group: int = 2, seed: int = 4):
    tm = transformers_module("deepseek_v3")
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        hidden_size=D, moe_intermediate_size=H, n_routed_experts=8, num_experts_per_tok=3,
        n_group=n_group, topk_group=topk_group, n_shared_experts=1, routed_scaling_factor=2.5,
        norm_topk_prob=norm, intermediate_size=40, num_attention_heads=4,
        num_key_value_heads=4,
    )  # fmt: skip
    hf = tm.DeepseekV3MoE(eager(config)).eval()
    randomize(hf, seed, std=0.3)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(
            torch.randn(8, generator=torch.Generator().manual_seed(seed)) * 0.3
        )
    options = MoEOptions(
        num_experts=8, top_k=3, routing="sigmoid_topk", n_group=n_group, topk_group=topk_group,
        renormalize=norm, routed_scaling_factor=2.5, expert={"hidden": H}, shared_experts=1,
    )  # fmt: skip
    moe = MoE(options, ctx()).eval()
    load_hf_moe(moe, checkpoint_state(hf, "gate_proj", "up_proj", "down_proj"),
                shared="shared_experts")  # fmt: skip
    return hf, moe


@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_v3_parity_sigmoid_group_limited(norm):
    hf, moe = deepseek(norm)
    assert moe.router.score_correction_bias.abs().sum() > 0
    compare(hf, moe, {"gate.weight": "router.weight",
                      "shared_experts.up_proj.weight": "shared.up_proj.weight"})  # fmt: skip
    # The test exercises both the group limit and the correction bias: each changes the
    # choice of some tokens.
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(5))
    _, experts, _ = moe.route(x)
    logits = moe.router(x)
    for plain in (logits.sigmoid() + moe.router.score_correction_bias, logits.sigmoid()):
        other = plain.topk(3, dim=-1).indices
        assert not torch.equal(experts.sort(-1).values, other.sort(-1).values)
    groups = experts // 2  # 4 groups of 2 experts: a token's experts lie in ≤ 2 groups
    assert all(len(set(row.tolist())) <= 2 for row in groups)


def test_deepseek_v3_parity_without_groups():
    hf, moe = deepseek(n_group=1, topk_group=1, seed=6)
    compare(hf, moe, {"gate.weight": "router.weight"})


# -- routing behaviour ------------------------------------------------------------------------


def make(seed: int = 0, **options) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(MoEOptions(**options), ctx(16))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    return moe


def test_renormalize_and_scaling_defaults():
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(7))
    assert MoEOptions(routing="softmax_topk").renormalized is False  # as before
    assert MoEOptions(routing="sigmoid_topk").renormalized is True  # DeepSeek-V3's default
    assert MoEOptions().renormalized is True  # topk_softmax: by construction
    plain = make(num_experts=4, routing="softmax_topk")
    renorm = make(num_experts=4, routing="softmax_topk", renormalize=True,
                  routed_scaling_factor=2.0)  # fmt: skip
    _, e_a, w_a = plain.route(x)
    _, e_b, w_b = renorm.route(x)
    assert torch.equal(e_a, e_b) and bool((w_a.sum(-1) < 1 - 1e-3).all())
    torch.testing.assert_close(w_b, 2.0 * w_a / w_a.sum(-1, keepdim=True))
    sig = make(num_experts=4, routing="sigmoid_topk")
    logits, experts, weights = sig.route(x)
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))
    raw = make(num_experts=4, routing="sigmoid_topk", renormalize=False)
    torch.testing.assert_close(raw.route(x)[2], logits.sigmoid().gather(-1, experts))


def test_correction_bias_steers_the_choice_not_the_weights():
    moe = make(num_experts=4, top_k=1, routing="sigmoid_topk", renormalize=False)
    assert "router.score_correction_bias" in moe.state_dict()
    assert "router.score_correction_bias" not in dict(moe.named_parameters())
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        moe.router.score_correction_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    logits, experts, weights = moe.route(x)
    assert bool((experts == 2).all())
    torch.testing.assert_close(weights[:, 0], logits[:, 2].sigmoid())


def test_single_expert_groups_score_by_their_one_expert():
    grouped = make(num_experts=4, routing="sigmoid_topk", n_group=4, topk_group=2)
    flat = make(num_experts=4, routing="sigmoid_topk")
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(9))
    _, e_a, w_a = grouped.route(x)
    _, e_b, w_b = flat.route(x)
    assert torch.equal(e_a.sort(-1).values, e_b.sort(-1).values)
    torch.testing.assert_close(w_a.sort(-1).values, w_b.sort(-1).values)


def test_gradients_reach_the_shared_gate_and_the_router():
    moe = make(num_experts=8, top_k=2, routing="sigmoid_topk", n_group=4, topk_group=2,
               shared_experts=1, shared_expert_gate=True, routed_scaling_factor=2.5,
               load_balance_coef=0.0, z_loss_coef=0.0)  # fmt: skip
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(10))
    moe(x).square().sum().backward()
    for name in ("router.weight", "shared_gate.weight", "w_in", "w_out"):
        grad = dict(moe.named_parameters())[name].grad
        assert grad is not None and float(grad.abs().sum()) > 0, name
    assert moe.shared_gate.weight.shape == (1, 16)
    assert moe.router.score_correction_bias.grad is None
    # top-1 sigmoid routing still teaches the router through the LM loss
    one = make(num_experts=4, top_k=1, routing="sigmoid_topk", renormalize=False,
               load_balance_coef=0.0, z_loss_coef=0.0)  # fmt: skip
    one(x).sum().backward()
    assert float(one.router.weight.grad.abs().sum()) > 0


def test_active_parameters_count_the_shared_gate():
    moe = make(num_experts=4, top_k=2, shared_experts=1, shared_expert_gate=True)
    plain = make(num_experts=4, top_k=2, shared_experts=1)
    assert moe.active_parameters() == plain.active_parameters() + 16
    total = sum(p.numel() for p in moe.parameters())
    assert total == sum(p.numel() for p in plain.parameters()) + 16


def test_sigmoid_balance_loss_and_entropy_use_normalized_scores():
    moe = make(num_experts=4, top_k=2, routing="sigmoid_topk", load_balance_coef=1.0,
               z_loss_coef=1.0, load_metrics="per_expert")  # fmt: skip
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(11))
    moe(x)
    losses, metrics = moe.pop_side_outputs()
    logits, experts, _ = moe.route(x)
    s = logits.sigmoid()
    p = s / s.sum(-1, keepdim=True)
    f = torch.bincount(experts.flatten(), minlength=4).float() / experts.numel()
    torch.testing.assert_close(losses["load_balance"].detach(), 4 * (f * p.mean(0)).sum())
    torch.testing.assert_close(
        losses["z_loss"].detach(), torch.logsumexp(logits, -1).square().mean()
    )
    entropy = -(p * p.log()).sum(-1).mean()
    torch.testing.assert_close(metrics["router_entropy"], entropy)
    assert float(metrics["router_entropy"]) <= math.log(4) + 1e-6
    moe.zero_grad(set_to_none=True)
    losses["load_balance"].backward()
    assert float(moe.router.weight.grad.abs().sum()) > 0


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"routing": "sigmoid_topk", "n_group": 3}, r"n_group \(3\) must divide num_experts \(8\)"),
        ({"routing": "sigmoid_topk", "n_group": 4, "topk_group": 5},
         r"topk_group \(5\) must not exceed n_group \(4\)"),
        ({"routing": "sigmoid_topk", "n_group": 4, "topk_group": 1, "top_k": 3},
         r"top_k \(3\) exceeds the 2 experts"),
        ({"routing": "softmax_topk", "n_group": 2}, r"need routing = 'sigmoid_topk'"),
        ({"topk_group": 1}, r"need routing = 'sigmoid_topk'"),
        ({"renormalize": True}, r"renormalize has no effect with routing = 'topk_softmax'"),
        ({"shared_expert_gate": True}, r"shared_expert_gate is set but shared_experts is 0"),
        ({"routed_scaling_factor": 0.0}, r"greater than 0"),
        ({"routing": "sigmoid_topk", "n_group": 0}, r"greater than or equal to 1"),
    ],
)  # fmt: skip
def test_bad_combinations_are_refused(options, message):
    with pytest.raises(ValidationError, match=message):
        MoEOptions(**options)
    with pytest.raises(SpecError, match=r"model\.ffn.*" + message) as info:
        load_spec_dict(tiny_model_spec("sdpa", "rope", {"name": "moe", **options}, "rmsnorm"))
    assert "\n" not in str(info.value)


def test_new_options_round_trip_through_a_spec():
    ffn = {"name": "moe", "routing": "sigmoid_topk", "n_group": 4, "topk_group": 2,
           "renormalize": False, "routed_scaling_factor": 2.5, "shared_experts": 1,
           "shared_expert_gate": True}  # fmt: skip
    rs = load_spec_dict(tiny_model_spec("sdpa", "rope", ffn, "rmsnorm"))
    dumped = rs.layers[0].ffn.to_dict()
    again = load_spec_dict(tiny_model_spec("sdpa", "rope", dumped, "rmsnorm"))
    assert again.layers[0].ffn.options == rs.layers[0].ffn.options
    for key in ("routing", "n_group", "topk_group", "routed_scaling_factor"):
        assert dumped[key] == ffn[key]
