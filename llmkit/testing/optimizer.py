"""The ``optimizer`` kind: factories ``build(model, options) -> torch.optim.Optimizer``."""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor, nn

from llmkit.testing.common import (
    Options,
    Record,
    _device,
    _expect,
    _load,
    _maxdiff,
    _option_fields,
    _run,
    _seeded,
    build_options,
)


class _TinyNet(nn.Module):
    """Embedding → LayerNorm → Linear, plus a parameter the forward never uses."""

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)
        self.unused = nn.Linear(dim, 2)  # never gets a gradient

    def forward(self, idx: Tensor) -> Tensor:
        return self.lin(self.norm(self.emb(idx)))


def check_optimizer(
    record: Record,
    options: Options = None,
    *,
    device: str | torch.device | None = None,
    steps: int = 50,
    min_reduction: float = 0.3,
) -> None:
    """Check an optimizer factory ``build(model, options) -> torch.optim.Optimizer``.

    Options default to ``{"lr": 1e-2}`` when the options model has an ``lr`` field. The
    regression loss (fitting a teacher network) must fall by at least ``min_reduction`` of its
    initial value in ``steps`` steps.
    """
    dev = _device(record, device)
    build = _load(record)
    opts_dict = dict(options or {})
    if "lr" in _option_fields(record) and "lr" not in opts_dict:
        opts_dict["lr"] = 1e-2
    opts = build_options(record, opts_dict)
    with _seeded(0, dev):
        model = _TinyNet().to(dev)
        teacher = _TinyNet().to(dev)
    idx = torch.arange(16, device=dev).repeat(2)
    with torch.no_grad():
        target = teacher(idx)

    def loss_of(m: nn.Module) -> Tensor:
        return nn.functional.mse_loss(m(idx), target)

    def make(m: nn.Module, what: str) -> torch.optim.Optimizer:
        opt = _run(record, what, build, m, opts)
        _expect(
            isinstance(opt, torch.optim.Optimizer),
            record,
            f"{what} returned {type(opt).__name__}, not a torch.optim.Optimizer",
        )
        return opt

    opt = make(model, f"build(model, {opts!r})")
    seen: dict[int, int] = {}
    for i, group in enumerate(opt.param_groups):
        _expect(
            "initial_lr" in group,
            record,
            f"param group {i} has no 'initial_lr' (schedules scale it; see "
            "llmkit.optim.set_initial_lr)",
        )
        _expect(
            isinstance(group["initial_lr"], float | int) and group["initial_lr"] > 0,
            record,
            f"param group {i} has initial_lr {group['initial_lr']!r}",
        )
        _expect(
            group["lr"] == group["initial_lr"],
            record,
            f"param group {i}: lr {group['lr']} != initial_lr {group['initial_lr']} after build",
        )
        for p in group["params"]:
            seen[id(p)] = seen.get(id(p), 0) + 1
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [n for i, n in names.items() if i not in seen]
    twice = [names.get(i, "?") for i, c in seen.items() if c > 1]
    _expect(not missing, record, f"trainable parameters missing from every group: {missing}")
    _expect(not twice, record, f"parameters in more than one group: {twice}")

    unused = [p.detach().clone() for p in model.unused.parameters()]
    with torch.no_grad():
        first = loss_of(model).item()
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model)
        loss.backward()
        _run(record, f"step {step}", opt.step)
    with torch.no_grad():
        last = loss_of(model).item()
    _expect(math.isfinite(last), record, f"the loss is {last} after {steps} steps")
    _expect(
        last <= (1 - min_reduction) * first,
        record,
        f"{steps} steps took a regression loss from {first:.4f} only to {last:.4f} "
        f"(needs ≤ {(1 - min_reduction) * first:.4f}) with options {opts!r}",
    )
    _expect(
        all(torch.equal(a, p) for a, p in zip(unused, model.unused.parameters())),
        record,
        "changed parameters that never had a gradient (grad is None)",
    )

    def clone() -> tuple[nn.Module, torch.optim.Optimizer]:
        m = copy.deepcopy(model)
        o = make(m, "building a second optimizer")
        _run(record, "load_state_dict", o.load_state_dict, copy.deepcopy(opt.state_dict()))
        return m, o

    def grad_step(m: nn.Module, o: torch.optim.Optimizer) -> None:
        o.zero_grad(set_to_none=True)
        loss_of(m).backward()
        _run(record, "a step after load_state_dict", o.step)

    (m1, o1), (m2, o2) = clone(), clone()
    before = [p.detach().clone() for p in model.parameters()]
    grad_step(model, opt)
    grad_step(m1, o1)
    for (name, a), b in zip(model.named_parameters(), m1.parameters()):
        _expect(
            torch.equal(a, b),
            record,
            f"after state_dict → load_state_dict into a fresh optimizer, the next step differs "
            f"for {name!r} by {_maxdiff(a, b):.2e}",
        )
    for group in o2.param_groups:  # what a schedule does: lr = initial_lr * factor
        group["lr"] = group["initial_lr"] * 0.25
    grad_step(m2, o2)
    full = torch.cat([(a - b).flatten() for a, b in zip(model.parameters(), before)])
    quarter = torch.cat([(a - b).flatten() for a, b in zip(m2.parameters(), before)])
    _expect(
        _maxdiff(full, quarter) > 1e-3 * full.abs().max().item(),
        record,
        "setting group['lr'] to a quarter did not change the step: the optimizer must read "
        "each group's lr at every step (schedules set it)",
    )
