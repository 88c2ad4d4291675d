"""Kill a training process and resume it: the helper the exact-resume tests share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT


def cli(*args: str) -> list[str]:
    """``python -m llmkit.cli ARGS``."""
    return [sys.executable, "-m", "llmkit.cli", *args]


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in read_metrics(run) if "loss" in m]


def val_losses(run: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["val_loss"]) for m in read_metrics(run) if "val_loss" in m]


def train_killed_and_resumed(
    spec: Path, tmp_path: Path, *, kill_at: int, plugins: str = ""
) -> tuple[Path, Path, int]:
    """Train ``spec`` uninterrupted into ``tmp_path/full``; train it again into
    ``tmp_path/killed``, SIGKILL that process once checkpoint ``kill_at`` (or later) is the
    latest, and resume it with ``llmkit train --resume``. Returns (full, killed, the step
    killed at); ``plugins`` is ``$LLMKIT_PLUGINS`` for every process."""
    env = {**os.environ, "LLMKIT_PLUGINS": plugins}
    common = ["--no-sample", "--no-progress"]
    full = tmp_path / "full"
    subprocess.run(
        cli("train", str(spec), "--out", str(full), *common),
        check=True,
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=600,
    )
    run = tmp_path / "killed"
    proc = subprocess.Popen(
        cli("train", str(spec), "--out", str(run), *common),
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pointer = run / "checkpoints" / "latest.json"
    deadline = time.time() + 300
    while time.time() < deadline:
        if pointer.is_file() and json.loads(pointer.read_text())["step"] >= kill_at:
            break
        assert proc.poll() is None, "training ended before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(pointer.read_text())["step"]
    subprocess.run(
        cli("train", "--resume", str(run), *common),
        check=True,
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=600,
    )
    return full, run, killed_at
