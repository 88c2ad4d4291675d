"""llmkit.testing's optimizer check fails on optimizers that break the contract."""

from __future__ import annotations

import pytest
import torch

from llmkit.optim import OptimizerOptions, param_groups_for, set_initial_lr
from llmkit.testing import check_component
from tests.testing.fakes import fake


class _SignSGD(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class _Inert(_SignSGD):
    @torch.no_grad()
    def step(self, closure=None):
        return None


class _FixedLR(_SignSGD):
    """Reads the lr it was built with, ignoring what a schedule sets."""

    def __init__(self, params, lr):
        super().__init__(params, lr)
        self.fixed_lr = lr

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-self.fixed_lr)


class _Ascending(_SignSGD):
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=group["lr"])


class _Stateful(_SignSGD):
    """Keeps a step counter outside the optimizer state: lost by state_dict round trips."""

    def __init__(self, params, lr):
        super().__init__(params, lr)
        self.count = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.count += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"] * (1 + 0.1 * (self.count % 3)))


def build_sign_sgd(model, options):
    return set_initial_lr(_SignSGD(param_groups_for(model, options), options.lr))


def build_inert(model, options):
    return set_initial_lr(_Inert(param_groups_for(model, options), options.lr))


def build_without_initial_lr(model, options):
    return _SignSGD(param_groups_for(model, options), options.lr)


def build_fixed_lr(model, options):
    return set_initial_lr(_FixedLR(param_groups_for(model, options), options.lr))


def build_stateful(model, options):
    return set_initial_lr(_Stateful(param_groups_for(model, options), options.lr))


def build_partial(model, options):
    params = [p for n, p in model.named_parameters() if not n.startswith("norm")]
    return set_initial_lr(_SignSGD(params, options.lr))


def build_ascending(model, options):
    return set_initial_lr(_Ascending(param_groups_for(model, options), options.lr))


def test_a_good_optimizer_passes():
    check_component(fake("optimizer", build_sign_sgd, options=OptimizerOptions))


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (build_inert, "regression loss"),
        (build_ascending, "regression loss"),
        (build_without_initial_lr, "initial_lr"),
        (build_fixed_lr, r"group\['lr'\]"),
        (build_stateful, "load_state_dict"),
        (build_partial, "missing from every group"),
    ],
    ids=lambda x: x.__name__ if callable(x) else None,
)
def test_broken_optimizer_fails(target, match):
    with pytest.raises(AssertionError, match=match):
        check_component(fake("optimizer", target, options=OptimizerOptions))
