"""llmkit.kernels.native_build: any C source as a cached, ctypes-loaded library (the build
system under llmkit.kernels.window_native, here on a two-line source)."""

from __future__ import annotations

import ctypes

import pytest

from llmkit.kernels import native_build
from llmkit.kernels.native_build import FLAGS, NativeLibrary


@pytest.fixture
def source(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(tmp_path / "cache"))
    if native_build.compiler() is None:
        pytest.skip("no C compiler")
    path = tmp_path / "add.c"
    path.write_text("long add3(int a, int b, int c) { return (long)a + b + c; }\n")
    return path


def test_a_second_kernel_is_one_native_library(source, tmp_path):
    kernel = NativeLibrary("add", source, {"add3": (ctypes.c_long, [ctypes.c_int] * 3)})
    lib = kernel.load()
    assert lib is not None, kernel.unavailable_reason()
    assert lib.add3(1, 2, 3) == 6
    assert kernel.unavailable_reason() is None
    assert kernel.load() is lib  # kept
    (built,) = (tmp_path / "cache" / "kernels").glob("add-*.so")
    assert built == kernel.built_path(native_build.compiler(), kernel.builds[0])
    other = NativeLibrary("add", source, {}, libs=())
    assert other.library_name(native_build.compiler(), FLAGS) != kernel.library_name(
        native_build.compiler(), FLAGS
    )


def test_off_and_rejected(source, monkeypatch):
    kernel = NativeLibrary("add", source, {}, builds=[(*FLAGS, "--no-such-flag")])
    monkeypatch.setenv(native_build.ENV, "off")
    assert kernel.load() is None
    assert kernel.unavailable_reason() == "turned off by LLMKIT_NATIVE_KERNELS"
    monkeypatch.delenv(native_build.ENV)
    assert kernel.load() is None
    assert kernel.unavailable_reason().startswith("build failed: ")
    kernel.forget()
    assert kernel.load() is None
    assert kernel.unavailable_reason().startswith("build failed earlier: ")
