"""``llmkit scaling``: fit L(N, D) = E + A/N^α + B/D^β and IsoFLOP minima to runs or sweep
results (``scaling fit``), and the compute-optimal N and D for a FLOP budget
(``scaling plan``). The fitting lives in :mod:`llmkit.experiments.scaling`."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmkit.cli.common import at_least, console, human, positive_float, seed, table, write
from llmkit.errors import LlmkitError

DEFAULT_OUT = "scaling-fit.json"
SOURCES_HELP = (
    "a run directory, a directory of runs, a sweep directory (results.jsonl) or its "
    "results.jsonl/results.csv, or a CSV of points with columns N, D, loss[, C]"
)


def register_commands(register: Callable[..., Any]) -> None:
    register(
        "scaling",
        help="scaling laws: `llmkit scaling fit SOURCE...`, `llmkit scaling plan --flops C`",
    )
    register(
        "fit",
        run_fit,
        group="scaling",
        help="fit L(N, D) = E + A/N^α + B/D^β (and IsoFLOP minima) to runs or sweep results",
        description="Fit L(N, D) = E + A/N^α + B/D^β to (N, D, loss) points by Hoffmann et al. "
        "2022's approach 3 (Huber loss on log-loss, L-BFGS from a grid of initialisations), "
        "with bootstrap intervals; and, when the points form at least 3 compute budgets of at "
        "least 3 model sizes each, their approach 2 (IsoFLOP parabola minima). N counts "
        "non-embedding parameters, D training tokens, C training FLOPs by the model's own "
        "accounting. Prints the parameters, writes them as JSON (--out) and a PNG plot.",
        configure=configure_fit,
    )
    register(
        "plan",
        run_plan,
        group="scaling",
        help="the compute-optimal model size and token count for a FLOP budget",
        description="The N and D that minimise the fitted L(N, D) under C = k·N·D (Hoffmann et "
        "al. 2022, eq. 4), the loss predicted there, and intervals from the bootstrap refits; "
        "from a fit saved by `llmkit scaling fit` (--fit) or by fitting SOURCEs.",
        configure=configure_plan,
    )


#: An argparse type: a finite number > 0 (``1e21`` works).
_positive = positive_float()


def _level(text: str) -> float:
    value = _positive(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _add_fitting(p: argparse.ArgumentParser, nargs: str) -> None:
    p.add_argument("sources", nargs=nargs, metavar="SOURCE", help=SOURCES_HELP)
    p.add_argument(
        "--bootstrap",
        type=at_least(0),
        default=200,
        metavar="N",
        help="refits on resampled points for the intervals (default 200; 0: none)",
    )
    p.add_argument("--seed", type=seed, default=0, help="the resampling seed (default 0)")
    p.add_argument("--level", type=_level, default=0.95, help="interval level (default 0.95)")
    p.add_argument(
        "--all-evals",
        action="store_true",
        help="one point per evaluation of each run, not only its last: only for runs whose "
        "evaluations each follow a learning-rate cooldown (WSD decay branches)",
    )
    p.add_argument(
        "--starts",
        type=at_least(0),
        default=16,
        help="L-BFGS starts: the best-scoring points of Hoffmann et al.'s grid of 4,500 "
        "initialisations (default 16; 0: all of them, as the paper, minutes)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def configure_fit(p: argparse.ArgumentParser) -> None:
    _add_fitting(p, "+")
    p.add_argument(
        "--out",
        metavar="FILE.json",
        help=f"where the fit goes (default: {DEFAULT_OUT} in the sweep directory when the one "
        "source is a sweep, else in the current directory)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="the plot (default: --out with .png)")
    p.add_argument("--no-plot", action="store_true", help="draw no plot")
    p.add_argument(
        "--isoflop-rtol",
        type=_positive,
        default=0.1,
        help="points whose FLOPs agree within this fraction form one IsoFLOP budget (default 0.1)",
    )


def configure_plan(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--flops", type=_positive, required=True, metavar="C", help="training FLOPs, e.g. 1e21"
    )
    p.add_argument("--fit", metavar="FILE.json", help="a fit written by `llmkit scaling fit`")
    p.add_argument(
        "--k",
        type=_positive,
        help="FLOPs per parameter per token, C = k·N·D (default: the fitted points' own "
        "C/(N·D), the model's accounting; 6 when they carry no FLOPs)",
    )
    _add_fitting(p, "*")


# -- fitting --------------------------------------------------------------------------------------


def _fit(args: argparse.Namespace, iso_rtol: float | None) -> tuple[Any, Any, Any, str | None]:
    """The law fitted to the sources, its bootstrap (or None), the IsoFLOP fit (or None, with
    why not when ``iso_rtol`` is given)."""
    from llmkit.experiments import scaling

    points = scaling.points_from_sources(args.sources, all_evals=args.all_evals)
    fit = scaling.fit_loss_law(points, starts=args.starts or None)
    boot = (
        scaling.bootstrap(points, args.bootstrap, seed=args.seed, fit=fit)
        if args.bootstrap
        else None
    )
    iso, why = None, None
    if iso_rtol is not None:
        groups = scaling.group_by_flops(fit.points, rtol=iso_rtol)
        ready = [g for g in groups if len({p.N for p in g}) >= 3]
        if len(ready) < 3:
            why = (
                f"IsoFLOP minima need ≥ 3 compute budgets with ≥ 3 model sizes each; the points "
                f"form {len(groups)} budget(s), {len(ready)} with ≥ 3 sizes"
            )
        else:
            try:
                iso = scaling.isoflop_minima(
                    fit.points,
                    rtol=iso_rtol,
                    min_groups=3,
                    bootstrap=args.bootstrap,
                    seed=args.seed,
                )
            except LlmkitError as exc:
                why = str(exc)
    return fit, boot, iso, why


def _default_out(sources: Sequence[str]) -> Path:
    from llmkit.experiments.scaling import RESULTS_FILES

    if len(sources) == 1:
        p = Path(sources[0])
        if p.is_dir() and any((p / name).is_file() for name in RESULTS_FILES):
            return p / DEFAULT_OUT
    return Path(DEFAULT_OUT)


def _num(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    return human(value) if abs(value) >= 1e4 else f"{value:.4g}"


def _flops(value: float) -> str:
    return f"{value:.3g}"


def _plain(value: float) -> str:
    return f"{value:.4g}"


def _range(interval: Sequence[float] | None, fmt: Callable[[float], str] = _num) -> str:
    if not interval:
        return ""
    return f"[{fmt(interval[0])}, {fmt(interval[1])}]"


def run_fit(args: argparse.Namespace) -> int:
    from llmkit.experiments import scaling

    out = Path(args.out) if args.out else _default_out(args.sources)
    fit, boot, iso, why = _fit(args, args.isoflop_rtol)
    report = scaling.fit_report(fit, boot, iso, level=args.level, sources=args.sources)
    scaling.save_fit(out, report)
    plot = None
    if not args.no_plot:
        plot = scaling.plot_fit(args.plot or out.with_suffix(".png"), fit, iso, title=str(out))
    con = console(stderr=args.json)
    if args.json:
        write(json.dumps(report) + "\n")
    else:
        _print_fit(con, fit, boot, iso, args.level)
    if why:
        con.print(f"note: {why}", markup=False)
    con.print(f"wrote {out}" + (f" and {plot}" if plot else ""), markup=False)
    return 0


def bootstrap_count(boot: Any) -> str:
    """How many bootstrap refits the intervals rest on, against how many were asked for, and
    how many resamples could not be fitted (too few distinct points, or no convergence)."""
    got, asked, failed = len(boot.samples), boot.requested, boot.failed
    refits = f"bootstrap refit{'s' if asked != 1 else ''}"
    if got < asked:
        return (
            f"{got} of {asked} {refits} converged ({failed} of {got + failed} resamples "
            "failed: too few distinct points, or no fit)"
        )
    again = f" ({failed} failed resample{'s' if failed != 1 else ''} drawn again)"
    return f"{got} {refits}" + (again if failed else "")


def _print_fit(con: Any, fit: Any, boot: Any, iso: Any, level: float) -> None:
    k = f"{fit.k:.3g} (the points' own C)" if fit.k is not None else "6 (no C given: 6ND)"
    con.print(
        f"{len(fit.points)} points; N {_num(min(p.N for p in fit.points))}–"
        f"{_num(max(p.N for p in fit.points))}, D {_num(min(p.D for p in fit.points))}–"
        f"{_num(max(p.D for p in fit.points))}; C/(N·D) = {k}",
        markup=False,
    )
    intervals = boot.intervals(level) if boot is not None else {}
    head = f"{100 * level:g} % interval" if boot is not None else "interval"
    rows = table("parameter", "value", head, title="L(N, D) = E + A/N^α + B/D^β (approach 3)")
    names = {"alpha": "α", "beta": "β", "a": "a = β/(α+β)", "b": "b = α/(α+β)"}
    values = {**fit.params(), "a": fit.a, "b": fit.b}
    for name, value in values.items():
        rows.add_row(names.get(name, name), _plain(value), _range(intervals.get(name), _plain))
    con.print(rows)
    extra = f"; {bootstrap_count(boot)}" if boot is not None else "; no bootstrap"
    con.print(f"rms log residual {fit.rms_log_residual():.3g}{extra}", markup=False)
    if iso is None:
        return
    groups = table("C", "sizes", "N_opt", "D_opt", "loss", title="IsoFLOP minima (approach 2)")
    for g in iso.groups:
        groups.add_row(
            _flops(g.flops),
            str(len({p.N for p in g.points})),
            _num(g.N),
            _num(g.D),
            f"{g.loss:.4g}",
        )
    con.print(groups)
    iv = iso.intervals(level)
    con.print(
        f"N_opt ∝ C^{iso.a:.4g} {_range(iv.get('a'))}, D_opt ∝ C^{iso.b:.4g} {_range(iv.get('b'))}",
        markup=False,
    )
    for c, reason in iso.skipped:
        con.print(f"skipped C ≈ {_flops(c)}: {reason}", markup=False)


# -- plan -----------------------------------------------------------------------------------------


def run_plan(args: argparse.Namespace) -> int:
    from llmkit.experiments import scaling

    if args.fit and args.sources:
        raise LlmkitError("give either --fit FILE.json or SOURCEs to fit, not both")
    if args.fit:
        fit, boot, iso = scaling.load_fit(args.fit)
    elif args.sources:
        fit, boot, iso, _ = _fit(args, None)
    else:
        raise LlmkitError("nothing to plan from: give --fit FILE.json or SOURCEs to fit")
    plan = scaling.compute_optimal(fit, args.flops, k=args.k, boot=boot, level=args.level)
    report: dict[str, Any] = {"approach3": plan.as_dict(), "law": fit.params()}
    if iso is not None:
        n, d = iso.predict(args.flops)
        iv = iso.predict_intervals(args.flops, args.level)
        report["isoflop"] = {"N": n, "D": d, "intervals": {k: list(v) for k, v in iv.items()}}
    largest = max((p.flops for p in fit.points), default=math.nan)
    report["extrapolation"] = args.flops / largest if math.isfinite(largest) else None
    if args.json:
        write(json.dumps(report) + "\n")
        return 0
    con = console()
    iv = plan.intervals
    rows = table("", "value", f"{100 * plan.level:g} % interval" if iv else "interval")
    rows.add_row("N (non-embedding parameters)", _num(plan.N), _range(iv.get("N")))
    rows.add_row("D (tokens)", _num(plan.D), _range(iv.get("D")))
    rows.add_row(
        "D/N (tokens per parameter)",
        f"{plan.tokens_per_param:.3g}",
        _range(iv.get("tokens_per_param")),
    )
    rows.add_row("predicted loss", f"{plan.loss:.4g}", _range(iv.get("loss")))
    con.print(f"compute-optimal at C = {args.flops:.3g} FLOPs, C = {plan.k:.3g}·N·D", markup=False)
    con.print(rows)
    if "isoflop" in report:
        r = report["isoflop"]
        ivs = r["intervals"]
        con.print(
            f"IsoFLOP power laws (approach 2): N {_num(r['N'])} {_range(ivs.get('N'))}, "
            f"D {_num(r['D'])} {_range(ivs.get('D'))}",
            markup=False,
        )
    if not iv:
        con.print("note: no bootstrap refits, so no intervals", markup=False)
    elif boot is not None and len(boot.samples) < boot.requested:
        con.print(f"note: the intervals rest on {bootstrap_count(boot)}", markup=False)
    ratio = report["extrapolation"]
    if ratio is not None and ratio > 10:
        con.print(
            f"note: {ratio:.3g}× the largest budget fitted; the law is extrapolated", markup=False
        )
    return 0
