"""The sweep: every entry of a kind on every case its adapter defines, one record each, and
the ratios against a baseline."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from llmkit.bench.kernels.adapters import D_MODEL, HEAD_DIMS, Case, KernelBench, adapter_for
from llmkit.bench.kernels.entries import Entry, Unsupported
from llmkit.bench.kernels.flops import MODES, mode_factor
from llmkit.bench.kernels.timing import (
    CPU_MEMORY,
    CUDA_MEMORY,
    default_dtype,
    device_name,
    dtype_name,
    free,
    peak_memory,
    summarize,
    time_step,
    within_noise,
)
from llmkit.errors import first_line

#: Record fields that tell cases apart, besides the adapter's columns (add_ratios).
CASE_FIELDS = ("kind", "device", "dtype", "mode", "batch", "heads", "seq_len", "head_dim")
CASE_FIELDS += ("causal", "tokens", "d_model")


def bench_kernels(
    kind: str,
    entry_list: Sequence[Entry],
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    sizes: Sequence[int] | None = None,
    head_dims: Sequence[int] = HEAD_DIMS,
    modes: Sequence[str] = MODES,
    causal: bool = True,
    batch: int | None = None,
    heads: int | None = None,
    d_model: int | None = None,
    warmup: int = 2,
    repeats: int = 5,
    min_repeat_s: float = 0.005,
    memory: bool = True,
    deadline: float | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    registry: Any = None,
) -> list[dict[str, Any]]:
    """Time every entry on every case of ``kind``, as the kind's bench adapter defines them:
    ``sizes`` are its x axis (sequence lengths for attention, token counts for ffn and norm;
    default: the adapter's sweep for ``device``), ``head_dims`` apply to adapters that sweep
    them. Returns one record per (entry, mode, size[, head dim]); a case an entry cannot run
    is a ``skipped`` record with the reason, an unexpected exception an ``error`` record.
    ``deadline`` (``time.monotonic()``) skips what is left after it. A kind without an
    adapter raises :class:`~llmkit.bench.kernels.NotBenchmarkable`."""
    adapter = adapter_for(kind, registry)
    for m in modes:
        mode_factor(m, backward=1.0)
    dtype = dtype or default_dtype(device)
    if sizes is None:
        sizes = adapter.sizes.get(device) or adapter.quick_sizes
    d_model = d_model or D_MODEL[device]
    common = {
        "kind": kind,
        "device": device,
        "device_name": device_name(device),
        "dtype": dtype_name(dtype),
        "threads": torch.get_num_threads(),
    }
    cases = [
        Case(mode, size, hd, device, dtype, causal, batch, heads, d_model)
        for mode in modes
        for hd in (head_dims if adapter.head_dims else (None,))
        for size in sizes
    ]
    out = []
    for case in cases:
        for entry in entry_list:
            rec = _bench_one(
                adapter, entry, case, common, warmup=warmup, repeats=repeats,
                min_repeat_s=min_repeat_s, memory=memory, deadline=deadline,
            )  # fmt: skip
            out.append(rec)
            if on_record is not None:
                on_record(rec)
    return out


def _bench_one(
    adapter: KernelBench,
    entry: Entry,
    case: Case,
    common: dict[str, Any],
    *,
    warmup: int,
    repeats: int,
    min_repeat_s: float,
    memory: bool,
    deadline: float | None,
) -> dict[str, Any]:
    fields = adapter.fields(case)
    rec: dict[str, Any] = {
        **common,
        "component": entry.label,
        "name": entry.record.name,
        "provider": getattr(entry.record, "provider", "?"),
        "options": dict(entry.options),
        "mode": case.mode,
        **fields,
    }
    rec.update(status="ok", reason=None, median_s=None, min_s=None, max_s=None, spread=None)
    rec.update(times_s=[], repeats=0, number=0)
    rec.update(flops=None, tflops=None, gbps=None, peak_memory_bytes=None)
    rec["memory_method"] = CUDA_MEMORY if case.device == "cuda" else CPU_MEMORY
    if deadline is not None and time.monotonic() > deadline:
        rec.update(status="skipped", reason="time budget used up")
        return rec
    prepared = None
    # The entry's context is entered once around everything, not per call (its own cost,
    # ~10-20 µs, would otherwise count against short calls).
    stack = contextlib.ExitStack()
    bare = dataclasses.replace(entry, context=None)
    try:
        if entry.context is not None:
            stack.enter_context(entry.context())
        prepared = adapter.prepare(bare, case)
        rec.update({k: v for k, v in prepared.info.items() if k in fields})
        samples, number = time_step(
            prepared.step, case.device, warmup=warmup, repeats=repeats, min_repeat_s=min_repeat_s
        )
        rec.update(summarize(samples), repeats=len(samples), number=number)
        median = rec["median_s"]
        rec["flops"] = prepared.flops
        if prepared.flops:
            rec["tflops"] = prepared.flops / median / 1e12
        if prepared.bytes_moved:
            rec["gbps"] = prepared.bytes_moved / median / 1e9
        if memory:
            rec["peak_memory_bytes"] = peak_memory(prepared.step, case.device)
    except Unsupported as exc:
        rec.update(status="skipped", reason=str(exc))
    except torch.OutOfMemoryError:
        rec.update(status="skipped", reason="out of memory")
    except Exception as exc:
        rec.update(status="error", reason=first_line(exc, typed=True))
    finally:
        stack.close()
        del prepared
        free(case.device)
    return rec


def _case_key(rec: dict[str, Any], columns: dict[str, tuple[str, ...]]) -> tuple[Any, ...]:
    return tuple(rec.get(f) for f in (*CASE_FIELDS, *columns[rec["kind"]]))


def add_ratios(records: list[dict[str, Any]], baseline: str | None) -> list[dict[str, Any]]:
    """Set ``speedup`` (baseline median / median) and ``memory_ratio`` (baseline peak /
    peak) on every ok record whose case the ``baseline`` entry also ran; None elsewhere.
    ``within_noise`` says whether the speed-up is indistinguishable from noise
    (:func:`~llmkit.bench.kernels.timing.within_noise`: the two medians differ by no more
    than the two ranges of the repeats, slowest − fastest, together); None for the baseline
    itself, without a baseline, or with a single repeat."""
    kinds = {r["kind"] for r in records}
    columns = {k: tuple(c.field for c in adapter_for(k).columns) for k in kinds}
    base = {
        _case_key(r, columns): r
        for r in records
        if baseline is not None and r["component"] == baseline and r["status"] == "ok"
    }
    for r in records:
        b = base.get(_case_key(r, columns)) if r["status"] == "ok" else None
        r["baseline"] = baseline if b is not None else None
        r["speedup"] = b["median_s"] / r["median_s"] if b is not None else None
        r["within_noise"] = within_noise(r, b) if b is not None and b is not r else None
        mem, bmem = r.get("peak_memory_bytes"), (b or {}).get("peak_memory_bytes")
        r["memory_ratio"] = bmem / mem if b is not None and mem and bmem is not None else None
    return records
