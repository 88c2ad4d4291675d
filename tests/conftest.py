"""Test set-up: installed third-party plugins are not loaded unless a test asks for them."""

from __future__ import annotations

import os

os.environ["LLMKIT_PLUGINS"] = ""  # only the built-in plugin
os.environ.pop("LLMKIT_STRICT_PLUGINS", None)
os.environ.pop("LLMKIT_REGISTRY", None)

import atexit
import shutil
import tempfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
#: The deliberately broken plugin: never installed where the user works (``make test``
#: uninstalls an old install); tests that need it install it throwaway, see below.
BROKEN_FIXTURE = ROOT / "plugins" / "llmkit-broken-fixture"
#: The shared data cache (llmkit.data.store) of fixtures wider than a test; each test has its
#: own (below), so no test takes what another prepared, and ~/.cache is never touched.
os.environ["LLMKIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="llmkit-test-cache-")
atexit.register(shutil.rmtree, os.environ["LLMKIT_CACHE_DIR"], True)


@pytest.fixture(autouse=True)
def _own_data_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """A shared data cache for this test alone."""
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(tmp_path_factory.mktemp("llmkit-cache")))


def install_broken_fixture(site: Path) -> Path:
    """Install the broken-plugin fixture into the directory ``site`` as pip would (its module
    and a ``.dist-info`` with its entry points), without touching the environment; ``site``
    on ``sys.path`` (or ``PYTHONPATH``) makes its entry point visible."""
    meta = tomllib.loads((BROKEN_FIXTURE / "pyproject.toml").read_text())["project"]
    module = "llmkit_broken_fixture"
    shutil.copytree(
        BROKEN_FIXTURE / module, site / module, ignore=shutil.ignore_patterns("__pycache__")
    )
    info = site / f"{module}-{meta['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n"
    )
    eps = meta["entry-points"]["llmkit"]
    (info / "entry_points.txt").write_text(
        "[llmkit]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
    )
    return site


@pytest.fixture
def broken_fixture_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The broken-plugin fixture installed for this test only, in a throwaway site directory
    put on ``sys.path`` (pass it as ``PYTHONPATH`` to a subprocess)."""
    site = install_broken_fixture(tmp_path / "broken-fixture-site")
    monkeypatch.syspath_prepend(str(site))
    return site


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
