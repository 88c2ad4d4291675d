"""TrainStep: a step's objective is the mean over all its trained targets, however
``grad_accum`` splits them and however unevenly masks spread them; auxiliary losses and
metrics are the micro-batches' means."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from llmkit import hardware
from llmkit.model import build_model
from llmkit.spec import load_spec_dict
from llmkit.training.step import TrainStep, resolve_precision
from tests.helpers import tiny_spec


def _step(model, batches, accum):
    """Loss, reported values and the gradients the optimizer saw (lr 0: nothing moves)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: dict[str, torch.Tensor] = {}
    opt.register_step_pre_hook(
        lambda *_: seen.update({n: p.grad.clone() for n, p in model.named_parameters()})
    )
    it = iter(batches)
    result = TrainStep(model, opt, grad_accum=accum)(lambda: next(it))
    return result, torch.cat([seen[n].flatten() for n in sorted(seen)]) if seen else None


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(load_spec_dict(tiny_spec()))


def _masked_batch():
    torch.manual_seed(1)
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    y[0, 1:] = -100  # rows 0, 1: one trained target each (as a short padded chat turn)
    y[1, 1:] = -100
    return x, y


def test_accumulation_weights_micro_batches_by_their_trained_targets(model):
    x, y = _masked_batch()
    whole, g_whole = _step(model, [(x, y)], 1)
    split, g_split = _step(model, [(x[:2], y[:2]), (x[2:], y[2:])], 2)
    logits = model(x).logits
    mean = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), y.reshape(-1)).item()
    assert whole.loss == pytest.approx(mean, rel=1e-5)
    assert split.loss == pytest.approx(mean, rel=1e-5)  # 34 targets, not a mean of 2 means
    torch.testing.assert_close(g_split, g_whole, rtol=1e-4, atol=1e-6)


def test_a_micro_batch_without_trained_targets_adds_nothing(model):
    x, y = _masked_batch()
    empty = y[:2].clone().fill_(-100)
    alone, g_alone = _step(model, [(x[2:], y[2:])], 1)
    with_empty, g_with = _step(model, [(x[:2], empty), (x[2:], y[2:])], 2)
    assert with_empty.applied and with_empty.loss == pytest.approx(alone.loss, rel=1e-5)
    torch.testing.assert_close(g_with, g_alone, rtol=1e-4, atol=1e-6)


def test_a_step_without_trained_targets_is_not_applied(model):
    x, y = _masked_batch()
    result, _ = _step(model, [(x, y.fill_(-100))], 1)
    assert not result.applied


def test_metrics_are_the_micro_batches_mean(model, monkeypatch):
    from llmkit.training.objective import Objective, ObjectiveOutput

    values, real = iter([1.0, 3.0]), Objective.__call__

    def reporting(self, forward, x, y, **_kw):
        out = real(self, forward, x, y)
        return ObjectiveOutput(out.loss, out.aux_losses, {"probe": next(values)})

    monkeypatch.setattr(Objective, "__call__", reporting, raising=True)
    x, y = _masked_batch()
    result, _ = _step(model, [(x[:2], y[:2]), (x[2:], y[2:])], 2)
    assert result.reported["metric/probe"] == pytest.approx(2.0)


def test_a_non_finite_loss_is_reported_under_the_fp16_grad_scaler(model):
    # The scaler skips updates whose gradients overflow; a non-finite *loss* must still reach
    # the trainer (train.on_nonfinite), and the scaler must stay usable for the next step.
    from llmkit.training.objective import Objective, ObjectiveOutput

    class Poisoned(Objective):
        poison = True

        def __call__(self, forward, x, y, **kw):
            out = super().__call__(forward, x, y, **kw)
            loss = out.loss * float("nan") if self.poison else out.loss
            return ObjectiveOutput(loss, out.aux_losses, out.metrics)

    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    objective = Poisoned()
    step = TrainStep(model, opt, objective=objective, precision="fp16")
    x, y = _masked_batch()
    before = [p.detach().clone() for p in model.parameters()]
    result = step(lambda: (x, y))
    assert not result.applied and all(
        torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)
    )
    objective.poison = False
    result = step(lambda: (x, y))
    assert result.applied and math.isfinite(result.loss)


def test_resolving_precision_measures_only_when_given_the_tokens(monkeypatch, tmp_path):
    """Rank 0 measures the bf16 decision; the other ranks resolve without measuring (and
    take rank 0's answer)."""
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: True)
    shapes: list[tuple[int, int, int]] = []
    monkeypatch.setattr(
        hardware, "bf16_speedup", lambda shape, cache=None: shapes.append(shape) or 1.0
    )
    rs = load_spec_dict(tiny_spec())
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu, rs, None) == "bf16" and shapes == []
    d = rs.model.d_model
    assert resolve_precision("auto", cpu, rs, 512) == "fp32" and shapes == [(512, d, 4 * d)]
