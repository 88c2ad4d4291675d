"""``llmkit bench kernels``'s body: check the command's arguments, run the sweep
(:mod:`llmkit.bench.kernels`), print the table, write JSON and a PNG plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from llmkit.bench.kernels.adapters import HEAD_DIMS, QUICK, NotBenchmarkable, adapter_for
from llmkit.bench.kernels.entries import entries
from llmkit.bench.kernels.flops import MODES
from llmkit.bench.kernels.report import (
    format_time,
    meta,
    plot,
    rich_table,
    table_rows,
    write_json,
)
from llmkit.bench.kernels.runner import add_ratios, bench_kernels
from llmkit.bench.kernels.timing import default_dtype, device_name, dtype_name, parse_dtype
from llmkit.errors import LlmkitError, first_line, validation_problems


def _option_problems(exc: BaseException) -> str:
    """A pydantic error as ``key: message`` pairs on one line; others as ``Type: message``."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return validation_problems(exc, sep="; ")
    return first_line(exc, typed=True)


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise LlmkitError(f"{flag}: expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise LlmkitError(f"{flag}: expected positive integers, got {text!r}")
    return values


def _parse_options(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """``NAME.KEY=VALUE`` items (VALUE as JSON, else a string) → {name: {key: value}}."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        target, eq, raw = item.partition("=")
        name, dot, key = target.partition(".")
        if not eq or not dot or not name or not key:
            raise LlmkitError(f"--option: expected NAME.KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(name, {})[key] = value
    return out


def run_cli(args: Any) -> int:
    """``llmkit bench kernels``: print the table, write JSON and PNG under ``--out``."""
    kind = args.kind
    try:
        adapter = adapter_for(kind)
    except NotBenchmarkable as exc:
        raise LlmkitError(f"--kind: {exc}") from exc
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise LlmkitError(f"--device: expected cpu, cuda or auto, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise LlmkitError("--device cuda: no CUDA GPU is available")
    try:
        dtype = parse_dtype(args.dtype, device) if args.dtype else default_dtype(device)
    except ValueError as exc:
        raise LlmkitError(f"--dtype: {exc}") from exc
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or any(m not in MODES for m in modes):
        raise LlmkitError(f"--modes: expected fwd, fwd+bwd or both, got {args.modes!r}")
    sizes = _ints(args.seq_lens, "--seq-lens")
    head_dims = _ints(args.head_dims, "--head-dims")
    if args.repeats < 1 or args.warmup < 0:
        raise LlmkitError("--repeats must be ≥ 1 and --warmup ≥ 0")
    for flag, value in (
        ("--batch", args.batch),
        ("--heads", args.heads),
        ("--d-model", args.d_model),
    ):
        if value is not None and value < 1:
            raise LlmkitError(f"{flag}: expected a positive integer, got {value}")
    names = [n.strip() for n in (args.components or "").split(",") if n.strip()] or None
    options = _parse_options(args.option)
    entry_list = entries(kind, names, options)
    unknown = sorted(set(options) - {e.record.name for e in entry_list})
    if unknown:
        raise LlmkitError(f"--option: no {kind} component {unknown[0]!r} in this benchmark")
    if not entry_list:
        raise LlmkitError(f"no registered {kind} components")
    for e in entry_list:  # options the user gave must validate (defaults may skip a case)
        if e.label in options:
            try:
                e.record.parse_options(e.options)
            except Exception as exc:
                raise LlmkitError(f"--option {e.label}: {_option_problems(exc)}") from exc
    baseline = args.baseline if args.baseline is not None else adapter.baseline
    if args.baseline is not None and baseline not in {e.label for e in entry_list}:
        raise LlmkitError(
            f"--baseline {baseline!r} is not among the benchmarked {kind} components "
            f"({', '.join(e.label for e in entry_list)})"
        )
    if args.quick:
        sizes = sizes or adapter.quick_sizes
        head_dims = head_dims or QUICK["head_dims"]
        d_model = args.d_model or QUICK["d_model"]
        warmup, repeats, min_repeat_s = 1, min(args.repeats, 3), 0.002
    else:
        d_model = args.d_model
        warmup, repeats, min_repeat_s = args.warmup, args.repeats, 0.005
    before = torch.get_num_threads()
    threads = args.threads or (1 if args.quick else before)  # tiny ops: threads only wait

    progress = None
    if sys.stderr.isatty():

        def progress(r: dict[str, Any]) -> None:
            size = r.get(adapter.axis.field)
            dim = "".join(
                f" {c.header}={r[c.field]}" for c in adapter.columns[:-1] if r.get(c.field)
            )
            what = format_time(r["median_s"]) if r["status"] == "ok" else r["status"]
            if r.get("spread") is not None:
                what += f", spread {r['spread'] * 100:.0f}%"
            print(f"  {r['component']} {r['mode']} {size}{dim}: {what}", file=sys.stderr)

    torch.set_num_threads(threads)
    try:
        records = bench_kernels(
            kind, entry_list, device=device, dtype=dtype, sizes=sizes,
            head_dims=head_dims or HEAD_DIMS, modes=modes, causal=args.causal,
            batch=args.batch, heads=args.heads, d_model=d_model, warmup=warmup,
            repeats=repeats, min_repeat_s=min_repeat_s, on_record=progress,
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    add_ratios(records, baseline)
    from rich.console import Console

    con = Console(highlight=False, soft_wrap=True)
    if not con.is_terminal:
        con.width = max(con.width, 160)
    shape = adapter.shape_note(records)
    con.print(
        f"{kind} kernels on {device_name(device)} ({device}, {dtype_name(dtype)}, "
        f"{threads} thread{'s' if threads != 1 else ''}{shape}); median of {repeats} repeats, "
        "spread = (slowest − fastest) / median",
        markup=False,
    )
    con.print(rich_table(records, baseline))
    _, _, notes = table_rows(records, baseline)
    for note in notes:
        con.print(note, markup=False)
    out = Path(args.out)
    stem = f"kernels-{kind}-{device}"
    info = meta(kind, device, dtype, baseline=baseline, quick=args.quick, threads=threads)
    json_path = write_json(records, out / f"{stem}.json", info)
    png_path = plot(records, out / f"{stem}.png")
    con.print(f"wrote {json_path} and {png_path}", markup=False)
    return 1 if any(r["status"] == "error" for r in records) else 0
