"""The training-step benchmark helpers time the trainer's own step, at the precision the
trainer would use."""

from __future__ import annotations

import contextlib

import pytest
import torch

from llmkit import bench, hardware
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec


def test_autocast_refuses_an_unresolved_precision():
    with pytest.raises(ValueError, match="unresolved precision 'auto'"):
        hardware.autocast(torch.device("cpu"), "auto")
    assert isinstance(hardware.autocast(torch.device("cpu"), "fp32"), contextlib.nullcontext)


@pytest.mark.parametrize(
    ("fast_bf16", "speedup", "expected"),
    [(False, 3.0, "fp32"), (True, 3.0, "bf16"), (True, 1.0, "fp32")],
)
def test_training_step_resolves_auto_like_the_trainer(monkeypatch, fast_bf16, speedup, expected):
    seen = []
    real = hardware.autocast
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: fast_bf16)
    monkeypatch.setattr(hardware, "bf16_speedup", lambda shape, cache=None: speedup)
    monkeypatch.setattr(hardware, "autocast", lambda d, p: seen.append(p) or real(d, p))
    step, _ = bench.build_training_step(load_spec_dict(tiny_spec()), 2, 8, "auto")
    loss = step()
    assert seen == [expected] and loss == loss


def test_time_training_step_reports_the_resolved_precision(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: False)
    timing = bench.time_training_step(load_spec_dict(tiny_spec()), 2, 8, repeats=1)
    assert timing.precision == "fp32" and timing.tokens_per_s > 0


def test_the_benchmark_times_the_trainers_own_step(monkeypatch):
    """``build_training_step`` runs :class:`llmkit.training.TrainStep`, the step the trainer
    takes, once per call: there is no second copy of the training step to drift."""
    from llmkit.training import TrainStep

    calls = []
    real = TrainStep.__call__
    monkeypatch.setattr(
        TrainStep, "__call__", lambda self, *a, **k: calls.append(self) or real(self, *a, **k)
    )
    step, model = bench.build_training_step(load_spec_dict(tiny_spec()), 2, 8, "fp32")
    first, second = step(), step()
    assert len(calls) == 2 and calls[0] is calls[1] and calls[0].model is model
    assert calls[0].grad_accum == 1 and second < first  # one micro-batch; it learns
