"""What a sweep reports: one results row per trial (read from its run directory), the
results files, the plots, and the progress display across trials."""

from __future__ import annotations

import csv
import io
import json
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmkit.experiments.sweep_axes import Trial
from llmkit.experiments.trial import finite, read_records
from llmkit.files import replacing, write_text_atomic

#: The columns of ``results.csv`` around the axis columns (one per spec path the sweep varies).
LEAD_COLUMNS = ["trial", "status"]
TAIL_COLUMNS = [
    "seed",
    "final_val_ce",
    "best_val_ce",
    "final_val_loss",
    "best_val_loss",
    "final_train_loss",
    "steps",
    "tokens",
    "wall_s",
    "params",
    "non_embedding_params",
    "flops",
    "run_dir",
    "error",
]
STATUSES = ("done", "failed", "interrupted", "running", "pending")


#: The column a sweep with ``branch_budgets`` adds: ``<trial>@<step>`` a trial was branched at.
BRANCH_COLUMN = "branched_from"


def columns(axes: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """Every results column, in order (``extra`` last: :data:`BRANCH_COLUMN`)."""
    return [*LEAD_COLUMNS, *axes, *TAIL_COLUMNS, *extra]


def accounting(rs: Any) -> dict[str, int | float]:
    """Parameters (all, and without embeddings) and training FLOPs per token of the model a
    resolved spec describes, built on the meta device (no memory)."""
    from llmkit.model import build_on_meta

    model = build_on_meta(rs)
    block = rs.spec.data.block_size or rs.model.max_seq_len
    return {
        "params": model.num_params(),
        "non_embedding_params": model.num_params(exclude_embeddings=True),
        "train_flops_per_token": model.flops_per_token(block)["train"],
    }


def write_results(
    out: Path, rows: list[dict[str, Any]], axes: Sequence[str], extra: Sequence[str] = ()
) -> None:
    """``results.jsonl`` and ``results.csv`` (lists and tables as JSON), each replaced
    atomically."""
    cols = columns(axes, extra)
    lines = "".join(json.dumps({c: row.get(c) for c in cols}) + "\n" for row in rows)
    write_text_atomic(out / "results.jsonl", lines)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(cols)
    for row in rows:
        writer.writerow([_cell(row.get(c)) for c in cols])
    write_text_atomic(out / "results.csv", buf.getvalue())


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, list | dict):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def read_results(out: Path) -> dict[str, dict[str, Any]]:
    """The rows an earlier run of the sweep wrote, by trial id."""
    return {r["trial"]: r for r in read_records(out / "results.jsonl") if "trial" in r}


# -- plots --------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def plot_metric(
    rows: list[dict[str, Any]],
    axis: str,
    others: Sequence[str],
    metric: str,
    log_x: bool,
    path: Path,
) -> bool:
    """``metric`` against ``axis`` over the done trials: one line per combination of the
    ``others`` axes (a scatter when there are more than 8), each point the mean over seeds
    with bars from the lowest to the highest. False (nothing drawn) without a done trial."""
    points = [r for r in rows if r.get("status") == "done" and finite(r.get(metric))]
    if not points:
        return False
    plt = _pyplot()
    groups: dict[str, dict[str, list[float]]] = {}
    xs: dict[str, Any] = {}
    for r in points:
        group = ", ".join(f"{o.rsplit('.', 1)[-1]}={r.get(o)}" for o in others)
        groups.setdefault(group, {}).setdefault(_key(r.get(axis)), []).append(r[metric])
        xs[_key(r.get(axis))] = r.get(axis)
    numeric = all(_is_number(v) for v in xs.values())
    order = sorted(xs, key=lambda k: xs[k]) if numeric else list(xs)
    position = {k: (xs[k] if numeric else i) for i, k in enumerate(order)}
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    many = len(groups) > 8
    for group, by_x in groups.items():
        keys = sorted(by_x, key=lambda k: position[k])
        x = [position[k] for k in keys]
        mean = [sum(by_x[k]) / len(by_x[k]) for k in keys]
        low = [m - min(by_x[k]) for m, k in zip(mean, keys)]
        high = [max(by_x[k]) - m for m, k in zip(mean, keys)]
        ax.errorbar(
            x,
            mean,
            yerr=[low, high],
            fmt="o" if many else "o-",
            capsize=3,
            markersize=4,
            label=None if many or not group else group,
            color="C0" if many else None,
        )
    if not numeric:
        ax.set_xticks(range(len(order)), [str(xs[k]) for k in order], rotation=20)
    elif log_x and all(v > 0 for v in xs.values()):
        ax.set_xscale("log")
    ax.set_xlabel(axis)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} against {axis}")
    ax.grid(alpha=0.3)
    if not many and any(groups):
        ax.legend(fontsize=7)
    _save(fig, path)
    return True


def plot_curves(runs: list[tuple[str, Path]], path: Path) -> bool:
    """Training (left) and validation (right) loss against step, every trial overlaid.
    False without any metrics to draw."""
    curves = []
    for name, run_dir in runs:
        records = read_records(run_dir / "metrics.jsonl")
        train = [(r["step"], r["loss"]) for r in records if finite(r.get("loss"))]
        val = [(r["step"], r["val_loss"]) for r in records if finite(r.get("val_loss"))]
        if train or val:
            curves.append((name, train, val))
    if not curves:
        return False
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100, sharey=True)
    for i, (name, train, val) in enumerate(curves):
        color = f"C{i % 10}"
        if train:
            left.plot(*zip(*train), color=color, linewidth=1, alpha=0.8, label=name)
        if val:
            right.plot(*zip(*val), "o-", color=color, markersize=3, linewidth=1, label=name)
    left.set_title("training loss")
    right.set_title("validation loss")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    left.set_ylabel("loss (nats/token)")
    if len(curves) <= 12:
        right.legend(fontsize=6)
    _save(fig, path)
    return True


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    plt = _pyplot()
    fig.tight_layout()
    with replacing(path, ".png") as tmp:
        fig.savefig(tmp)
    plt.close(fig)


def draw_plots(
    out: Path,
    rows: list[dict[str, Any]],
    axes: Sequence[str],
    partners: dict[str, set[str]],
    log_axes: set[str],
    metric: str,
) -> list[Path]:
    """Every plot into ``out/plots``: ``<metric>-vs-<axis>.png`` per axis and
    ``loss-curves.png``; the files written."""
    plots = out / "plots"
    plots.mkdir(exist_ok=True)
    written = []
    for axis in axes:
        others = [a for a in axes if a not in partners.get(axis, {axis})]
        path = plots / f"{metric}-vs-{_slug(axis)}.png"
        if plot_metric(rows, axis, others, metric, axis in log_axes, path):
            written.append(path)
    runs = [(r["trial"], out / r["run_dir"]) for r in rows if r.get("run_dir")]
    if plot_curves(runs, plots / "loss-curves.png"):
        written.append(plots / "loss-curves.png")
    return written


# -- progress -----------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if finite(value) else "-"


class SweepProgress:
    """The sweep's progress: a live table of the running trials under a summary line (trials
    done, failed, running and pending; the best so far) on a terminal, else one line per
    trial started and ended. Either way every ended trial gets a permanent line (``log``;
    on a terminal, printed above the table too)."""

    def __init__(
        self,
        name: str,
        total: int,
        metric: str,
        log: Callable[[str], None],
        enabled: bool | None = None,
    ) -> None:
        from rich.console import Console

        self.name, self.total, self.metric = name, total, metric
        self.log = log
        self.status: dict[str, str] = {}
        self.best: tuple[float, str] | None = None
        self.running: dict[str, tuple[Path, int, float]] = {}  # id -> (run, max steps, t0)
        self._live: Any = None
        self._shown = 0.0
        console = Console(highlight=False)
        if console.is_terminal if enabled is None else enabled:
            from rich.live import Live

            self._live = Live(console=console, auto_refresh=False, transient=True)
            self._live.start()

            def show(text: str) -> None:  # above the live table, and to a caller's own log
                console.print(text, markup=False)
                if log is not print:
                    log(text)

            self.log = show

    def set_status(self, trial: str, status: str, row: dict[str, Any] | None = None) -> None:
        self.status[trial] = status
        value = (row or {}).get(self.metric)
        if status == "done" and finite(value) and (self.best is None or value < self.best[0]):
            self.best = (value, trial)

    def counts(self) -> dict[str, int]:
        return {s: sum(1 for v in self.status.values() if v == s) for s in STATUSES}

    def summary(self) -> str:
        c = self.counts()
        parts = [f"{c[s]} {s}" for s in STATUSES if c[s]]
        best = f"; best {self.metric} {self.best[0]:.4f} ({self.best[1]})" if self.best else ""
        return f"sweep {self.name}: {', '.join(parts)} of {self.total}{best}"

    def started(self, trial: Trial, run_dir: Path, max_steps: int, resume_step: int | None) -> None:
        self.set_status(trial.id, "running")
        self.running[trial.id] = (run_dir, max_steps, time.monotonic())
        how = f"resuming from step {resume_step}" if resume_step is not None else "starting"
        if self._live is None:
            self.log(f"[{self._ended()}/{self.total}] {trial.id}: {how}")
        self.refresh(force=True)

    def ended(self, trial: Trial, row: dict[str, Any]) -> None:
        self.running.pop(trial.id, None)
        self.set_status(trial.id, row["status"], row)
        what = row["status"]
        if what == "done":
            what += f": {self.metric} {_fmt(row.get(self.metric))}, {row.get('steps')} steps"
            if finite(row.get("wall_s")):
                what += f" in {row['wall_s']:.1f}s"
        elif what == "failed" and row.get("error"):
            what += f": {row['error']}"
        self.log(f"[{self._ended()}/{self.total}] {trial.id}: {what}")
        self.refresh(force=True)

    def _ended(self) -> int:
        c = self.counts()
        return c["done"] + c["failed"]

    def refresh(self, force: bool = False) -> None:
        """Redraw the live table (at most once a second unless ``force``)."""
        if self._live is None or (not force and time.monotonic() - self._shown < 1.0):
            return
        self._shown = time.monotonic()
        self._live.update(self._render(), refresh=True)

    def _render(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, pad_edge=False)
        for col in ("running", "step", "loss", "val loss", "time"):
            table.add_column(col)
        for trial, (run_dir, max_steps, t0) in self.running.items():
            records = read_records(run_dir / "metrics.jsonl", tail_bytes=16_384)
            train = [r for r in records if "loss" in r]
            val = [r for r in records if "val_loss" in r]
            step = train[-1].get("step", 0) if train else 0
            table.add_row(
                trial,
                f"{step}/{max_steps}",
                _fmt(train[-1].get("loss")) if train else "-",
                _fmt(val[-1].get("val_loss")) if val else "-",
                f"{time.monotonic() - t0:.0f}s",
            )
        return Group(Text(self.summary()), table) if self.running else Text(self.summary())

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
