"""End-to-end GPU tests: set-up shared by tests/gpu.

- Every test here is skipped, with the reason, where there is no CUDA GPU, unless
  ``LLMKIT_GPU_TESTS_DEVICE=cpu`` asks to run them on the CPU (to check their logic; see
  tests/gpu/common.py). ``LLMKIT_GPU_TESTS_DEVICE=cuda`` makes a missing GPU an error.
- Each test module gets the process registry with the memory logger of tests/gpu/common.py
  added (dropped again after the module, so no other test sees it).
- ``runs(variant)`` trains one of ``VARIANTS`` (tests/gpu/common.py) the first time a test
  asks for it and hands the same finished run to every later test: the eager ``sdpa`` run is
  the reference of the parity tests, the uninterrupted run of the resume test, the source of
  the generation test's weights and the LoRA test's base; torch.compile (20–40 s a model)
  runs once per compiled variant. ``-m "not compile"`` leaves the compiled variants out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.common import (
    DEVICE,
    DEVICE_ENV,
    PRECISION,
    REPORT,
    SKIP_REASON,
    VARIANTS,
    MemoryPlugin,
    quiet,
    step_lines,
    write_spec,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "compile: trains with train.compile = true (torch.compile, 20-40 s a model)"
    )
    config.stash[REPORT] = []


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    lines = config.stash.get(REPORT, [])
    if lines:
        terminalreporter.section(f"end-to-end runs on {DEVICE} ({PRECISION})")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def e2e_report(pytestconfig: pytest.Config) -> list[str]:
    """Lines for the end of pytest's report (``pytest_terminal_summary`` above)."""
    return pytestconfig.stash[REPORT]


@pytest.fixture(scope="session", autouse=True)
def _gpu_device() -> str:
    """The device the tests run on; skips them all (or fails, when a GPU was demanded)."""
    if DEVICE is None:
        if os.environ.get(DEVICE_ENV, "").strip():
            pytest.fail(SKIP_REASON, pytrace=False)
        pytest.skip(SKIP_REASON)
    return DEVICE


@pytest.fixture(scope="module", autouse=True)
def _memory_logger(_gpu_device: str):
    """The process registry with the memory logger, for this module's runs."""
    from llmkit.registry import get_registry, reset_registry

    reset_registry()
    info = get_registry().add_plugin(MemoryPlugin(), "gpu_tests", "llmkit-gpu-tests", "0")
    assert info.error is None, info.error
    yield
    reset_registry()


@dataclass
class TrainedRun:
    """A finished run of a variant: its directory, its training lines of ``metrics.jsonl``
    and the seconds ``train()`` took (set-up, compilation and saving included)."""

    variant: str
    dir: Path
    lines: list[dict[str, Any]]
    seconds: float

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.lines]


@pytest.fixture(scope="session")
def runs(
    tmp_path_factory: pytest.TempPathFactory, e2e_report: list[str]
) -> Callable[[str], TrainedRun]:
    """``runs(variant)``: the finished run of a variant of :data:`VARIANTS`, trained once."""
    from llmkit.training import train

    done: dict[str, TrainedRun] = {}

    def get(variant: str) -> TrainedRun:
        if variant not in done:
            attention, compile_ = VARIANTS[variant]
            where = tmp_path_factory.mktemp(variant.replace("+", "-"))
            spec = write_spec(where, attention, compile=compile_)
            t0 = time.perf_counter()
            result = train(spec, run_dir=where / "run", **quiet())
            seconds = time.perf_counter() - t0
            assert result.stopped == "max_steps", (variant, result.stopped)
            done[variant] = TrainedRun(variant, result.run_dir, step_lines(result.run_dir), seconds)
            e2e_report.append(f"run {variant}: train() took {seconds:.1f} s")
        return done[variant]

    return get
