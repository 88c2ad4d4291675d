"""EagerOptimizer: torch's optimizers step for step, hooks once, and no dynamo import."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import llmkit.optim as optim_mod
from llmkit.components.optimizer.lion import Lion
from llmkit.components.optimizer.muon import Muon
from tests.conftest import ROOT

#: (llmkit class, torch class, options)
PAIRS = [
    (optim_mod.AdamW, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
    (optim_mod.AdamW, torch.optim.AdamW, {"lr": 1e-2, "foreach": True}),
    (optim_mod.AdamW, torch.optim.AdamW, {"lr": 1e-2, "foreach": False, "amsgrad": True}),
    (optim_mod.SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    (optim_mod.Adafactor, torch.optim.Adafactor, {"lr": 1e-2}),
]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))


def _train(opt_cls: type, options: dict, steps: int = 6) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = opt_cls(model.parameters(), **options)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen)
        # Grad mode stays on around step(): an in-place update of a parameter under grad
        # mode would raise, so this also checks that step() turns it off.
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.fixture(params=[False, True], ids=["dynamo-absent", "dynamo-loaded"])
def dynamo(request, monkeypatch):
    """Both paths of EagerOptimizer whatever this process has imported."""
    monkeypatch.setattr(optim_mod, "dynamo_loaded", lambda: request.param)
    return request.param


@pytest.mark.parametrize("ours, theirs, options", PAIRS)
def test_eager_optimizers_step_as_torchs(dynamo, ours, theirs, options):
    a, opt_a = _train(ours, options)
    b, opt_b = _train(theirs, options)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
        assert pa.grad is None
    state = opt_a.state_dict()
    assert repr(state) == repr(opt_b.state_dict())
    # The state loads back into a fresh optimizer, which then steps as the original does.
    c = _model()
    c.load_state_dict(a.state_dict())
    opt_c = ours(c.parameters(), **options)
    opt_c.load_state_dict(copy.deepcopy(state))  # state_dict() holds the live tensors
    for model, opt in ((a, opt_a), (c, opt_c)):
        model(torch.ones(2, 6)).sum().backward()
        opt.step()
    for pa, pc in zip(a.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pc)


def test_step_hooks_run_once_and_closures_work(dynamo):
    model = _model()
    opt = optim_mod.AdamW(model.parameters(), lr=1e-2)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))

    def closure() -> torch.Tensor:
        assert torch.is_grad_enabled()
        opt.zero_grad()
        loss = model(torch.ones(2, 6)).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and calls == ["pre", "post"]


def test_own_optimizers_build_on_the_base():
    for cls in (Lion, Muon):
        assert issubclass(cls, optim_mod.EagerOptimizer)
    with pytest.raises(ValueError, match="2-D"):
        Muon([{"params": [nn.Parameter(torch.ones(3))], "use_muon": True}])


def test_training_steps_do_not_import_dynamo():
    # Every built-in optimizer built, stepped, zeroed, saved and loaded; then the control:
    # torch's own AdamW imports dynamo, so the check can see an import.
    code = """
import sys, importlib, torch
from torch import nn
from llmkit.optim import EagerOptimizer
model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10))
for name in ("adamw", "sgd", "lion", "adafactor", "muon"):
    mod = importlib.import_module(f"llmkit.components.optimizer.{name}")
    opt = mod.build(model, mod.Options())
    assert isinstance(opt, EagerOptimizer), name
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
print("torch._dynamo" in sys.modules)
torch.optim.AdamW(model.parameters())
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
