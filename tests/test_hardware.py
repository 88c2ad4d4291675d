"""The CPU peak for MFU: measured once per machine, thread count, torch and dtype."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from llmkit import hardware


def test_cpu_peak_is_measured_once_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cache = tmp_path / "peaks" / "cpu-peaks.json"
    calls: list[torch.dtype] = []

    def measure(dtype: torch.dtype) -> float:
        calls.append(dtype)
        return 1.5e11 if dtype == torch.float32 else 6e11

    monkeypatch.setattr(hardware, "measure_matmul_flops", measure)
    cpu = torch.device("cpu")
    assert hardware.peak_flops(cpu, "fp32", cache) == 1.5e11
    assert hardware.peak_flops(cpu, "fp32", cache) == 1.5e11
    assert hardware.peak_flops(cpu, "bf16", cache) == 6e11
    assert calls == [torch.float32, torch.bfloat16]  # each dtype measured once
    kept = json.loads(cache.read_text())
    assert len(kept) == 2 and all(hardware.cpu_name() in key for key in kept)
    threads = torch.get_num_threads()
    try:  # another thread count is another measurement
        torch.set_num_threads(1 if threads > 1 else 2)
        hardware.peak_flops(cpu, "fp32", cache)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 3
    assert hardware.peak_flops(cpu, "fp32") == 1.5e11 and len(calls) == 4  # no cache: measured


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"x": "y"}'])
def test_a_damaged_peak_cache_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str
):
    cache = tmp_path / "cpu-peaks.json"
    cache.write_text(content)
    monkeypatch.setattr(hardware, "measure_matmul_flops", lambda dtype: 2e11)
    assert hardware.peak_flops(torch.device("cpu"), "fp32", cache) == 2e11
    assert 2e11 in json.loads(cache.read_text()).values()


def test_an_unwritable_peak_cache_still_gives_the_peak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setattr(hardware, "measure_matmul_flops", lambda dtype: 3e11)
    assert hardware.peak_flops(torch.device("cpu"), "fp32", blocked / "cpu-peaks.json") == 3e11


_KEPT = """
import ctypes, sys, torch
from llmkit import hardware
assert hardware.reuse_freed_memory() and hardware.reuse_freed_memory()
class Info(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in names.split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
for _ in range(3):  # a step's activations: 8 × 16 MiB, allocated, touched, freed
    blocks = [torch.empty(4 << 20).fill_(1.0) for _ in range(8)]
    del blocks
print(libc.mallinfo2().fordblks)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activations_stay_in_mallocs_heap_for_the_next_step():
    if not hardware.reuse_freed_memory():
        pytest.skip("no glibc mallopt (musl?)")
    run = subprocess.run([sys.executable, "-c", _KEPT], capture_output=True, text=True)
    if "mallinfo2" in run.stderr:
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.split()[-1]) >= 8 * (16 << 20)  # heap blocks, free, not unmapped


def test_reusing_freed_memory_sets_mallocs_thresholds_once(monkeypatch):
    calls: list[tuple[int, int]] = []

    def mallopt(param: int, value: int) -> int:
        calls.append((param, value))
        return 1

    libc = types.SimpleNamespace(mallopt=mallopt)
    monkeypatch.setattr(hardware, "_reusing", False)
    monkeypatch.setattr(hardware.sys, "platform", "linux")
    monkeypatch.setattr(hardware.ctypes, "CDLL", lambda name: libc)
    assert hardware.reuse_freed_memory() and hardware.reuse_freed_memory()
    # M_MMAP_THRESHOLD (−3) at glibc's 64-bit maximum, M_TRIM_THRESHOLD (−1) never reached
    assert calls == [(-3, 32 << 20), (-1, 2**31 - 1)]
    monkeypatch.setattr(hardware, "_reusing", False)
    monkeypatch.setattr(hardware.sys, "platform", "darwin")
    assert not hardware.reuse_freed_memory()


@pytest.mark.parametrize(("speedup", "want"), [(2.0, "bf16"), (1.2, "fp32")])
def test_auto_takes_bf16_on_a_cpu_only_where_the_models_products_gain(
    monkeypatch, tmp_path, speedup, want
):
    cpu = torch.device("cpu")
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: True)
    measured: list[tuple[int, int, int]] = []

    def measure(rows, inner, outer, seconds=0.1):
        measured.append((rows, inner, outer))
        return speedup

    monkeypatch.setattr(hardware, "measure_bf16_speedup", measure)
    cache = tmp_path / "peaks.json"
    assert hardware.choose_precision("auto", cpu) == "bf16"  # no shape: the hardware alone
    assert hardware.choose_precision("auto", cpu, (768, 128, 512), cache) == want
    assert hardware.choose_precision("auto", cpu, (768, 128, 512), cache) == want
    assert measured == [(768, 128, 512)]  # the second answer came from the cache
    hardware.choose_precision("auto", cpu, (8192, 4096, 16384), cache)
    assert measured[-1] == (1024, 1024, 4096)  # capped
    assert hardware.choose_precision("fp32", cpu, (768, 128, 512), cache) == "fp32"
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: False)
    assert hardware.choose_precision("auto", cpu, (4096, 384, 1536), cache) == "fp32"


def test_cpu_flags_name_the_matrix_flags_in_a_fixed_order():
    """From /proc/cpuinfo's flags line, the matrix-relevant ones, in MATRIX_FLAGS order."""
    info = "model name\t: Some CPU\nflags\t\t: fpu amx_tile sse2 avx512_bf16 avx2 fma\n"
    assert hardware.cpu_flags(info) == ["avx2", "fma", "avx512_bf16", "amx_tile"]
    assert hardware.cpu_flags("model name\t: no flags line\n") == []
    here = hardware.cpu_flags()
    assert set(here) <= set(hardware.MATRIX_FLAGS)
    if Path("/proc/cpuinfo").exists() and "avx2" in Path("/proc/cpuinfo").read_text():
        assert "avx2" in here
