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
window (W = 256) against dense causal attention (``sdpa`` and ``dense``) at N = 4096 in full
mode; ``-s`` prints the comparison, ``LLMKIT_BENCH_OUT=DIR`` also writes it as JSON.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from benchmarks.conftest import FULL
from llmkit.bench import kernels as bk
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

PAIR_SEQ, PAIR_WINDOW = (4096, 256) if FULL else (1024, 64)


@pytest.mark.parametrize("mode", bk.MODES)
def test_sliding_window_vs_dense_causal_cpu(mode):
    """Sliding window (W = 256) against dense causal attention at N = 4096, B = 1, H = 8,
    D = 64, fp32 on the CPU: time and peak memory (full mode; quick: N = 1024, W = 64)."""
    reg = get_registry()
    entries = [
        bk.Entry(f"sliding_window W={PAIR_WINDOW}", reg.get("attention", "sliding_window"),
                 {"window": PAIR_WINDOW}),
        bk.Entry("sdpa", reg.get("attention", "sdpa")),
        bk.Entry("dense", reg.get("attention", "dense")),
    ]  # fmt: skip
    records = bk.bench_kernels(
        "attention", entries, device="cpu", dtype=torch.float32, sizes=(PAIR_SEQ,),
        head_dims=(64,), modes=(mode,), batch=1, heads=8, warmup=1 if FULL else 0,
        repeats=5 if FULL else 1, min_repeat_s=0.0,
    )  # fmt: skip
    bk.add_ratios(records, "sdpa")
    print()
    print(bk.markdown_table(records, "sdpa"))
    out = os.environ.get("LLMKIT_BENCH_OUT")
    if out:
        meta = bk.meta("attention", "cpu", torch.float32, test="sliding_window_vs_dense_causal")
        bk.write_json(records, Path(out) / f"sliding-window-vs-dense-{mode}.json", meta)
    by = {r["component"]: r for r in records}
    assert all(r["status"] == "ok" for r in records), [r["reason"] for r in records]
    window, dense = by[entries[0].label], by["dense"]
    assert window["window"] == PAIR_WINDOW
    # Memory is deterministic: the window's O(N·W) beats the materialized N×N scores.
    assert window["peak_memory_bytes"] < dense["peak_memory_bytes"] / 2
    if FULL:
        assert window["median_s"] < dense["median_s"]
