"""Test set-up: installed third-party plugins are not loaded unless a test asks for them."""

from __future__ import annotations

import os

os.environ["LLMKIT_PLUGINS"] = ""  # only the built-in plugin
os.environ.pop("LLMKIT_STRICT_PLUGINS", None)
os.environ.pop("LLMKIT_REGISTRY", None)

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one thread is faster, and immune to OpenMP contention on a busy machine.
    Use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_registry():
    """A process registry reloaded from scratch, dropped again afterwards."""
    from llmkit.registry import reset_registry

    reset_registry()
    yield
    reset_registry()


def _import_triton_for_the_interpreter() -> None:
    """Without a CUDA GPU, import triton with TRITON_INTERPRET=1, then restore the variable.

    Triton builds its language library (tl.zeros, tl.sum, ...) interpreted or compiled once,
    when first imported; compiled Triton cannot run without a GPU anyway. Kernels still run in
    the interpreter only while a test sets TRITON_INTERPRET=1 (llmkit.kernels.runtime reads it
    per call; the kernel modules jit lazily per mode); everything else keeps the fast
    reference paths.
    """
    import sys

    import torch

    if torch.cuda.is_available() or "triton" in sys.modules:
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except Exception:  # triton absent on this platform
        pass
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


_import_triton_for_the_interpreter()
