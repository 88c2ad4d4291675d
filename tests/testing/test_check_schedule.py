"""llmkit.testing's schedule check fails on schedules that break the contract."""

from __future__ import annotations

import itertools

import pytest

from llmkit.optim import WarmupOptions
from llmkit.testing import check_component
from tests.testing.fakes import fake


def _warm(step: int, warmup: int) -> float:
    return (step + 1) / warmup if step < warmup else 1.0


def build_linear_warmup(options, *, total_steps):
    return lambda step: _warm(step, options.warmup_steps)


def build_rising_tail(options, *, total_steps):
    def factor(step):
        if step < options.warmup_steps:
            return _warm(step, options.warmup_steps)
        return 0.5 + 0.5 * abs(step - 0.8 * total_steps) / total_steps

    return factor


def build_negative(options, *, total_steps):
    return lambda step: _warm(step, options.warmup_steps) - 1.5 * step / total_steps


def build_half_peak(options, *, total_steps):
    return lambda step: 0.5 * _warm(step, options.warmup_steps)


def build_counting(options, *, total_steps):
    calls = itertools.count()
    return lambda step: 1.0 / (1.0 + next(calls) / 1000)


def build_no_warmup(options, *, total_steps):
    return lambda step: 1.0


def test_a_good_schedule_passes():
    check_component(fake("schedule", build_linear_warmup, options=WarmupOptions))


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (build_rising_tail, "increases"),
        (build_negative, "negative"),
        (build_half_peak, "peak"),
        (build_counting, "call order"),
        (build_no_warmup, "does not rise during 10 warmup steps"),
    ],
    ids=lambda x: x.__name__ if callable(x) else None,
)
def test_broken_schedule_fails(target, match):
    with pytest.raises(AssertionError, match=match):
        check_component(fake("schedule", target, options=WarmupOptions))
