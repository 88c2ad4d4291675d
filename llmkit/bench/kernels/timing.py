"""Where and how a call is measured: devices and dtypes, per-call time, peak memory."""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from llmkit.hardware import cpu_name

CPU_MEMORY = "torch.profiler(profile_memory=True): peak of the CPU allocator's running total"
CUDA_MEMORY = "torch.cuda.max_memory_allocated above the allocation before the call"

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str, device: str) -> torch.dtype:
    """A dtype from its name; fp16 only on CUDA (CPU fp16 matmuls are 100× slower)."""
    dtype = DTYPES.get(name.lower())
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; expected float32, bfloat16 or float16")
    if dtype is torch.float16 and device != "cuda":
        raise ValueError("float16 needs a CUDA GPU (on a CPU use float32 or bfloat16)")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def default_dtype(device: str) -> torch.dtype:
    """bf16 on CUDA, fp32 on a CPU."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return cpu_name()


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on a CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    """Return cached CUDA memory between cases (a no-op on a CPU)."""
    if device == "cuda":
        torch.cuda.empty_cache()


def time_step(
    step: Callable[[], Any],
    device: str = "cpu",
    *,
    warmup: int = 2,
    repeats: int = 5,
    min_repeat_s: float = 0.005,
    max_number: int = 1000,
) -> tuple[list[float], int]:
    """Per-call seconds of ``repeats`` repeats (and the calls per repeat) after ``warmup``
    calls; each repeat runs enough calls to last about ``min_repeat_s``."""
    for _ in range(max(1, warmup)):
        step()
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    one = max(time.perf_counter() - t0, 1e-7)
    number = max(1, min(max_number, math.ceil(min_repeat_s / one)))
    samples = []
    for _ in range(max(1, repeats)):
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(number):
                step()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000 / number)
        else:
            t0 = time.perf_counter()
            for _ in range(number):
                step()
            samples.append((time.perf_counter() - t0) / number)
    return samples, number


def summarize(samples: list[float]) -> dict[str, Any]:
    """A record's timing fields from the per-call seconds of its repeats: ``median_s``,
    ``min_s``, ``max_s``, ``spread`` ((max − min) / median: how far apart the repeats lie,
    None with one repeat) and the repeats themselves, ``times_s``."""
    median = statistics.median(samples)
    lo, hi = min(samples), max(samples)
    spread = (hi - lo) / median if len(samples) > 1 and median > 0 else None
    return {
        "median_s": median,
        "min_s": lo,
        "max_s": hi,
        "spread": spread,
        "times_s": list(samples),
    }


def within_noise(a: dict[str, Any], b: dict[str, Any]) -> bool | None:
    """Whether two records' times are indistinguishable, so the ratio of their medians may
    be noise: the medians differ by no more than the two ranges of the repeats (slowest −
    fastest) together, which holds whenever the [min, max] ranges overlap. None when either
    has fewer than two repeats (no spread to judge by) or lacks the figures."""
    if min(a.get("repeats") or 0, b.get("repeats") or 0) < 2:
        return None
    keys = ("median_s", "min_s", "max_s")
    if any(not isinstance(r.get(k), int | float) for r in (a, b) for k in keys):
        return None
    noise = (a["max_s"] - a["min_s"]) + (b["max_s"] - b["min_s"])
    return bool(abs(a["median_s"] - b["median_s"]) <= noise)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's C++ start/stop lines)."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        sys.stderr.flush()
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def cpu_peak_allocated(step: Callable[[], Any]) -> int:
    """Peak bytes allocated by torch's CPU allocator during one call above those live before
    it: the peak of the running sum of the allocation (+) and free (−) events the profiler
    records with ``profile_memory=True``. Frees of tensors allocated before the call are not
    reported by torch, so they cannot lower the figure."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = step()
        del out
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    events.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return int(peak)


def peak_memory(step: Callable[[], Any], device: str = "cpu") -> int:
    """Peak bytes one call allocates above what was live before it (see the package
    docstring of :mod:`llmkit.bench.kernels`)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = step()
        del out
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    return cpu_peak_allocated(step)
