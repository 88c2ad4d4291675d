"""``llmkit search``: hyperparameter search with Optuna (TPE, pruning, a shared study)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmkit.cli.common import add_set, at_least, console, seconds, table

#: What ``--workers`` adds to the seed offset of each process after the first.
WORKER_SEED_STRIDE = 1000


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "search",
        run_search_command,
        help="hyperparameter search with Optuna: TPE sampling, pruning, a shared study",
        configure=configure_search,
    )


def configure_search(p: argparse.ArgumentParser) -> None:
    p.add_argument("search_file", help="a search file (TOML/YAML): base spec, params, trials")
    p.add_argument("--out", help="directory of the search (default: runs/sweeps/<name>)")
    p.add_argument("--trials", type=at_least(1), help="completed or pruned trials wanted")
    p.add_argument("--storage", help="database URL of the study (default: OUT/study.db)")
    p.add_argument(
        "--seed-offset",
        type=at_least(0),
        default=0,
        help="added to the search's seed: give each machine sharing a study its own",
    )
    p.add_argument(
        "--workers",
        type=at_least(1),
        default=1,
        help="processes working on the study here, threads split between them (default 1)",
    )
    p.add_argument(
        "--threads",
        type=at_least(1),
        help="CPU threads of each trial (default: the usable cores divided by --workers)",
    )
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


def run_search_command(args: argparse.Namespace) -> int:
    from llmkit.experiments.search import (
        check_search,
        check_seed,
        default_out,
        prepare_search,
        run_search,
    )
    from llmkit.experiments.search_storage import open_given_storage
    from llmkit.experiments.trial import threads_per_worker

    search, base = prepare_search(
        args.search_file, trials=args.trials, overrides=args.set, max_steps=args.max_steps
    )
    check_search(search, base, args.max_steps)  # every problem before any process starts
    check_seed(search, args.seed_offset + (args.workers - 1) * WORKER_SEED_STRIDE)
    if args.workers > 1:  # a storage refused in one line, not one from every process
        out = Path(args.out) if args.out else default_out(search.name)
        rdb = open_given_storage(search, args.storage, args.search_file, out)
        if rdb is not None:
            rdb.engine.dispose()
    threads = args.threads or threads_per_worker(args.workers)
    helpers: list[subprocess.Popen[bytes]] = []
    if args.workers > 1:
        argv = [sys.executable, "-m", "llmkit.cli", "search", args.search_file]
        argv += ["--threads", str(threads)]  # each trial's share, as this process's
        for flag in ("out", "trials", "storage", "max_steps", "max_time"):
            if getattr(args, flag) is not None:
                argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        for assignment in args.set or []:
            argv += ["--set", assignment]
        helpers = [  # each its own sampler seed: the file's, plus its worker number
            subprocess.Popen(
                [*argv, "--seed-offset", str(args.seed_offset + i * WORKER_SEED_STRIDE)],
                stdout=subprocess.DEVNULL,
            )
            for i in range(1, args.workers)
        ]
    con = console()
    try:
        result = run_search(
            args.search_file,
            out=args.out,
            trials=args.trials,
            storage=args.storage,
            seed_offset=args.seed_offset,
            threads=threads,
            log=lambda m: con.print(m, markup=False),
            overrides=args.set,
            max_steps=args.max_steps,
            max_time=args.max_time,
        )
    finally:
        codes = [h.wait() for h in helpers]
    if helpers:  # the others' last trials ended after this process's summary: read it again
        result = run_search(
            args.search_file, out=args.out, trials=args.trials, storage=args.storage,
            seed_offset=args.seed_offset, log=lambda m: con.print(m, markup=False),
            overrides=args.set, max_steps=args.max_steps, max_time=args.max_time,
        )  # fmt: skip
    if any(codes):
        con.print(f"{sum(1 for c in codes if c)} worker process(es) failed", markup=False)
    states: dict[str, int] = {}
    for row in result.rows:
        states[row["state"]] = states.get(row["state"], 0) + 1
    con.print(", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items())), markup=False)
    if result.best is not None:
        out = table("best trial", "value")
        for key, value in result.best.items():
            if value is not None:  # pruned_at, error: not of a completed trial
                out.add_row(str(key), str(value))
        con.print(out)
    con.print(f"results: {result.out / 'results.csv'}, plots in {result.out / 'plots'}")
    return 0 if result.best is not None else 1
