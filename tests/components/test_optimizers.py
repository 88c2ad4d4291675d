"""Built-in optimizers: parameter grouping, convergence, state round-trips, Lion and Muon math."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from llmkit.optim import embedding_like, param_groups, set_lr_factor

NAMES = ["adamw", "sgd", "lion", "adafactor", "muon"]

# Learning rates that make each optimizer move visibly in a few dozen steps.
FAST = {
    "adamw": {"lr": 1e-2},
    "sgd": {"lr": 0.05},
    "lion": {"lr": 3e-3},
    "adafactor": {"lr": 3e-2},
    "muon": {"lr": 0.02, "adamw_lr": 1e-2},
}


def module(name: str):
    return importlib.import_module(f"llmkit.components.optimizer.{name}")


class Tiny(nn.Module):
    """Embedding → LayerNorm → MLP → head, optionally tied to the embedding."""

    def __init__(self, vocab: int = 12, dim: int = 8, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        x = x + self.fc2(torch.relu(self.fc1(self.norm(x))))
        return self.lm_head(x)


def regression_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 12, (16, 5), generator=g)
    table = torch.randn(12, 12, generator=g)  # a learnable token → target map
    return idx, table[idx]


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    idx, target = batch
    return nn.functional.mse_loss(model(idx), target)


def ids(params) -> set[int]:
    return {id(p) for p in params}


def groups_by_name(groups) -> dict[str, set[int]]:
    return {g["group_name"]: ids(g["params"]) for g in groups}


# --- parameter groups ------------------------------------------------------------------


def test_param_groups_default_split():
    m = Tiny()
    groups = groups_by_name(param_groups(m, 0.1))
    assert groups["decay"] == ids([m.fc1.weight, m.fc2.weight, m.lm_head.weight])
    assert groups["no_decay"] == ids(
        [m.embed.weight, m.norm.weight, m.norm.bias, m.fc1.bias, m.fc2.bias]
    )
    wd = {g["group_name"]: g["weight_decay"] for g in param_groups(m, 0.1)}
    assert wd == {"decay": 0.1, "no_decay": 0.0}


def test_param_groups_flags():
    m = Tiny()
    groups = groups_by_name(param_groups(m, 0.1, decay_embeddings=True))
    assert id(m.embed.weight) in groups["decay"]
    assert id(m.norm.weight) in groups["no_decay"]
    groups = groups_by_name(param_groups(m, 0.1, decay_norms_and_biases=True))
    assert ids([m.norm.weight, m.norm.bias, m.fc1.bias]) <= groups["decay"]
    assert groups["no_decay"] == ids([m.embed.weight])
    everything = param_groups(m, 0.1, decay_norms_and_biases=True, decay_embeddings=True)
    assert [g["group_name"] for g in everything] == ["decay"]  # empty group dropped


def test_param_groups_tied_and_frozen():
    m = Tiny(tied=True)
    m.fc2.bias.requires_grad_(False)
    groups = param_groups(m, 0.1)
    all_params = [p for g in groups for p in g["params"]]
    assert len(all_params) == len(ids(all_params))  # tied weight counted once
    assert ids(all_params) == ids(p for p in m.parameters() if p.requires_grad)
    assert id(m.lm_head.weight) in groups_by_name(groups)["no_decay"]  # tied head = embedding
    assert id(m.fc2.bias) not in ids(all_params)


def test_embedding_like():
    m = Tiny()
    assert embedding_like(m) == ids([m.embed.weight, m.lm_head.weight])
    assert embedding_like(m, include_head=False) == ids([m.embed.weight])


# --- every optimizer -------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_reduces_loss(name: str):
    torch.manual_seed(0)
    model = Tiny()
    mod = module(name)
    opt = mod.build(model, mod.Options(**FAST[name], weight_decay=0.01))
    batch = regression_batch()
    first = loss_of(model, batch).item()
    for _ in range(60):
        opt.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
    assert loss_of(model, batch).item() < 0.4 * first


@pytest.mark.parametrize("name", NAMES)
def test_groups_carry_initial_lr(name: str):
    mod = module(name)
    opt = mod.build(Tiny(), mod.Options())
    for g in opt.param_groups:
        assert g["initial_lr"] == g["lr"] > 0
        assert g["group_name"] in {"decay", "no_decay"}
    set_lr_factor(opt, 0.5)
    assert all(g["lr"] == 0.5 * g["initial_lr"] for g in opt.param_groups)


@pytest.mark.parametrize("name", NAMES)
def test_decay_settings_reach_groups(name: str):
    mod = module(name)
    opt = mod.build(Tiny(), mod.Options(weight_decay=0.05))
    assert {g["group_name"]: g["weight_decay"] for g in opt.param_groups} == {
        "decay": 0.05,
        "no_decay": 0.0,
    }


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip(name: str):
    torch.manual_seed(0)
    mod = module(name)
    options = mod.Options(**FAST[name], weight_decay=0.01)
    batch = regression_batch()
    a = Tiny()
    opt_a = mod.build(a, options)
    for _ in range(3):
        opt_a.zero_grad()
        loss_of(a, batch).backward()
        opt_a.step()

    b = copy.deepcopy(a)
    opt_b = mod.build(b, options)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for model, opt in ((a, opt_a), (b, opt_b)):
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)

    # a fresh optimizer without the loaded state takes a different step
    c = copy.deepcopy(b)
    fresh = mod.build(c, options)
    fresh.zero_grad()
    loss_of(c, batch).backward()
    fresh.step()
    b.zero_grad()
    loss_of(b, batch).backward()
    opt_b.step()
    assert any(not torch.equal(pb, pc) for pb, pc in zip(b.parameters(), c.parameters()))


@pytest.mark.parametrize("name", NAMES)
def test_options_reject_unknown_and_bad_values(name: str):
    Options = module(name).Options
    with pytest.raises(ValidationError):
        Options(learning_rate=1e-3)
    with pytest.raises(ValidationError):
        Options(lr=0.0)
    with pytest.raises(ValidationError):
        Options(weight_decay=-0.1)


def test_specific_bad_values():
    with pytest.raises(ValidationError, match="nesterov"):
        module("sgd").Options(momentum=0.0, nesterov=True)
    module("sgd").Options(momentum=0.9, nesterov=True)
    with pytest.raises(ValidationError):
        module("adamw").Options(betas=(0.9, 1.0))
    with pytest.raises(ValidationError):
        module("lion").Options(betas=(0.9,))
    with pytest.raises(ValidationError):
        module("adafactor").Options(beta2_decay=0.5)
    with pytest.raises(ValidationError):
        module("adafactor").Options(d=0.5)
    with pytest.raises(ValidationError):
        module("muon").Options(ns_steps=0)
    assert module("lion").Options().lr == 1e-4


# --- Lion ------------------------------------------------------------------------------


def test_lion_matches_hand_computed_update():
    p0 = torch.tensor([1.0, -2.0, 0.5])
    p = nn.Parameter(p0.clone())
    lion = module("lion")
    opt = lion.Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    g1 = torch.tensor([0.3, -0.2, 0.0])
    p.grad = g1.clone()
    opt.step()
    # m=0: u = sign(0.1·g) ; p ← p − lr·(u + wd·p)
    torch.testing.assert_close(p.detach(), p0 - 0.1 * (torch.sign(g1) + 0.5 * p0))
    m = 0.01 * g1
    torch.testing.assert_close(opt.state[p]["exp_avg"], m)

    g2 = torch.tensor([-0.001, 0.5, -1.0])
    p.grad = g2.clone()
    before = p.detach().clone()
    opt.step()
    u = torch.sign(0.9 * m + 0.1 * g2)  # first entry: 0.0027 − 0.0001 > 0 → +1 despite g < 0
    assert u[0] == 1
    torch.testing.assert_close(p.detach(), before - 0.1 * (u + 0.5 * before))
    torch.testing.assert_close(opt.state[p]["exp_avg"], 0.99 * m + 0.01 * g2)


# --- Muon ------------------------------------------------------------------------------


def test_muon_routes_hidden_matrices_only():
    m = Tiny()
    opt = module("muon").build(m, module("muon").Options(weight_decay=0.1))
    muon = set().union(*(ids(g["params"]) for g in opt.param_groups if g["use_muon"]))
    adamw = set().union(*(ids(g["params"]) for g in opt.param_groups if not g["use_muon"]))
    assert muon == ids([m.fc1.weight, m.fc2.weight])
    assert adamw == ids(p for p in m.parameters()) - muon
    assert ids([m.embed.weight, m.lm_head.weight, m.norm.weight, m.fc1.bias]) <= adamw
    lrs = {g["use_muon"]: g["lr"] for g in opt.param_groups}
    assert lrs == {True: 0.02, False: 3e-4}
    opt = module("muon").build(m, module("muon").Options(lr=0.05, adamw_lr=None))
    assert {g["lr"] for g in opt.param_groups} == {0.05}


@pytest.mark.parametrize("shape", [(16, 16), (32, 8), (8, 48)])
def test_newton_schulz_orthogonalizes(shape):
    torch.manual_seed(0)
    g = torch.randn(*shape) * 3.0
    x = module("muon").newton_schulz(g, steps=5)
    assert x.shape == g.shape
    s = torch.linalg.svdvals(x.float())
    assert s.min() > 0.5 and s.max() < 1.5
    # same singular vectors: x ≈ U Vᵀ points along g
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cos = (x * (u @ vh)).sum() / (x.norm() * (u @ vh).norm())
    assert cos > 0.95


def test_newton_schulz_bfloat16():
    g = torch.randn(24, 12)
    x = module("muon").newton_schulz(g, dtype=torch.bfloat16)
    assert x.dtype == torch.bfloat16
    s = torch.linalg.svdvals(x.float())
    assert s.min() > 0.5 and s.max() < 1.5


def test_muon_step_matches_reference():
    muon = module("muon")
    w = nn.Parameter(torch.randn(6, 3))
    opt = muon.Muon([{"params": [w], "use_muon": True}], lr=0.1, momentum=0.9, weight_decay=0.2)
    g = torch.randn(6, 3)
    w0 = w.detach().clone()
    w.grad = g.clone()
    opt.step()
    buf = 0.1 * g
    update = 0.1 * g + 0.9 * buf  # nesterov
    expected = w0 * (1 - 0.1 * 0.2) - 0.1 * 2**0.5 * muon.newton_schulz(update)
    torch.testing.assert_close(w.detach(), expected)
    torch.testing.assert_close(w.grad, g)  # the gradient is left untouched


def test_adamw_uses_the_fused_kernel_where_torch_supports_the_parameters():
    adamw = module("adamw")
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    opt = adamw.build(model, adamw.Options(lr=1e-3))
    assert opt.defaults["fused"] is True
    assert adamw.build(model, adamw.Options(lr=1e-3, fused=False)).defaults["fused"] is False
    frozen_int = nn.Module()
    frozen_int.w = nn.Parameter(torch.ones(3))
    frozen_int.meta = nn.Parameter(torch.ones(3, device="meta"))
    assert not adamw.fused_supported(frozen_int)  # two devices, one of them unsupported


def test_fused_and_unfused_adamw_take_the_same_steps():
    adamw = module("adamw")
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 2))
    b = copy.deepcopy(a)
    opts = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.99)}
    oa = adamw.build(a, adamw.Options(**opts))
    ob = adamw.build(b, adamw.Options(**opts, fused=False))
    x = torch.randn(16, 6)
    for _ in range(20):
        for m, o in ((a, oa), (b, ob)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5)
