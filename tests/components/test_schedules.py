"""Built-in lr schedules: warmup, decay shapes, end points and step validation."""

from __future__ import annotations

import importlib
import itertools
import math

import pytest
from pydantic import ValidationError

from llmkit.optim import linear_warmup

NAMES = ["constant", "cosine", "linear", "wsd", "inverse_sqrt"]


def module(name: str):
    return importlib.import_module(f"llmkit.components.schedule.{name}")


def make(name: str, total_steps: int = 100, **options):
    mod = module(name)
    return mod.build(mod.Options(**options), total_steps=total_steps)


def test_linear_warmup_helper():
    assert [linear_warmup(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert linear_warmup(0, 0) == 1.0


@pytest.mark.parametrize("name", NAMES)
def test_warmup_is_linear_and_reaches_one(name: str):
    f = make(name, total_steps=100, warmup_steps=10)
    values = [f(s) for s in range(10)]
    assert values == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)


@pytest.mark.parametrize("name", NAMES)
def test_no_warmup_starts_at_one(name: str):
    assert make(name, total_steps=50)(0) == pytest.approx(1.0)


@pytest.mark.parametrize("name", NAMES)
def test_warmup_longer_than_training_raises(name: str):
    mod = module(name)
    with pytest.raises(ValueError, match="warmup_steps"):
        mod.build(mod.Options(warmup_steps=20), total_steps=10)


@pytest.mark.parametrize("name", NAMES)
def test_options_reject_unknown_and_bad_values(name: str):
    Options = module(name).Options
    with pytest.raises(ValidationError):
        Options(warmup=10)
    with pytest.raises(ValidationError):
        Options(warmup_steps=-1)


@pytest.mark.parametrize("name", ["cosine", "linear", "wsd"])
def test_bad_min_lr_ratio(name: str):
    with pytest.raises(ValidationError):
        module(name).Options(min_lr_ratio=1.5)


def test_constant_has_no_floor():
    with pytest.raises(ValidationError):
        module("constant").Options(min_lr_ratio=0.1)
    f = make("constant", total_steps=100, warmup_steps=5)
    assert [f(s) for s in range(5, 200)] == [1.0] * 195


@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_decays_monotonically_to_floor(name: str):
    f = make(name, total_steps=100, warmup_steps=10, min_lr_ratio=0.2)
    after = [f(s) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(after))
    assert after[0] == pytest.approx(1.0)
    assert f(100) == pytest.approx(0.2)
    assert f(150) == pytest.approx(0.2)
    assert f(99) > 0.2


def test_cosine_shape():
    f = make("cosine", total_steps=110, warmup_steps=10, min_lr_ratio=0.0)
    assert f(60) == pytest.approx(0.5)  # halfway through the decay
    assert f(35) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_linear_shape():
    f = make("linear", total_steps=110, warmup_steps=10, min_lr_ratio=0.0)
    assert f(60) == pytest.approx(0.5)
    assert f(85) == pytest.approx(0.25)


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
def test_wsd(shape: str):
    f = make(
        "wsd",
        total_steps=100,
        warmup_steps=10,
        min_lr_ratio=0.1,
        decay_fraction=0.2,
        decay_shape=shape,
    )
    assert [f(s) for s in range(10, 81)] == [1.0] * 71  # stable phase
    decay = [f(s) for s in range(80, 101)]
    assert all(a > b for a, b in itertools.pairwise(decay))
    assert f(100) == pytest.approx(0.1)
    assert f(120) == pytest.approx(0.1)
    mid = {"linear": 0.55, "cosine": 0.55, "sqrt": 0.1 + 0.9 * (1 - math.sqrt(0.5))}[shape]
    assert f(90) == pytest.approx(mid)


def test_wsd_sqrt_drops_faster_than_linear():
    sqrt = make("wsd", decay_shape="sqrt")
    linear = make("wsd", decay_shape="linear")
    assert all(sqrt(s) < linear(s) for s in range(81, 100))


def test_wsd_rejects_overlapping_phases():
    mod = module("wsd")
    with pytest.raises(ValueError, match="decay"):
        mod.build(mod.Options(warmup_steps=90, decay_fraction=0.2), total_steps=100)
    with pytest.raises(ValidationError):
        mod.Options(decay_fraction=0.0)
    with pytest.raises(ValidationError):
        mod.Options(decay_shape="exp")


def test_inverse_sqrt():
    f = make("inverse_sqrt", total_steps=1000, warmup_steps=16)
    for s in (16, 64, 100, 400, 999):
        assert f(s) * math.sqrt(s) == pytest.approx(4.0)  # √16
    g = make("inverse_sqrt", total_steps=1000, warmup_steps=0)
    assert g(0) == 1.0 and g(3) == pytest.approx(0.5)
    floored = make("inverse_sqrt", total_steps=1000, warmup_steps=4, min_lr_ratio=0.25)
    assert floored(999) == pytest.approx(0.25)
    slow = make("inverse_sqrt", total_steps=1000, warmup_steps=4, timescale=100)
    assert slow(4) == pytest.approx(1.0)
    assert slow(104) == pytest.approx(math.sqrt(0.5))


def test_base_lr_scales():
    f = module("cosine").build(module("cosine").Options(), total_steps=10, base_lr=3e-4)
    assert f(0) == pytest.approx(3e-4)
    assert f(10) == pytest.approx(3e-5)
