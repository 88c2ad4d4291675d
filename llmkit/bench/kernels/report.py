"""Reports of kernel benchmark records: JSON with its metadata, a PNG plot, and tables (rich,
markdown, and a pivot with one column per component). Case columns, the x axis and the speed
unit come from the records' kind's bench adapter."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

import torch

from llmkit.bench.kernels.adapters import ATTENTION_ADAPTER, Column, KernelBench, adapter_for
from llmkit.bench.kernels.flops import MODES
from llmkit.bench.kernels.timing import CPU_MEMORY, CUDA_MEMORY, device_name, dtype_name
from llmkit.hardware import cpu_flags


def meta(kind: str, device: str, dtype: torch.dtype, **extra: Any) -> dict[str, Any]:
    """What a JSON report says about where and how it was measured."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # pragma: no cover - triton absent
        triton_version = None
    adapter = adapter_for(kind)
    return {
        "kind": kind,
        "device": device,
        "device_name": device_name(device),
        "dtype": dtype_name(dtype),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton_version,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "flops": adapter.work if adapter.rate == "tflops" else None,
        "bytes": adapter.work if adapter.rate == "gbps" else None,
        "memory": CUDA_MEMORY if device == "cuda" else CPU_MEMORY,
        "cpu_flags": cpu_flags(),
        **extra,
    }


def write_json(records: list[dict[str, Any]], path: str | Path, meta: dict[str, Any]) -> Path:
    """``{"meta": meta, "records": records}`` at ``path`` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "records": records}, indent=2) + "\n")
    return path


def _adapter(records: list[dict[str, Any]]) -> KernelBench | None:
    return adapter_for(records[0]["kind"]) if records else None


def _case(rec: dict[str, Any], columns: tuple[Column, ...]) -> tuple[Any, ...]:
    return tuple(rec.get(c.field) for c in columns)


def plot(records: list[dict[str, Any]], path: str | Path, title: str | None = None) -> Path:
    """Median time against the adapter's x axis (sequence length, tokens), log-log, one line
    per component with bars from the fastest to the slowest repeat, one panel per mode (and
    per value of the other case columns, e.g. head dim)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    adapter = _adapter(records)
    axis = adapter.axis if adapter else Column("tokens", "tokens", "tokens")
    panel_cols = adapter.columns[:-1] if adapter else ()
    ok = [r for r in records if r["status"] == "ok"]
    modes = list(dict.fromkeys(r["mode"] for r in records)) or ["fwd"]
    panels = list(dict.fromkeys(_case(r, panel_cols) for r in records)) or [()]
    fig = Figure(figsize=(5.2 * len(modes), 3.8 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), len(modes), squeeze=False)
    labels = list(dict.fromkeys(r["component"] for r in records))
    kind = records[0]["kind"] if records else ""
    for i, panel in enumerate(panels):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            for label in labels:
                pts = sorted(
                    (r[axis.field], r["median_s"], r.get("min_s"), r.get("max_s"))
                    for r in ok
                    if r["component"] == label
                    and r["mode"] == mode
                    and _case(r, panel_cols) == panel
                )
                if pts:
                    xs = [p[0] for p in pts]
                    ys = [p[1] * 1e3 for p in pts]
                    # the bars span the fastest to the slowest repeat
                    lo = [(p[1] - (p[2] if p[2] is not None else p[1])) * 1e3 for p in pts]
                    hi = [((p[3] if p[3] is not None else p[1]) - p[1]) * 1e3 for p in pts]
                    ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=2, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ticks = sorted({r[axis.field] for r in records if r["mode"] == mode})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel(axis.label)
            ax.set_ylabel("median time (ms)")
            where = "".join(f", {c.label} {v}" for c, v in zip(panel_cols, panel) if v)
            ax.set_title(mode + where)
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small")
    if title is None and records:
        r = records[0]
        title = f"{kind} on {r['device_name']} ({r['device']}, {r['dtype']})"
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _mem(n: float | None) -> str:
    if n is None:
        return "-"
    for suffix in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {suffix}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_time(s: float) -> str:
    """Seconds as milliseconds, three decimals below 0.1 s."""
    return f"{s * 1e3:.3f} ms" if s < 0.1 else f"{s * 1e3:,.1f} ms"


#: What a speed ratio inside the noise is marked with (:func:`_ratio`), and the note saying so.
NOISE_MARK = " (noise)"
NOISE_NOTE = (
    "(noise): within the noise: the two medians differ by no more than the two ranges "
    "of the repeats (slowest − fastest) together"
)


def _ratio(x: float | None, noise: bool | None = None) -> str:
    """A baseline/this ratio: > 1 means faster (smaller); ``noise``: marked as within it."""
    if x is None:
        return "-"
    return f"{x:.2f}×" + (NOISE_MARK if noise else "")


def _spread(rec: dict[str, Any]) -> str:
    spread = rec.get("spread")
    return "-" if spread is None else f"{spread * 100:.0f}%"


def _noise_notes(records: list[dict[str, Any]]) -> list[str]:
    return [NOISE_NOTE] if any(r.get("within_noise") for r in records) else []


def _sortable(value: Any) -> tuple[bool, Any]:
    return (value is not None, value if value is not None else 0)


def table_rows(
    records: list[dict[str, Any]], baseline: str | None = None
) -> tuple[list[str], list[list[str]], list[str]]:
    """(headers, rows, notes) of the comparison table: ok records sorted by case, then
    one note per (component, reason) skipped or failed, and what marks a speed ratio inside
    the noise (``within_noise``, :func:`~llmkit.bench.kernels.add_ratios`) when one is."""
    adapter = _adapter(records) or ATTENTION_ADAPTER
    on_gpu = any(r["device"] == "cuda" for r in records)
    has_base = any(r.get("speedup") is not None for r in records)
    headers = ["component", "mode"] + [c.header for c in adapter.columns]
    rate, scale = ("GB/s", 1.0) if adapter.rate == "gbps" else ("GFLOP/s", 1e3)
    if on_gpu and adapter.rate != "gbps":
        rate, scale = "TFLOP/s", 1.0
    headers += ["median", "spread", rate, "peak mem"]
    if has_base:
        headers += [f"speed vs {baseline}", f"mem vs {baseline}"]
    ok = [r for r in records if r["status"] == "ok"]
    order = {m: i for i, m in enumerate(MODES)}
    labels = {lab: i for i, lab in enumerate(dict.fromkeys(r["component"] for r in records))}
    ok.sort(
        key=lambda r: (
            order.get(r["mode"], 9),
            *(_sortable(v) for v in _case(r, adapter.columns)),
            labels[r["component"]],
        )
    )
    rows = []
    for r in ok:
        row = [r["component"], r["mode"]] + [str(v) for v in _case(r, adapter.columns)]
        speed = r[adapter.rate]
        row += [format_time(r["median_s"]), _spread(r)]
        row.append("-" if speed is None else f"{speed * scale:,.1f}")
        row.append(_mem(r.get("peak_memory_bytes")))
        if has_base:
            row += [_ratio(r.get("speedup"), r.get("within_noise")), _ratio(r.get("memory_ratio"))]
        rows.append(row)
    notes = []
    for r in records:
        if r["status"] != "ok":
            note = f"{r['component']}: {r['status']} ({r['reason']})"
            if note not in notes:
                notes.append(note)
    return headers, rows, notes + _noise_notes(ok)


def rich_table(records: list[dict[str, Any]], baseline: str | None = None) -> Any:
    """The comparison table as a ``rich.table.Table``."""
    from rich.table import Table

    headers, rows, _ = table_rows(records, baseline)
    table = Table(box=None, pad_edge=False)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < 2 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def markdown_table(records: list[dict[str, Any]], baseline: str | None = None) -> str:
    """The comparison table in markdown, skipped and failed entries as notes below it."""
    headers, rows, notes = table_rows(records, baseline)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if notes:
        lines.append("")
        lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def pivot_markdown(
    records: list[dict[str, Any]], baseline: str | None = None, metric: str | None = None
) -> str:
    """One row per case (mode and case columns), one column per component with ``metric``
    (default: the adapter's rate, TFLOP/s or GB/s), then each component's speed against
    ``baseline`` (baseline time / its time, > 1 = faster; marked when within the noise)."""
    adapter = _adapter(records)
    if adapter is None:
        return "(no records)\n"
    metric = metric or adapter.rate
    unit = {"gbps": "GB/s", "tflops": "TFLOP/s", "median_s": "ms"}.get(metric, metric)
    labels = list(dict.fromkeys(r["component"] for r in records))
    others = [lab for lab in labels if lab != baseline and baseline in labels]
    cases = list(dict.fromkeys((r["mode"], *_case(r, adapter.columns)) for r in records))
    got = {(r["mode"], *_case(r, adapter.columns), r["component"]): r for r in records}
    head = ["mode"] + [c.header for c in adapter.columns]
    head += [f"{lab} {unit}" for lab in labels] + [f"{lab} / {baseline}" for lab in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in cases:
        row = [case[0]] + [str(v) for v in case[1:]]
        for lab in labels:
            r = got.get((*case, lab))
            if r is None or r["status"] != "ok" or r.get(metric) is None:
                row.append(r["status"] if r is not None else "-")
            else:
                value = r[metric] * (1e3 if metric == "median_s" else 1.0)
                row.append(f"{value:.3g}" if value < 100 else f"{value:,.0f}")
        for lab in others:
            r = got.get((*case, lab))
            row.append(_ratio(r.get("speedup"), r.get("within_noise")) if r is not None else "-")
        lines.append("| " + " | ".join(row) + " |")
    _, _, notes = table_rows(records, baseline)
    if notes:
        lines.append("")
        lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
