"""``llmkit train``: train a model from a spec, or resume a run (also under torchrun)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

from llmkit.cli.common import add_set, at_least, console, seconds
from llmkit.errors import LlmkitError


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "train",
        run_train,
        help="train a model from a spec, or resume a run",
        configure=configure_train,
    )


def configure_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help="spec file (or the run directory with --resume)")
    p.add_argument("--out", help="run directory (default runs/<name>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out / RUN")
    add_set(p)
    p.add_argument("--max-steps", type=at_least(1), help="optimizer steps (sets train.max_steps)")
    p.add_argument(
        "--init-from",
        metavar="RUN",
        help="start from this run's (or checkpoint's) weights (sets train.init_from)",
    )
    p.add_argument("--max-time", type=seconds, help="stop after this many seconds")
    p.add_argument("--no-sample", action="store_true", help="skip the sample at the end")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: when on a terminal)",
    )


def run_train(args: argparse.Namespace) -> int:
    try:
        return _train(args)
    except BrokenPipeError as exc:  # training writes no pipe of its own: not a reader leaving
        if args.debug:
            raise
        raise LlmkitError(f"broken pipe: {exc}") from exc


def _train(args: argparse.Namespace) -> int:
    from llmkit.training import train

    sets = list(args.set or [])
    if args.init_from is not None:
        if args.resume:
            raise LlmkitError("--init-from starts a new run; it cannot be combined with --resume")
        sets.append(f"train.init_from={json.dumps(args.init_from)}")
    if args.resume:
        if args.spec is not None and args.out is None:
            args.out = args.spec  # `llmkit train --resume RUN_DIR`
        elif args.spec is not None:
            raise LlmkitError("--resume takes a run directory, not a spec file")
        result = train(
            run_dir=args.out,
            overrides=sets,
            resume=True,
            max_steps=args.max_steps,
            max_time=args.max_time,
            progress=args.progress,
        )
    else:
        result = train(
            args.spec,
            run_dir=args.out,
            overrides=sets,
            max_steps=args.max_steps,
            max_time=args.max_time,
            progress=args.progress,
        )
    if result.rank != 0:
        return 0  # rank 0 reports for the job
    console().print(done_line(result), markup=False)
    if not args.no_sample:
        print_sample(result)
    return 0


def done_line(result: Any) -> str:
    """``done: 30 steps, 3,840 tokens in 12.3s (max_steps); val loss: ce 4.1234 (ppl
    61.76); run: RUN``: the validation cross-entropy first, whatever the objective, and the
    objective beside it, named, when it is another (``, objective distill 3.3200``); the
    trained tokens beside the tokens when padding or masked prompts were not trained
    (``61,440 tokens (211 trained)``). ``(reason); val loss`` is what sweeps read the
    stop reason from."""
    tokens = f"{result.tokens:,} tokens"
    trained = result.trained_tokens
    if trained is not None and trained != result.tokens:
        tokens += f" ({trained:,} trained)"
    ce, val = result.val_ce, "n/a"
    if ce is not None:
        val = f"ce {ce:.4f} (ppl {math.exp(min(ce, 80.0)):.2f})"
        if result.objective != "cross_entropy" and result.val_loss is not None:
            val += f", objective {result.objective} {result.val_loss:.4f}"
    return (
        f"done: {result.step} steps, {tokens} in {result.seconds:.1f}s "
        f"({result.stopped}); val loss: {val}; run: {result.run_dir}"
    )


def print_sample(result: Any) -> None:
    """The spec's end-of-training sample, from the model training left in memory."""
    from llmkit.training import sample_text

    text = sample_text(result)
    if text is None:  # sample_tokens = 0, or a rank other than 0
        return
    con = console()
    con.rule("sample")
    con.print(text, markup=False, highlight=False)
    con.rule()
