"""The trial processes of a sweep: GPUs shared out, death with the sweep, and what their
logs say (why a trial stopped, its error)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path


def visible_gpus() -> int:
    """CUDA devices to share out among workers (one each, round robin); 0 when
    ``CUDA_VISIBLE_DEVICES`` is set already (it is kept) or there is no GPU."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to send the trial SIGTERM when the sweep dies (so it
    saves a checkpoint and ends, instead of training on unseen); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    set_pdeathsig = 1  # PR_SET_PDEATHSIG

    def setup() -> None:
        prctl(set_pdeathsig, int(signal.SIGTERM))

    return setup


def log_tail(path: Path, start: int) -> list[str]:
    """The lines a trial's attempt wrote to its log (from byte ``start``)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]


def stop_reason(lines: list[str]) -> str | None:
    """Why ``llmkit train`` ended, from its ``done: ... (reason); val loss`` line."""
    for line in reversed(lines):
        if line.startswith("done: ") and "); val loss" in line:
            return line.rpartition("); val loss")[0].rpartition("(")[2]
    return None


def error_line(lines: list[str], rc: int) -> str:
    """A failed trial's error: the CLI's ``error:`` line, else the last line it wrote (an
    exception's), else how it ended."""
    for line in reversed(lines):
        if line.startswith("error: "):
            return line.removeprefix("error: ")[:500]
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-rc).name}"
    tail = [line for line in lines if not line.startswith("===")]
    return tail[-1][:500] if tail else f"exit status {rc}"
