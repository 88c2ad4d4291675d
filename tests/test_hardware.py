"""The CPU peak for MFU: measured once per machine, thread count, torch and dtype."""

from __future__ import annotations

import json
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
