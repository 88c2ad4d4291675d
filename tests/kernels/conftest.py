"""Kernel tests: the real Triton kernels, compiled on a CUDA GPU, interpreted on CPU without one.

``kernel_device`` is where a test runs the kernels. With a CUDA GPU (``common.GPU``: CUDA
present, and the session not started under ``TRITON_INTERPRET=1``) it is ``cuda``, and the
compiled kernels run on CUDA tensors. Without one it is ``cpu`` with ``TRITON_INTERPRET=1``
set for the test (through monkeypatch), so the kernels run in the Triton interpreter.

Interpreter details: our kernels are jitted lazily, once per mode, so ``TRITON_INTERPRET=1``
only has to be set while a test runs; the rest of a session keeps the fast PyTorch reference
paths. Triton's own jitted helpers (``tl.sum``, ``tl.max`` …) are built once, when ``triton`` is
first imported, in the mode of that moment: tests/conftest.py imports it for the interpreter
when there is no CUDA. If triton was imported earlier in compiled mode on a machine without a
GPU, the interpreter cannot run in this process: ``kernel_device`` skips, and
``rerun_in_interpreter`` reruns the test module in a child started with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.common import GPU, interpreter_ready


@pytest.fixture
def kernel_device(monkeypatch) -> torch.device:
    """Where this test runs the Triton kernels: ``cuda`` (compiled) with a GPU, else ``cpu``
    under ``TRITON_INTERPRET=1`` (the interpreter, set for this test only)."""
    if GPU:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return torch.device("cuda")
    if not interpreter_ready():
        pytest.skip("triton was imported in compiled mode: test_in_interpreter_subprocess runs it")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch.device("cpu")


@pytest.fixture
def rerun_in_interpreter():
    """``rerun(path)``: where this process can run the kernels neither compiled (no GPU) nor
    interpreted (triton was imported in compiled mode), run the test module at ``path`` in a
    child process under ``TRITON_INTERPRET=1`` and require it to pass; else skip, saying why."""

    def rerun(path: str) -> None:
        if GPU:
            pytest.skip("CUDA is present: this process runs the compiled kernels on the GPU")
        if interpreter_ready():
            pytest.skip("the interpreter runs the kernels in this process")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        root = Path(__file__).resolve().parents[2]
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        tail = (proc.stdout + proc.stderr)[-6000:]
        assert proc.returncode == 0 and " passed" in proc.stdout, tail

    return rerun
