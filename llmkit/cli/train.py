"""``llmkit train``: train a model from a spec, or resume a run (also under torchrun)."""

from __future__ import annotations

import argparse
import json
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
    val = f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a"
    console().print(
        f"done: {result.step} steps, {result.tokens:,} tokens in {result.seconds:.1f}s "
        f"({result.stopped}); val loss {val}; run: {result.run_dir}",
        markup=False,
    )
    if not args.no_sample:
        print_sample(result)
    return 0


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
