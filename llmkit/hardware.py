"""Device and precision choice, and the hardware peak used for MFU."""

from __future__ import annotations

import contextlib
import ctypes
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmkit.errors import LlmkitError
from llmkit.files import replacing

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets.
GPU_PEAKS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "4090": 165e12,
    "L4": 121e12,
}


def choose_device(requested: str = "auto") -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; otherwise the named device, checked."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise LlmkitError(f"train.device: unknown device {requested!r}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LlmkitError("train.device: cuda was asked for but no CUDA GPU is available")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise LlmkitError("train.device: mps was asked for but is not available")
    return device


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has native bf16 matrix instructions (AVX512-BF16 or AMX)."""
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


#: glibc's ``mallopt`` parameters (malloc.h) and the largest mmap threshold it accepts on a
#: 64-bit system (half its 64 MiB heap size).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 2**20
_reusing = False


def reuse_freed_memory() -> bool:
    """Have glibc's malloc serve blocks of up to 32 MiB from its heap and keep what is freed
    there, instead of mapping each large block afresh and unmapping it on free. A training
    step on a CPU allocates and frees the same activations every step; fresh mappings cost a
    page fault per 4 KiB on first touch, about 15 % of a bf16 baby-GPT step
    (docs/benchmarks.md). The process then keeps its peak heap. Returns whether the setting
    is in force (Linux with glibc only; idempotent)."""
    global _reusing
    if _reusing:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _reusing = bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    )
    return _reusing


#: ``auto`` trains in bf16 on a CPU with fast bf16 only when casting to bf16 and multiplying
#: at the model's feed-forward shape runs at least this much faster than the fp32 product:
#: below that the casts around every product eat the gain. Measured on a 2-core EPYC with
#: AVX512-BF16 (docs/benchmarks.md), product speed-up → whole training step, fp32 against
#: bf16: 4×64 model at 256 tokens a step, 0.83–1.02× → 10–12 ms against 15–16 ms; at 512
#: tokens 1.10–1.30× → 15 against 15–17 ms; nanoGPT's 4×128 shakespeare model at 768
#: tokens, 1.7–2.0× → 50–54 against 38 ms.
BF16_MIN_SPEEDUP = 1.5


def choose_precision(
    requested: str,
    device: torch.device,
    shape: tuple[int, int, int] | None = None,
    cache: Path | None = None,
) -> str:
    """Resolve ``auto``: bf16 where the hardware runs it fast, else fp32; never fp16 on a
    CPU. On a CPU with fast bf16, ``shape`` (tokens a micro-batch, d_model, the feed-forward
    width) narrows it to the models whose products gain enough from it
    (:func:`bf16_speedup`, at least :data:`BF16_MIN_SPEEDUP`)."""
    if requested == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
        if device.type == "cpu":
            if not cpu_has_fast_bf16():
                return "fp32"
            if shape is None:
                return "bf16"
            return "bf16" if bf16_speedup(shape, cache) >= BF16_MIN_SPEEDUP else "fp32"
        return "fp32"
    if requested == "fp16" and device.type != "cuda":
        raise LlmkitError(
            f"train.precision: fp16 needs a CUDA GPU (on {device.type} use bf16 or fp32)"
        )
    return requested


def bf16_speedup(shape: tuple[int, int, int], cache: Path | None = None) -> float:
    """fp32 time ÷ bf16 time of a (rows × inner) · (inner × outer) product on this CPU, the
    bf16 side including the casts of its input and output, as autocast runs it. The shape is
    capped at 1024 × 1024 × 4096 (larger products only gain more); the answer is kept in the
    JSON file ``cache`` like :func:`peak_flops`' (so a machine decides the same way each
    time)."""
    rows, inner, outer = min(shape[0], 1024), min(shape[1], 1024), min(shape[2], 4096)
    key = f"bf16 speedup {rows}x{inner}x{outer}"
    return _measured(cache, key, lambda: measure_bf16_speedup(rows, inner, outer))


def measure_bf16_speedup(rows: int, inner: int, outer: int, seconds: float = 0.1) -> float:
    """fp32 ÷ bf16 (with casts) time of one product, best of each over about ``seconds``,
    the two timed in turn."""
    gen = torch.Generator().manual_seed(0)  # leaves the global RNG (dropout, data) alone
    a, b = torch.randn(rows, inner, generator=gen), torch.randn(inner, outer, generator=gen)
    fp32, bf16 = best_seconds(
        [lambda: a @ b, lambda: (a.bfloat16() @ b.bfloat16()).float()], seconds
    )
    return fp32 / bf16


def best_seconds(runs: list[Callable[[], object]], seconds: float) -> list[float]:
    """The shortest time of each of ``runs`` after one warm-up call each, timed in turn
    until about ``seconds`` have passed (each at least once)."""
    for run in runs:
        run()
    best = [math.inf] * len(runs)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or math.inf in best:
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def autocast(device: torch.device, precision: str) -> Any:
    """The autocast context for a resolved precision (a no-op for fp32); resolve ``auto``
    with :func:`choose_precision` first."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in ("bf16", "fp16"):
        raise ValueError(f"autocast: unresolved precision {precision!r} (use choose_precision)")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def peak_flops(device: torch.device, precision: str, cache: Path | None = None) -> float | None:
    """Peak FLOP/s: the data-sheet figure for known GPUs; measured matmul speed on CPU, kept
    in the JSON file ``cache`` (when given) under the CPU, its thread count, torch's version
    and the dtype, so later runs on the same machine need not measure again."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAKS.items():
            if key in name:
                return peak if precision != "fp32" else None
        return None
    if device.type != "cpu":
        return None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return _measured(cache, str(dtype), lambda: measure_matmul_flops(dtype))


def _measured(cache: Path | None, what: str, measure: Callable[[], float]) -> float:
    """``measure()``, or the figure the JSON file ``cache`` keeps for ``what`` on this CPU,
    thread count and torch version (written there after a measurement)."""
    if cache is None:
        return measure()
    import json

    key = f"{cpu_name()}|threads {torch.get_num_threads()}|torch {torch.__version__}|{what}"
    known: Any = {}
    with contextlib.suppress(OSError, ValueError):
        known = json.loads(cache.read_text())
    if not isinstance(known, dict):
        known = {}
    value = known.get(key)
    if isinstance(value, float) and value > 0:
        return value
    value = measure()
    with contextlib.suppress(OSError):  # a cache that cannot be written costs a measurement
        cache.parent.mkdir(parents=True, exist_ok=True)
        with replacing(cache) as tmp:
            tmp.write_text(json.dumps({**known, key: value}))
    return value


def cpuinfo_field(keys: tuple[str, ...], cpuinfo: str | None = None) -> str | None:
    """The value of the first line of Linux ``/proc/cpuinfo`` (or of the text ``cpuinfo``)
    that starts with one of ``keys``; None where there is none or the file cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        if line.startswith(keys):
            return line.split(":", 1)[1].strip()
    return None


def cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else :func:`platform.processor`."""
    import platform

    return cpuinfo_field(("model name",)) or platform.processor() or platform.machine()


#: The CPU flags that decide matrix speed: AVX2 with FMA, AVX-512, AVX512-BF16, AMX.
MATRIX_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """Which of :data:`MATRIX_FLAGS` this CPU reports (``cpuinfo``: the text of Linux
    ``/proc/cpuinfo``, read if not given; none where it cannot be read), in that order, for
    the record of every measurement."""
    have = set((cpuinfo_field(("flags",), cpuinfo) or "").split())
    return [flag for flag in MATRIX_FLAGS if flag in have]


def measure_matmul_flops(dtype: torch.dtype, n: int = 512, seconds: float = 0.2) -> float:
    """Best observed FLOP/s of an n×n matmul on CPU over about ``seconds``."""
    gen = torch.Generator().manual_seed(0)  # leaves the global RNG (dropout, data) alone
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    (best,) = best_seconds([lambda: a @ b], seconds)
    return 2 * n**3 / best


def last_level_cache_bytes() -> int | None:
    """The CPU's largest cache in bytes (Linux sysfs), or None where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        with contextlib.suppress(ValueError):
            unit = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes) if sizes else None


def measure_read_bandwidth(
    device: torch.device | str = "cpu", nbytes: int | None = None, repeats: int = 5
) -> float:
    """Memory read bandwidth in bytes/s: the best of ``repeats`` sums of an fp32 tensor of
    ``nbytes`` (default: 8× the last-level cache, between 256 MiB and 1 GiB, so it streams
    from memory), with torch's current number of threads. Decoding streams the weights the
    same way, so weight bytes per step ÷ this is a decode speed no implementation beats."""
    device = torch.device(device)
    if nbytes is None:
        llc = last_level_cache_bytes() if device.type == "cpu" else None
        nbytes = min(max(8 * (llc or 0), 256 * 1024**2), 1024**3)
    x = torch.ones(max(nbytes // 4, 1), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x.sum()  # warm-up (pages touched, threads started)
    sync()
    best = float("inf")
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best
