"""Kernel benchmarks: every registered component of every benchmarkable kind (attention, ffn,
norm, and any plugin kind whose registry record names a bench adapter), forward and
forward+backward, with TFLOP/s (GB/s for norms), peak memory, device and dtype in
``extra_info`` (see :mod:`llmkit.bench.kernels` for the FLOP counts and the memory measure).

Parametrized over the registry at collection time: a plugin's kernel (or kind) joins without
edits here, and a component that cannot run a case (a capability, options, or an exception it
raises) is skipped with its reason. The cases are the kind's adapter's: quick mode (default;
CI runs ``pytest benchmarks --benchmark-disable``) takes the smallest of its quick sizes (N = 64
for attention, 64 tokens for ffn and norm); ``LLMKIT_BENCH=full`` sweeps its full sizes (N =
256…4096 on a CPU or 512…8192 on a GPU at head dims 64 and 128; ``--benchmark-json FILE``
keeps extra_info). The device is CUDA when one is visible, else the CPU
(``LLMKIT_BENCH_DEVICE`` overrides).

``test_sliding_window_vs_dense_causal_cpu`` is the issue's CPU target: block-local sliding
window (W = 256) against dense causal attention (``sdpa``, and ``dense`` up to N = 4096) at
N = 4096 and 16384 in full mode, timed side by side in interleaved rounds; ``-s`` prints the
comparison, ``LLMKIT_BENCH_OUT=DIR`` also writes it as JSON. For the issue's 2 threads run
``LLMKIT_BENCH=full pytest benchmarks/kernels/test_kernels.py -k sliding_window_vs -s`` on a
2-core machine (or with ``OMP_NUM_THREADS=2``).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.conftest import FULL
from llmkit.bench import kernels as bk
from llmkit.kernels import native_build, window_native
from llmkit.registry import get_registry

DEVICE = os.environ.get("LLMKIT_BENCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = bk.default_dtype(DEVICE)
HEAD_DIMS = bk.HEAD_DIMS
D_MODEL = bk.D_MODEL[DEVICE] if FULL else 64


@pytest.fixture(autouse=True, scope="module")
def _threads():
    """Quick mode on a CPU: one thread (tiny ops only wait on each other's barriers)."""
    before = torch.get_num_threads()
    if not FULL and DEVICE == "cpu":
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cases() -> list:
    """(adapter, entry, case) of every benchmarkable kind's components, as the kind's bench
    adapter sweeps them."""
    params = []
    for kind in bk.benchmarkable_kinds():
        adapter = bk.adapter_for(kind)
        full = adapter.sizes.get(DEVICE) or adapter.quick_sizes
        sizes = full if FULL else adapter.quick_sizes[:1]
        dims = HEAD_DIMS if adapter.head_dims else (None,)
        for entry in bk.entries(kind):
            for mode in bk.MODES:
                for hd in dims:
                    for size in sizes:
                        case = bk.Case(mode, size, hd, DEVICE, DTYPE, d_model=D_MODEL)
                        name = f"{kind}-{entry.label}-{mode}" + (f"-D{hd}" if hd else "")
                        params.append(pytest.param(adapter, entry, case, id=f"{name}-{size}"))
    return params


def _run(benchmark, prepared: bk.Prepared) -> None:
    step = prepared.step
    if DEVICE == "cuda":

        def step():
            prepared.step()
            torch.cuda.synchronize()

    benchmark(step)
    info = benchmark.extra_info
    info.update(device=DEVICE, device_name=bk.device_name(DEVICE), dtype=bk.dtype_name(DTYPE))
    info.update({k: v for k, v in prepared.info.items() if v is not None})
    info["flops"] = prepared.flops
    info["peak_memory_bytes"] = bk.peak_memory(prepared.step, DEVICE)
    if benchmark.stats:
        median = benchmark.stats.stats.median
        if prepared.flops:
            info["TFLOP/s"] = prepared.flops / median / 1e12
        if prepared.bytes_moved:
            info["GB/s"] = prepared.bytes_moved / median / 1e9


def _prepare(fn, *args, **kwargs) -> bk.Prepared:
    try:
        return fn(*args, **kwargs)
    except bk.Unsupported as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize(("adapter", "entry", "case"), _cases())
def test_kernel(benchmark, adapter, entry, case):
    prepared = _prepare(adapter.prepare, entry, case)
    _run(benchmark, prepared)
    assert (prepared.flops or prepared.bytes_moved) > 0
    assert benchmark.extra_info["peak_memory_bytes"] > 0


# -- the CPU target: block-local sliding window vs dense causal attention ------------

#: Full mode: the issue's shapes (B 1, H 8, D 64, fp32, W 256) at N 4096 and 16384; quick
#: mode (CI): one tiny case.
PAIR_SEQS, PAIR_WINDOW = ((4096, 16384), 256) if FULL else ((1024,), 64)
PAIR_REPEATS = 5 if FULL else 1
#: ``dense`` materializes the N×N scores: only up to this N (16384 would need 8 GiB a head).
DENSE_MAX_SEQ = 4096


def _window_path() -> str:
    """Which path ``sliding_window`` takes on fp32 CPU tensors here."""
    if window_native.library() is not None:
        return "compiled C kernel (llmkit.kernels.window_native)"
    return f"block-local PyTorch ({window_native.unavailable_reason()})"


def _without_native(step: Any) -> Any:
    """``step`` with the compiled window kernel turned off for the call."""

    def run() -> Any:
        before = os.environ.get(native_build.ENV)
        os.environ[native_build.ENV] = "0"
        try:
            return step()
        finally:
            if before is None:
                del os.environ[native_build.ENV]
            else:
                os.environ[native_build.ENV] = before

    return run


def _interleaved(steps: dict[str, Any], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each step, timed in alternating rounds (one call of each per
    round), so that load from other processes spreads evenly over the candidates."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return times


@pytest.mark.parametrize("seq", PAIR_SEQS)
@pytest.mark.parametrize("mode", bk.MODES)
def test_sliding_window_vs_dense_causal_cpu(mode, seq):
    """Sliding window (W = 256) against dense causal attention (``sdpa``: torch's fused
    kernel, O(N) memory; ``dense``: materialized scores, N ≤ 4096) at B = 1, H = 8, D = 64,
    fp32 on the CPU, N = 4096 and 16384 (full mode; quick: N = 1024, W = 64), and, where the
    compiled kernel runs, the block-local PyTorch path on the same inputs: time in
    interleaved rounds (median and min of 5) and peak memory, on torch's current thread
    count. No timed assertions: the numbers are printed (``-s``) and, with
    ``LLMKIT_BENCH_OUT=DIR``, written as JSON."""
    reg = get_registry()
    entries = [
        bk.Entry(f"sliding_window W={PAIR_WINDOW}", reg.get("attention", "sliding_window"),
                 {"window": PAIR_WINDOW}),
        bk.Entry("sdpa", reg.get("attention", "sdpa")),
    ]  # fmt: skip
    if seq <= DENSE_MAX_SEQ:
        entries.append(bk.Entry("dense", reg.get("attention", "dense")))
    adapter = bk.adapter_for("attention")
    case = bk.Case(mode, seq, 64, "cpu", torch.float32, True, 1, 8)
    prepared = {e.label: adapter.prepare(e, case) for e in entries}
    path = _window_path()
    if window_native.library() is not None:  # the PyTorch path beside it, on the same inputs
        window = prepared[entries[0].label]
        pytorch = dataclasses.replace(window, step=_without_native(window.step))
        labels = list(prepared)
        prepared = {labels[0]: window, f"{labels[0]}, PyTorch path": pytorch} | {
            label: prepared[label] for label in labels[1:]
        }
    times = _interleaved(
        {label: p.step for label, p in prepared.items()},
        repeats=PAIR_REPEATS,
        warmup=1 if FULL else 0,
    )
    memory = {label: bk.peak_memory(p.step, "cpu") for label, p in prepared.items()}
    base = statistics.median(times["sdpa"]), min(times["sdpa"]), memory["sdpa"]
    records = []
    for label, samples in times.items():
        med, low = statistics.median(samples), min(samples)
        records.append({
            "component": label, "mode": mode, "seq_len": seq, "window": PAIR_WINDOW,
            "batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32",
            "threads": torch.get_num_threads(), "repeats": len(samples),
            "median_s": med, "min_s": low, "samples_s": samples,
            "time_vs_sdpa_median": med / base[0], "time_vs_sdpa_min": low / base[1],
            "flops": prepared[label].flops, "peak_memory_bytes": memory[label],
            "memory_vs_sdpa": memory[label] / base[2], "window_path": path,
        })  # fmt: skip
    print(f"\n{mode}, N = {seq}, B 1 H 8 D 64 fp32, {torch.get_num_threads()} threads, "
          f"{len(times['sdpa'])} interleaved rounds, load {os.getloadavg()[0]:.1f}; "
          f"sliding_window: {path}")  # fmt: skip
    print("| component | median | min | × sdpa (median) | × sdpa (min) | peak memory |")
    print("|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['component']} | {r['median_s'] * 1e3:.1f} ms | {r['min_s'] * 1e3:.1f} ms "
              f"| {r['time_vs_sdpa_median']:.3f} | {r['time_vs_sdpa_min']:.3f} "
              f"| {r['peak_memory_bytes'] / 2**20:.1f} MiB |")  # fmt: skip
    out = os.environ.get("LLMKIT_BENCH_OUT")
    if out:
        meta = bk.meta("attention", "cpu", torch.float32, test="sliding_window_vs_dense_causal")
        bk.write_json(records, Path(out) / f"sliding-window-vs-dense-{mode}-{seq}.json", meta)
    window = records[0]
    assert window["window"] == PAIR_WINDOW and all(r["median_s"] > 0 for r in records)
    # Memory is deterministic. The window's is O(N·D): the output (and the three gradients)
    # plus step-sized buffers, never N×N.
    outputs = (1 if mode == "fwd" else 4) * 8 * seq * 64 * 4
    assert window["peak_memory_bytes"] < outputs + 64 * 2**20, window["peak_memory_bytes"]
    if seq <= DENSE_MAX_SEQ:
        assert window["peak_memory_bytes"] < records[-1]["peak_memory_bytes"] / 2
