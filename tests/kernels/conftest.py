"""Kernel tests: the real Triton kernels, in the interpreter when there is no GPU.

Our kernels are jitted lazily, once per mode, so ``TRITON_INTERPRET=1`` only has to be set
while a test runs (the ``interpret`` fixture, through monkeypatch); the rest of a session keeps
the fast PyTorch reference paths. Triton's own jitted helpers (``tl.sum``, ``tl.max`` …) are
built once, when ``triton`` is first imported, in the mode of that moment: tests/conftest.py
imports it for the interpreter when there is no GPU. If triton was imported earlier in
compiled mode, the interpreter cannot run in this process: ``interpret`` skips, and
``rerun_in_interpreter`` reruns the test module in a child started with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.common import CUDA, interpreter_ready


@pytest.fixture
def interpret(monkeypatch):
    """Run Triton kernels in the interpreter for this test, unless a CUDA GPU is present."""
    if CUDA:
        return
    if not interpreter_ready():
        pytest.skip("triton was imported in compiled mode; see test_in_interpreter_subprocess")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def rerun_in_interpreter():
    """``rerun(path)``: where this process cannot interpret Triton, run the test module at
    ``path`` in a child process under ``TRITON_INTERPRET=1`` and require it to pass."""

    def rerun(path: str) -> None:
        if CUDA or interpreter_ready():
            pytest.skip("this process runs the kernels itself")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        root = Path(__file__).resolve().parents[2]
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

    return rerun
