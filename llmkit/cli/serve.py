"""``llmkit serve``: a run or a Hugging Face directory behind the OpenAI API (continuous
batching), and ``llmkit bench serve``: that server under concurrent clients against
sequential generation."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from llmkit.cli.common import QUANTIZE, WEIGHTS, at_least, console, table
from llmkit.errors import LlmkitError

#: ``--dtype`` choices: the weights as loaded, or a ``--quantize`` method of generate.
DTYPES = ("float32", *QUANTIZE)
DTYPE_HELP = (
    "float32 (the weights as loaded, default), bf16, int8 (dynamic w8a8, fbgemm on x86), "
    "int8-weight-only, or auto (as llmkit generate --quantize auto)"
)


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "serve",
        run_serve,
        help="serve a run behind the OpenAI API (completions, chat, streaming)",
        description="Serve a run, a checkpoint or a local Hugging Face directory behind the "
        "OpenAI API: POST /v1/completions, POST /v1/chat/completions (the run's chat "
        "template), GET /v1/models, GET /health; streaming as server-sent events. Requests "
        "join and leave one running batch at token boundaries (continuous batching). "
        "SIGTERM or Ctrl-C finishes the requests in flight, then exits. See docs/serving.md.",
        configure=configure_serve,
    )
    register(
        "serve",
        run_bench_serve,
        group="bench",
        help="serving throughput and latency under concurrent clients vs sequential generate",
        description="Start the server on the model, send --requests requests from "
        "--concurrency clients at once (streaming), and report tokens/s, time to first "
        "token and per-token latency (p50/p99), against the same requests generated one "
        "after another with llmkit generate's code.",
        configure=configure_bench_serve,
    )


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch", type=at_least(1), default=16, help="choices decoding at once")
    p.add_argument(
        "--prefill-tokens",
        type=at_least(1),
        default=512,
        help="prompt tokens fed per engine step (a longer prompt is fed in chunks)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32", help=DTYPE_HELP)
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, mps or auto")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads")
    p.add_argument("--weights", choices=WEIGHTS, default="final")


def configure_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run or checkpoint directory, or a Hugging Face directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default local)")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument(
        "--max-concurrent",
        type=at_least(1),
        default=64,
        help="requests in flight (queued or running) before a 429",
    )
    p.add_argument("--model-name", help="the name clients ask for (default: the directory's)")
    _common(p)


def _load(args: argparse.Namespace) -> Any:
    import torch

    from llmkit import hardware
    from llmkit.serving.loading import load_served

    device = hardware.choose_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    served = load_served(args.run, weights=args.weights, device=device, dtype=args.dtype)
    return served, device


def _engine(served: Any, args: argparse.Namespace) -> Any:
    from llmkit.inference.checks import GenerationError
    from llmkit.serving import Engine

    try:
        return Engine(
            served.model,
            served.tokenizer,
            max_batch=args.max_batch,
            prefill_tokens=args.prefill_tokens,
        )
    except GenerationError as exc:
        raise LlmkitError(str(exc)) from exc


def run_serve(args: argparse.Namespace) -> int:
    from llmkit.serving.server import bind, serve_forever

    if not 0 <= args.port <= 65535:
        raise LlmkitError(f"--port must be in [0, 65535], got {args.port}")
    sock = bind(args.host, args.port)  # before loading: a taken port fails at once
    served, device = _load(args)
    engine = _engine(served, args)
    name = args.model_name or served.name
    host, port = sock.getsockname()[:2]
    logging.getLogger("llmkit").info(
        f"serving {name!r} on http://{host}:{port}/v1 ({device}, {args.dtype}; batch of "
        f"{args.max_batch}, {args.max_concurrent} requests in flight at most)"
    )
    serve_forever(engine, sock, model_name=name, max_concurrent=args.max_concurrent)
    return 0


def configure_bench_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run or checkpoint directory, or a spec file (random weights)")
    p.add_argument("--concurrency", type=at_least(1), default=16, help="clients at once")
    p.add_argument("--requests", type=at_least(1), default=None, help="default: 2 × concurrency")
    p.add_argument("--prompt-len", type=at_least(1), default=32, help="prompt tokens")
    p.add_argument("--max-tokens", type=at_least(2), default=64, help="new tokens a request")
    p.add_argument(
        "--sequential",
        type=at_least(0),
        default=None,
        help="requests generated one by one for the baseline (default: all; 0: none)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    _common(p)


def run_bench_serve(args: argparse.Namespace) -> int:
    import json

    from llmkit.bench.serving import bench_serve

    report = bench_serve(
        args.run,
        concurrency=args.concurrency,
        requests=args.requests or 2 * args.concurrency,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        sequential=args.sequential,
        max_batch=args.max_batch,
        prefill_tokens=args.prefill_tokens,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        weights=args.weights,
    )
    if args.json:
        from llmkit.cli.common import write

        write(json.dumps(report) + "\n")
    else:
        print_report(report)
    return 0


def print_report(r: dict[str, Any]) -> None:
    """The figures as ``llmkit bench serve`` prints them."""
    con = console()
    con.print(
        f"{r['model']}: {r['params']:,} parameters on {r['device']} ({r['threads']} threads, "
        f"{r['dtype']}); {r['requests']} requests of {r['prompt_len']} prompt tokens → "
        f"{r['max_tokens']} tokens, {r['concurrency']} at a time, batch ≤ {r['max_batch']} "
        f"(peak {r['peak_batch']})",
        markup=False,
    )
    out = table("", "tok/s", "TTFT p50", "TTFT p99", "per-token p50", "per-token p99")
    out.add_row(
        "server",
        f"{r['tokens_per_s']:,.1f}",
        f"{r['ttft_p50_s'] * 1000:,.0f} ms",
        f"{r['ttft_p99_s'] * 1000:,.0f} ms",
        f"{r['itl_p50_s'] * 1000:,.1f} ms",
        f"{r['itl_p99_s'] * 1000:,.1f} ms",
    )
    if r["sequential_tokens_per_s"]:
        out.add_row(
            f"sequential ({r['sequential_requests']})",
            f"{r['sequential_tokens_per_s']:,.1f}",
            "",
            "",
            "",
            "",
        )
    con.print(out)
    if r["speedup"]:
        con.print(f"speedup over sequential generation: {r['speedup']:.2f}×", markup=False)
