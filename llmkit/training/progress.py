"""What a training run shows while it runs, and how it is asked to stop: the progress bar
(or one log line per logged step) and SIGINT/SIGTERM handling."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from typing import Any


def _hms(seconds: float) -> str:
    """``1:02:03`` for an hour and a bit, ``2:03`` under an hour."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _per_step(seconds: float) -> str:
    """``1.23 s/step`` from a second up, ``45.6 ms/step`` below."""
    if seconds >= 1:
        return f"{seconds:.2f} s/step"
    return f"{1000 * seconds:.3g} ms/step"


class ProgressDisplay:
    """A rich progress bar on a terminal (or when ``enabled``), else a log line per record.
    While the bar runs, ``log`` (when it is ``print``) goes through the bar's console.
    Off the bar, each line carries the time per step since the previous line and an ETA
    from the mean step time since this job started (a resumed run counts from its resume)."""

    def __init__(
        self,
        total: int,
        completed: int,
        log: Callable[[str], None],
        enabled: bool | None = None,
        *,
        objective: str = "cross_entropy",
    ) -> None:
        self.total = total
        #: The training loss's label: ``loss`` for the cross-entropy, else the objective,
        #: named (``objective distill 3.3200``), so it is not read as a cross-entropy.
        self.loss_label = "loss" if objective == "cross_entropy" else f"objective {objective}"
        self.log = log
        self._start_step = self._last_step = completed
        self._start_time = self._last_time = time.monotonic()
        self.bar = self._start(completed, enabled)
        if self.bar is not None and log is print:
            self.log = self.bar.console.print

    def _start(self, completed: int, enabled: bool | None) -> Any:
        if enabled is False:
            return None
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        console = Console(stderr=True)
        if not (console.is_terminal if enabled is None else enabled):
            return None
        bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        bar.start()
        bar.add_task("train", total=self.total, completed=completed, info="")
        return bar

    def show(self, record: dict[str, Any]) -> None:
        info = (
            f"{self.loss_label} {record['loss']:.4f} lr {record['lr']:.2e} "
            f"{record['tokens_per_s']:.0f} tok/s"
        )
        if "trained_tokens_per_s" in record:  # padding or masked prompts: what is learned
            info += f" ({record['trained_tokens_per_s']:.0f} trained)"
        if "mfu" in record:
            info += f" mfu {100 * record['mfu']:.1f}%"
        if self.bar is None:
            self.log(f"step {record['step']}/{self.total}: {info}{self._timing(record['step'])}")
        else:
            self.bar.update(0, completed=record["step"], info=info)

    def _timing(self, step: int) -> str:
        """`` · 12.3 ms/step · ETA 1:05`` for a line at ``step``; empty before any step ran."""
        now = time.monotonic()
        if step <= self._last_step:
            return ""
        recent = (now - self._last_time) / (step - self._last_step)
        mean = (now - self._start_time) / (step - self._start_step)
        self._last_step, self._last_time = step, now
        return f" · {_per_step(recent)} · ETA {_hms(mean * max(0, self.total - step))}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class StopSignals:
    """SIGINT/SIGTERM set ``received`` (the signal's name) instead of killing the process,
    so the run stops after the current step and saves a checkpoint; ``restore`` puts the
    previous handlers back."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.received: str | None = None
        self._log = log
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            self.received = signal.Signals(signum).name
            self._log(f"{self.received}: stopping after this step and saving a checkpoint")

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread
                self._old[sig] = signal.signal(sig, handler)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
