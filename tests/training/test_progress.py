"""The training progress display off a terminal: one line per logged step, each with its
time per step and an ETA."""

from __future__ import annotations

import pytest

from llmkit.training import progress
from llmkit.training.progress import ProgressDisplay


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(progress.time, "monotonic", fake)
    return fake


def record(step: int) -> dict:
    return {"step": step, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 1000.0}


def test_lines_carry_time_per_step_and_eta(clock: Clock) -> None:
    lines: list[str] = []
    display = ProgressDisplay(total=100, completed=0, log=lines.append, enabled=False)
    clock.now += 2.0  # 10 steps at 0.2 s
    display.show(record(10))
    clock.now += 30.0  # 10 steps at 3 s: the mean since the start is 1.6 s/step
    display.show(record(20))
    assert lines[0].startswith("step 10/100: loss 2.5000 lr 1.00e-03 1000 tok/s")
    assert lines[0].endswith(" · 200 ms/step · ETA 0:18")  # 90 steps × 0.2 s
    assert lines[1].endswith(" · 3.00 s/step · ETA 2:08")  # 80 steps × 1.6 s


def test_a_resumed_run_counts_from_its_resume(clock: Clock) -> None:
    lines: list[str] = []
    display = ProgressDisplay(total=5005, completed=5, log=lines.append, enabled=False)
    clock.now += 0.05  # 5 steps since the resume, not 10 since step 0
    display.show(record(10))
    assert lines[0].endswith(" · 10 ms/step · ETA 0:50")  # 4995 × 0.01 s


def test_long_etas_show_hours_and_a_repeated_step_no_timing(clock: Clock) -> None:
    lines: list[str] = []
    display = ProgressDisplay(total=10_000, completed=0, log=lines.append, enabled=False)
    clock.now += 2.5
    display.show(record(1))
    display.show(record(1))  # the same step again (a final record): nothing to time
    assert lines[0].endswith(" · 2.50 s/step · ETA 6:56:38")  # 9999 × 2.5 s
    assert lines[1].endswith("1000 tok/s")


def test_the_objective_is_named_when_not_the_cross_entropy(clock: Clock) -> None:
    lines: list[str] = []
    display = ProgressDisplay(
        total=4, completed=0, log=lines.append, enabled=False, objective="distill"
    )
    clock.now += 1.0
    display.show(record(2))
    assert lines[0].startswith("step 2/4: objective distill 2.5000")
