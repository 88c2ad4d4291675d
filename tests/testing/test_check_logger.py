"""llmkit.testing's logger check: every built-in tracker passes (offline, in a temporary run
directory), and trackers that break the contract fail naming what they broke."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from llmkit.contracts import LoggerContext, MetricsLogger, NoOptions
from llmkit.testing import check_component, conformance_params
from llmkit.testing.logger import RECORDS, RESUME_STEP
from tests.testing.fakes import fake


@pytest.mark.parametrize("record", conformance_params("logger"))
def test_builtin_loggers_pass(record, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cwd = os.getcwd()
    check_component(record)
    assert os.getcwd() == cwd


def test_a_missing_tracker_package_skips_the_check(monkeypatch):
    from llmkit.registry import get_registry

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb → ModuleNotFoundError
    with pytest.raises(pytest.skip.Exception, match="needs the module 'wandb'"):
        check_component(get_registry().get("logger", "wandb"))


class Recorder(MetricsLogger):
    """A logger that passes: it keeps what it gets in memory."""

    Options = NoOptions
    calls: ClassVar[list[tuple[str, Any]]] = []

    def __init__(self, options: Any, ctx: LoggerContext) -> None:
        self.ctx = ctx
        Recorder.calls.append(("build", ctx.resume_step))

    def log(self, record: dict[str, Any]) -> None:
        Recorder.calls.append(("log", record))

    def close(self) -> None:
        Recorder.calls.append(("close", None))


def test_a_good_logger_passes_and_gets_the_records_in_order_and_one_close(monkeypatch):
    monkeypatch.setattr(Recorder, "calls", [])
    check_component(fake("logger", Recorder))
    later = [r for r in RECORDS if r["step"] > RESUME_STEP]
    assert [c for c, _ in Recorder.calls] == (
        ["build", *["log"] * len(RECORDS), "close", "build", *["log"] * len(later), "close"]
    )
    logged = [r for c, r in Recorder.calls if c == "log"]
    assert [r["step"] for r in logged] == [r["step"] for r in [*RECORDS, *later]]
    assert [r for c, r in Recorder.calls if c == "build"] == [None, RESUME_STEP]


class StringsRaise(Recorder):
    def log(self, record: dict[str, Any]) -> None:
        for value in record.values():
            float(value)  # ValueError on "capitals"


class SlashesRaise(Recorder):
    def log(self, record: dict[str, Any]) -> None:
        bad = [k for k in record if "/" in k]
        if bad:
            raise KeyError(f"invalid metric name {bad[0]}")


class NanRaises(Recorder):
    def log(self, record: dict[str, Any]) -> None:
        if any(v != v for v in record.values()):
            raise ValueError("NaN")


class CloseRaises(Recorder):
    def close(self) -> None:
        raise RuntimeError("flush failed")


class NotALogger:
    Options = NoOptions

    def __init__(self, options: Any, ctx: LoggerContext) -> None:
        pass

    def log(self, record: dict[str, Any]) -> None:
        pass


class WritesIntoTheCwd(Recorder):
    def log(self, record: dict[str, Any]) -> None:
        with Path("metrics.txt").open("a") as fh:
            fh.write(f"{record}\n")


class WritesNextToTheRun(Recorder):
    def close(self) -> None:
        (self.ctx.run_dir.parent / "summary.txt").write_text("done")


class ResumeFails(Recorder):
    def __init__(self, options: Any, ctx: LoggerContext) -> None:
        if ctx.resume_step is not None:
            raise FileExistsError("run already exists")
        super().__init__(options, ctx)


class RemovesTheRunDir(Recorder):
    def close(self) -> None:
        self.ctx.run_dir.rmdir()


class BuildFails(Recorder):
    def __init__(self, options: Any, ctx: LoggerContext) -> None:
        raise ConnectionError("no network")


class MissingPackage(Recorder):
    def __init__(self, options: Any, ctx: LoggerContext) -> None:
        try:
            import llmkit_no_such_tracker  # noqa: F401
        except ImportError:
            raise RuntimeError("pip install llmkit-no-such-tracker") from None


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (StringsRaise, r"a new run: log\(\{'step': 2, 'eval': 'capitals'.*raised ValueError"),
        (SlashesRaise, r"log\(.*'capitals/acc'.*raised KeyError"),
        (NanRaises, r"log\(.*'grad_norm': nan.*raised ValueError: NaN"),
        (CloseRaises, r"a new run: close\(\) after 6 records raised RuntimeError: flush failed"),
        (NotALogger, "returned NotALogger, not a MetricsLogger"),
        (WritesIntoTheCwd, r"a new run: it wrote into the working directory.*metrics\.txt"),
        (WritesNextToTheRun, r"a new run: it wrote next to the run directory.*summary\.txt"),
        (ResumeFails, r"LoggerContext\(resume_step=2\) raised FileExistsError"),
        (RemovesTheRunDir, "a new run: the run directory .* is gone"),
        (BuildFails, r"LoggerContext\(resume_step=None\) raised ConnectionError: no network"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else None,
)
def test_a_broken_logger_fails_naming_the_property(target, match):
    cwd = os.getcwd()
    with pytest.raises(AssertionError, match=match) as err:
        check_component(fake("logger", target))
    assert str(err.value).startswith("logger 'fake' (from llmkit-fake)")
    assert os.getcwd() == cwd


def test_a_logger_whose_package_is_missing_is_skipped():
    with pytest.raises(pytest.skip.Exception, match="'llmkit_no_such_tracker'"):
        check_component(fake("logger", MissingPackage))
