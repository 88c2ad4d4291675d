"""The ``logger`` kind: experiment trackers built as ``Component(options, ctx: LoggerContext)``
-> :class:`~llmkit.contracts.MetricsLogger`; ``log(record)`` for each record in order, then
``close()`` once (see :mod:`llmkit.contracts`)."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch

from llmkit.contracts import LoggerContext, MetricsLogger
from llmkit.testing.common import Options, Record, _expect, _fail, _load, _run, build_options

#: What a short run writes, in order: training steps (floats, an int, a NaN the run diverged
#: to for a step), a validation record, an evaluation (a string value and ``task/metric``
#: names), and the steps after the checkpoint a resumed run restarts from (``RESUME_STEP``).
RECORDS: list[dict[str, Any]] = [
    {"step": 1, "loss": 4.5, "lr": 1e-4, "grad_norm": 1.25, "tokens": 512},
    {"step": 2, "loss": 4.25, "lr": 2e-4, "grad_norm": math.nan, "tokens": 1024},
    {"step": 2, "val_loss": 4.125, "val_ppl": 61.87},
    {"step": 2, "eval": "capitals", "capitals/acc": 0.5, "capitals/n": 8},
    {"step": 3, "loss": 4.0, "lr": 3e-4, "grad_norm": 0.75, "tokens": 1536},
    {"step": 4, "loss": 3.875, "lr": 3e-4, "grad_norm": 0.5, "tokens": 2048},
]
RESUME_STEP = 2


def _config(record: Record, options: Options) -> dict[str, Any]:
    """A run's spec, as a tracker shows it: nested tables, numbers, strings, a list."""
    return {
        "name": "check-logger",
        "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4},
        "train": {
            "max_steps": 4,
            "lr": 3e-4,
            "loggers": [{"name": record.name, **dict(options or {})}],
        },
        "optimizer": {"name": "adamw", "betas": [0.9, 0.95]},
    }


def _missing_module(exc: BaseException) -> ModuleNotFoundError | None:
    """The ModuleNotFoundError behind ``exc`` (raised from it or while handling it), if any:
    a tracker's optional package that is not installed."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, ModuleNotFoundError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _skip(record: Record, missing: ModuleNotFoundError) -> None:
    """Skip the check (pytest's skip): the logger needs a package this environment lacks."""
    name = missing.name or str(missing)
    try:
        import pytest
    except ImportError:  # outside pytest: a missing package is a failure after all
        _fail(record, f"building it needs the module {name!r}, which is not installed")
    pytest.skip(f"logger {record.name!r} needs the module {name!r}, which is not installed")


def _build(record: Record, factory: Any, opts: Any, ctx: LoggerContext) -> MetricsLogger:
    what = f"building it with LoggerContext(resume_step={ctx.resume_step})"
    try:
        logger = factory(opts, ctx)
    except AssertionError:
        raise
    except Exception as exc:
        missing = _missing_module(exc)
        if missing is not None:
            _skip(record, missing)
        _fail(record, f"{what} raised {type(exc).__name__}: {exc}")
    _expect(
        isinstance(logger, MetricsLogger),
        record,
        f"{what} returned {type(logger).__name__}, not a MetricsLogger (llmkit.MetricsLogger is "
        "the contract: subclass it)",
    )
    return logger


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _write(
    record: Record, factory: Any, opts: Any, ctx: LoggerContext, records: list[dict[str, Any]]
) -> None:
    """Build a logger for ``ctx``, give it ``records`` in order, close it once."""
    logger = _build(record, factory, opts, ctx)
    run = "a resumed run" if ctx.resume_step is not None else "a new run"
    try:
        for rec in records:
            _run(record, f"{run}: log({rec!r})", logger.log, dict(rec))
    except AssertionError:
        with suppress(Exception):  # the trainer closes its loggers after an error too
            logger.close()
        raise
    _run(record, f"{run}: close() after {len(records)} records", logger.close)


def _check_places(record: Record, root: Path, cwd: Path, run_dir: Path, what: str) -> None:
    stray = sorted(_files(cwd))
    _expect(
        not stray,
        record,
        f"{what}: it wrote into the working directory, not the run directory: {stray[:5]}",
    )
    outside = sorted(set(os.listdir(root)) - {cwd.name, run_dir.name})
    _expect(
        not outside,
        record,
        f"{what}: it wrote next to the run directory, outside it: {outside[:5]}",
    )
    _expect(run_dir.is_dir(), record, f"{what}: the run directory {run_dir} is gone")


def check_logger(
    record: Record, options: Options = None, *, device: str | torch.device | None = None
) -> None:
    """Check an experiment tracker in a temporary run directory, with the working directory
    an empty temporary one: built as ``Component(options, LoggerContext(run_dir, run_name,
    config))`` it is a :class:`~llmkit.contracts.MetricsLogger`; it takes a run's records in
    order (int steps, float and int values, a NaN, an evaluation's string value and
    ``task/metric`` names) and ``close()`` once without raising; built again in the same
    directory with ``resume_step`` set (a resumed run) it takes the later records again and
    closes; and it writes nothing into the working directory or next to the run directory
    (only into the run directory, or where its options say). A tracker whose optional package
    is missing (a ModuleNotFoundError raised while building it, also behind another error)
    is skipped with pytest's skip. ``device`` is accepted for a uniform signature and unused.
    """
    factory = _load(record)
    opts = build_options(record, options)
    config = _config(record, options)
    with tempfile.TemporaryDirectory(
        prefix="llmkit-check-logger-", ignore_cleanup_errors=True
    ) as tmp:
        root = Path(tmp).resolve()
        run_dir, cwd = root / "run", root / "cwd"
        run_dir.mkdir()
        cwd.mkdir()
        with _cwd(cwd):
            ctx = LoggerContext(run_dir, "check-logger", config)
            _write(record, factory, opts, ctx, RECORDS)
            _check_places(record, root, cwd, run_dir, "a new run")
            resumed = LoggerContext(run_dir, "check-logger", config, resume_step=RESUME_STEP)
            again = [r for r in RECORDS if r["step"] > RESUME_STEP]
            _write(record, factory, opts, resumed, again)
            _check_places(record, root, cwd, run_dir, "a resumed run")
