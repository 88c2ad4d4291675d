"""Benchmarks: the ``bench`` group, ``bench generate`` and ``bench kernels``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from llmkit.cli.common import (
    QUANTIZE,
    QUANTIZE_HELP,
    WEIGHTS,
    add_set,
    at_least,
    console,
    human_bytes,
    table,
    write,
)
from llmkit.errors import LlmkitError


def register_commands(register: Callable[..., Any]) -> None:
    register("bench", help="benchmarks: `llmkit bench generate RUN`, `llmkit bench kernels`")
    register(
        "generate",
        run_generate,
        group="bench",
        help="generation speed: prefill and decode tokens/s, time to first token, memory",
        description="Time greedy generation on random prompts at each batch size: prompt "
        "processing and decoding tokens/s, time to first token, peak memory and KV-cache "
        "size (medians of --repeats runs after a warm-up), and the memory-bandwidth bound "
        "of decoding: weight bytes read per step ÷ the measured read bandwidth.",
        configure=configure_generate,
    )
    register(
        "kernels",
        run_kernels,
        group="bench",
        help="time every registered component of a kind: time, TFLOP/s, memory",
        description="Time every registered component of a kind (forward, and forward+backward) "
        "over sequence lengths and head dims (attention) or token counts (ffn, norm): median "
        "time, TFLOP/s (GB/s for norms), peak memory and the ratios against a baseline. "
        "Prints a table and writes JSON and a PNG plot under --out. FLOP counts and the memory "
        "measure are described in llmkit/bench/kernels/.",
        configure=configure_kernels,
    )


# -- bench generate -------------------------------------------------------------------------------


def configure_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run or checkpoint directory, or a spec file (random weights)")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated (default: 1,8)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--quantize",
        choices=QUANTIZE,
        help=QUANTIZE_HELP,
    )
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, mps or auto")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads")
    add_set(p, help="override (spec file)")
    p.add_argument("--weights", choices=WEIGHTS, default="final")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError as exc:
        raise LlmkitError(f"--batch-sizes: expected e.g. 1,8; got {text!r}") from exc
    if not sizes or min(sizes) < 1:
        raise LlmkitError(f"--batch-sizes: expected positive integers, got {text!r}")
    return sizes


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from llmkit import hardware
    from llmkit.bench.generation import bench_generate_source

    sizes = _batch_sizes(args.batch_sizes)
    if args.new_tokens < 2 or args.prompt_len < 1 or args.repeats < 1:
        raise LlmkitError("--new-tokens must be ≥ 2, --prompt-len and --repeats ≥ 1")
    device = hardware.choose_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = bench_generate_source(
        args.run,
        overrides=args.set,
        weights=args.weights,
        device=device,
        quantize=args.quantize,
        batch_sizes=sizes,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
    )
    rows, name, meta = res.rows, res.name, res.meta()
    method = f"{res.quantize} ({res.quantize_backend})" if res.quantize else None
    if args.json:
        write(json.dumps({**meta, "results": [r.as_dict() for r in rows]}) + "\n")
        return 0
    con = console()
    con.print(
        f"{name}: {meta['params']:,} parameters on {device} ({meta['threads']} threads)"
        + (f", {method}" if method else "")
        + ("" if res.supports_kv_cache else ", no KV cache (full forward per token)")
        + f"; prompts of {rows[0].prompt_len} tokens, {args.new_tokens} new tokens",
        markup=False,
    )
    first = rows[0]
    con.print(
        f"weights {human_bytes(first.weight_bytes)}; a decoding step reads "
        f"{human_bytes(first.read_bytes_per_step)} of them; read bandwidth "
        f"{first.read_bandwidth / 1e9:.1f} GB/s → limit {first.limit_tokens_per_s:,.1f} "
        "tok/s per sequence",
        markup=False,
    )
    llc = hardware.last_level_cache_bytes() if device.type == "cpu" else None
    if llc and first.read_bytes_per_step <= llc:
        con.print(
            f"(the weights fit in the {human_bytes(llc)} last-level cache: they need not "
            "come from memory, so the limit does not bind)",
            markup=False,
        )
    out = table(
        "batch", "prefill tok/s", "TTFT", "decode tok/s", "limit", "of limit", "peak mem", "KV"
    )
    out.collapse_padding = True  # eight columns in 80 characters
    for col in out.columns:
        col.no_wrap = True
    for r in rows:
        out.add_row(
            str(r.batch_size),
            f"{r.prefill_tokens_per_s:,.0f}",
            f"{1000 * r.ttft_s:.1f} ms",
            f"{r.decode_tokens_per_s:,.1f}",
            f"{r.batch_size * r.limit_tokens_per_s:,.0f}",
            f"{100 * r.fraction_of_limit:.0f} %",
            human_bytes(r.peak_memory_bytes),
            human_bytes(r.kv_cache_bytes),
        )
    con.print(out)
    return 0


# -- bench kernels --------------------------------------------------------------------------------


def configure_kernels(p: argparse.ArgumentParser) -> None:
    p.add_argument(  # checked by llmkit.bench.kernels: a kind with a benchmark adapter
        "--kind", default="attention", help="a kind with a benchmark (default: attention)"
    )
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bf16 CUDA, fp32 CPU)")
    p.add_argument(
        "--seq-lens",
        help="comma-separated sequence lengths (attention) or token counts (ffn, norm); "
        "default 256…4096 on CPU, 512…8192 on CUDA (tokens: 256…4096, 4096…65536)",
    )
    p.add_argument("--head-dims", help="comma-separated attention head dims (default: 64,128)")
    p.add_argument("--components", help="comma-separated names (default: every registered one)")
    p.add_argument("--modes", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both (default)")
    p.add_argument(
        "--baseline", help="component the ratios compare with (default: sdpa, swiglu, rmsnorm)"
    )
    p.add_argument("--option", action="append", metavar="NAME.KEY=VALUE", help="an option")
    p.add_argument("--batch", type=int, help="attention batch (default: 1 CPU, 16384/N CUDA)")
    p.add_argument("--heads", type=int, help="attention heads (default: 8 CPU, 2048/D CUDA)")
    p.add_argument("--d-model", type=int, help="ffn/norm width (default: 768 CPU, 4096 CUDA)")
    p.add_argument(
        "--causal", action=argparse.BooleanOptionalAction, default=True, help="default: causal"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (median; default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a few seconds in all")
    p.add_argument("--out", default="bench-kernels", help="where JSON and PNG go")


def run_kernels(args: argparse.Namespace) -> int:
    from llmkit.cli.bench_kernels import run_cli
    from llmkit.registry import get_registry

    try:
        return run_cli(args)
    except LlmkitError as exc:  # a kind a plugin that failed to load would have declared
        reg = get_registry()
        if args.kind in reg.kinds or "failed to load" in str(exc):
            raise
        hint = reg.failure_hint(args.kind)
        if not hint:
            raise
        raise LlmkitError(f"{exc}{hint}") from exc
