"""``llmkit compare``: runs side by side — what differs in their specs, their metrics, and
overlaid loss curves."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmkit.cli.common import console, table


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "compare",
        run_compare,
        help="runs side by side: spec differences, metrics, loss curves",
        configure=configure_compare,
    )


def configure_compare(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "runs", nargs="+", help="run directories, or directories of runs (a sweep, runs/)"
    )
    p.add_argument("--plot", metavar="FILE", help="overlaid loss curves (PNG)")
    p.add_argument("--x", choices=["step", "tokens"], default="step", help="the curves' x axis")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e7):
            return f"{value:.4g}"
        return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


#: How the table labels the rows that hold a run's objective (not a cross-entropy when the
#: ``objective`` row names another loss).
OBJECTIVE_ROWS = {
    "val_loss": "val_loss (objective)",
    "best_val_loss": "best_val_loss (objective)",
    "train_loss": "train_loss (objective)",
}


def run_compare(args: argparse.Namespace) -> int:
    from llmkit.experiments.compare import (
        RANK_METRIC,
        best_run,
        compare,
        differences,
        metric_table,
        plot_curves,
    )

    runs = compare(args.runs)
    diff, metrics = differences(runs), metric_table(runs)
    best = best_run(runs)
    if args.plot:
        plot_curves(runs, Path(args.plot), x=args.x)
    if args.json:
        print(
            json.dumps(
                {
                    "runs": [{"label": r.label, "path": str(r.path)} for r in runs],
                    "differences": diff,
                    "metrics": metrics,
                    "best": {"metric": RANK_METRIC, "run": best.label if best else None},
                },
                indent=2,
            )
        )
        return 0
    con = console()
    labels = [r.label for r in runs]
    if len(runs) > 1:
        out = table("spec", *labels, title="what differs")
        for key, values in diff.items():
            out.add_row(key, *(_cell(v) for v in values))
        con.print(out if diff else "the specs are the same")
    out = table("metric", *labels, title="metrics")
    for key, values in metrics.items():
        out.add_row(OBJECTIVE_ROWS.get(key, key), *(_cell(v) for v in values))
    con.print(out)
    if best is not None:
        value = _cell(best.metrics[RANK_METRIC])
        con.print(f"best by {RANK_METRIC} (cross-entropy): {best.label} ({value})", markup=False)
    if args.plot:
        con.print(f"curves: {args.plot}", markup=False)
    return 0
