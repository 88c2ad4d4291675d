"""The training-step benchmark helpers measure the precision the trainer would use."""

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


@pytest.mark.parametrize(("fast_bf16", "expected"), [(False, "fp32"), (True, "bf16")])
def test_training_step_resolves_auto_like_the_trainer(monkeypatch, fast_bf16, expected):
    seen = []
    real = hardware.autocast
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: fast_bf16)
    monkeypatch.setattr(hardware, "autocast", lambda d, p: seen.append(p) or real(d, p))
    step, _ = bench.build_training_step(load_spec_dict(tiny_spec()), 2, 8, "auto")
    loss = step()
    assert seen == [expected] and loss == loss


def test_time_training_step_reports_the_resolved_precision(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: False)
    timing = bench.time_training_step(load_spec_dict(tiny_spec()), 2, 8, repeats=1)
    assert timing.precision == "fp32" and timing.tokens_per_s > 0
