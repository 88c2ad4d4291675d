"""``llmkit sweep``: train a base spec over axes of values, trials in parallel, resumable."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from llmkit.cli.common import add_set, at_least, console, seconds, table, write
from llmkit.errors import LlmkitError

#: Exit status of a sweep that ran to the end with failed trials (the others all ran).
EXIT_TRIALS_FAILED = 1
#: Exit status of a sweep stopped by SIGINT/SIGTERM (rerun it to finish).
EXIT_STOPPED = 130


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "sweep",
        run_sweep_command,
        help="train a spec over axes of values (grid, zip, ranges, random, seeds), resumable",
        configure=configure_sweep,
    )


def configure_sweep(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep", nargs="?", help="sweep file (TOML/YAML)")
    p.add_argument(
        "--workers", type=at_least(1), default=1, help="trials trained at once (default 1)"
    )
    p.add_argument("--out", help="sweep directory (default runs/sweeps/<name>)")
    p.add_argument("--retry-failed", action="store_true", help="rerun the failed trials too")
    add_set(p, help="dotted override of every trial (after the file's `set`), as llmkit train's")
    p.add_argument(
        "--max-steps",
        type=at_least(1),
        help="every trial's optimizer steps, as llmkit train --max-steps (a longer warmup is "
        "scaled down to fit)",
    )
    p.add_argument(
        "--max-time", type=seconds, help="stop each trial after this many seconds of training"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list the trials and their overrides and validate them; run nothing",
    )
    p.add_argument("--schema", action="store_true", help="print the sweep file's JSON Schema")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live progress table (default: when stdout is a terminal)",
    )


def run_sweep_command(args: argparse.Namespace) -> int:
    if args.schema:
        from llmkit.experiments.sweep_axes import sweep_schema

        write(json.dumps(sweep_schema(), indent=2) + "\n")
        return 0
    if args.sweep is None:
        raise LlmkitError("a sweep file is required (or --schema)")
    if args.dry_run:
        return _dry_run(args.sweep, args.set, args.max_steps)
    from llmkit.experiments.sweep import run_sweep

    result = run_sweep(
        args.sweep,
        workers=args.workers,
        out=args.out,
        retry_failed=args.retry_failed,
        log=print,  # on a terminal the progress display prints its lines itself
        progress=args.progress,
        overrides=args.set,
        max_steps=args.max_steps,
        max_time=args.max_time,
    )
    if result.stopped:
        return EXIT_STOPPED
    return EXIT_TRIALS_FAILED if result.counts()["failed"] else 0


def _dry_run(path: str, sets: list[str] | None, max_steps: int | None) -> int:
    from rich.text import Text

    from llmkit.experiments.sweep import load_plan, validate_plan

    plan = load_plan(path, overrides=sets, max_steps=max_steps)
    validate_plan(plan)
    out = table("trial", "overrides", title=f"sweep {plan.name}: base {plan.base}")
    for trial in plan.trials:
        out.add_row(Text(trial.id), Text(" ".join(plan.overrides(trial))))
    con = console()
    con.print(out)
    con.print(f"{len(plan.trials)} trials, all valid; nothing was run", markup=False)
    return 0
