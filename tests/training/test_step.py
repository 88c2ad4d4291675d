"""TrainStep: a step's objective is the mean over all its trained targets, however
``grad_accum`` splits them and however unevenly masks spread them; auxiliary losses and
metrics are the micro-batches' means."""

from __future__ import annotations

import contextlib
import copy
import math
import weakref

import pytest
import torch

from llmkit import hardware
from llmkit.model import build_model
from llmkit.model.objective import Objective, ObjectiveOutput
from llmkit.spec import load_spec_dict
from llmkit.training.step import StepResult, TrainStep, resolve_precision, skips_on_device
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
    assert whole.trained == split.trained == 34  # the step's trained targets, counted exactly
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
    from llmkit.model.objective import Objective, ObjectiveOutput

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
    from llmkit.model.objective import Objective, ObjectiveOutput

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


# -- a step that leaves the non-finite check to the device --------------------------------------

#: The Tensor methods that copy a value to the host: on a GPU each waits for the device.
HOST_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


@contextlib.contextmanager
def no_host_reads():
    """Any read of a tensor's value on the host raises inside the block."""

    def refuse(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"the step read a tensor on the host (Tensor.{name})")

        return read

    with pytest.MonkeyPatch.context() as mp:
        for name in HOST_READS:
            mp.setattr(torch.Tensor, name, refuse(name))
        yield


class Poisoned(Objective):
    """The model's cross-entropy, NaN while ``poison`` is set."""

    poison = False

    def __call__(self, forward, x, y, **kw):
        out = super().__call__(forward, x, y, **kw)
        loss = out.loss * float("nan") if self.poison else out.loss
        return ObjectiveOutput(loss, out.aux_losses, out.metrics, logits=out.logits)


@pytest.fixture(scope="module")
def rope_model():
    """A model whose forward reads nothing on the host either (the learned positions check
    their range on the host where that is free: on a CPU)."""
    torch.manual_seed(0)
    return build_model(load_spec_dict(tiny_spec(position={"name": "rope"})))


def _adamw(model):
    """The ``adamw`` component's optimizer: fused by default on a CPU as on a GPU."""
    from llmkit.components.optimizer import adamw

    return adamw.build(model, adamw.Options(lr=1e-2, weight_decay=0.1))


@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_a_non_finite_step_is_dropped_on_the_device_without_a_host_read(rope_model, poison):
    model = copy.deepcopy(rope_model)
    opt = _adamw(model)
    assert opt.defaults["fused"] and skips_on_device(opt)
    objective = Poisoned()
    step = TrainStep(model, opt, objective=objective, grad_clip=1.0)
    assert step.device_skip
    x, y = _masked_batch()
    assert step(lambda: (x, y)).applied  # moments and step counts exist from here on
    weights = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(opt.state_dict()["state"])
    hook = None
    if poison == "loss":
        objective.poison = True
    else:  # a finite loss, an infinite gradient
        hook = next(model.parameters()).register_hook(lambda g: g * math.inf)
    with no_host_reads():
        result = step(lambda: (x, y))
    assert not result.known
    assert not result.applied and result.known
    assert math.isfinite(result.loss) == (poison == "gradient")
    assert not math.isfinite(result.grad_norm)
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    for i, saved in state.items():  # the moments, and the step count reverted on the device
        for key, value in saved.items():
            assert torch.equal(opt.state_dict()["state"][i][key], value), (i, key)
    objective.poison = False
    if hook is not None:
        hook.remove()
    with no_host_reads():
        result = step(lambda: (x, y))
    assert result.applied and math.isfinite(result.loss)
    assert all(float(s["step"]) == 2 for s in opt.state_dict()["state"].values())


def test_results_are_read_together_in_one_transfer(model):
    model = copy.deepcopy(model)
    step = TrainStep(model, _adamw(model))
    x, y = _masked_batch()
    results = [step(lambda: (x, y)) for _ in range(3)]
    assert not any(r.known for r in results)
    StepResult.read_all(results)
    assert all(r.known and r.applied for r in results)
    assert [r.trained for r in results] == [34, 34, 34]  # read with them, not the padding
    assert results[-1].loss < results[0].loss
    assert "not read" in repr(step(lambda: (x, y)))


def test_an_optimizer_without_found_inf_is_checked_on_the_host(model):
    # torch's AdamW without fused kernel cannot drop its own update: the step reads the
    # check before stepping, and a non-finite step leaves everything as it was.
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    objective = Poisoned()
    step = TrainStep(model, opt, objective=objective)
    assert not step.device_skip
    x, y = _masked_batch()
    step(lambda: (x, y))
    weights = copy.deepcopy(model.state_dict())
    objective.poison = True
    result = step(lambda: (x, y))
    assert result.known and not result.applied
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(float(s["step"]) == 1 for s in opt.state_dict()["state"].values())


def test_the_logits_are_freed_before_backward(model):
    # They are batch × block × vocab (GPT-2: 1.2 GB in bf16 at batch 12): nothing in the
    # backward pass needs them, so the step must not hold them through it.
    model = copy.deepcopy(model)
    logits: list[weakref.ref] = []

    def forward(x, y):
        out = model(x, y)
        logits.append(weakref.ref(out.logits))
        return out

    alive: list[bool] = []
    model.lm_head.register_full_backward_pre_hook(
        lambda _m, _g: alive.append(logits[-1]() is not None)
    )
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), forward=forward)
    step(_masked_batch)
    assert alive == [False]


def test_a_step_bound_for_a_gpu_copies_batches_from_pinned_memory(model, monkeypatch):
    model = copy.deepcopy(model)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0))
    step._pin = True  # as on a CUDA device
    x, y = _masked_batch()
    pinned, copies = [], []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if self is x or self is y:
            copies.append(kwargs.get("non_blocking"))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a, **k: False)
    monkeypatch.setattr(
        torch.Tensor, "pin_memory", lambda self, *a, **k: pinned.append(self) or self
    )
    monkeypatch.setattr(torch.Tensor, "to", to)
    step(lambda: (x, y))
    assert [id(t) for t in pinned] == [id(x), id(y)] and copies == [True, True]
