"""Runs side by side: what differs in their specs, their metrics, and their loss curves.

A run's spec is compared resolved (defaults filled in, so ``lr = 3e-4`` written in one spec
and left to the default in another still shows as equal or different by value), flattened
to dotted paths; only the paths where the runs disagree are kept. The metrics come from
each run's ``metrics.jsonl``: the last training record, the last and best validation
cross-entropy and perplexity (what compares across objectives: a distilled or z-loss run's
``val_loss`` is its objective, not a cross-entropy), its objective, named, and the latest
result of every downstream task evaluated on it (``llmkit eval --task``). The best run is
the one of lowest validation cross-entropy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmkit.errors import LlmkitError

#: Resolved-spec paths never shown as differences: per-layer copies of model-wide choices
#: (a real per-layer difference shows in model.overrides) and where the spec was read from.
HIDDEN_PREFIXES = ("model.layers",)

#: The metric runs are ranked by: the validation cross-entropy, whatever their objective.
RANK_METRIC = "val_ce"

#: The objective of a run without ``train.loss`` or ``train.distill``.
CROSS_ENTROPY = "cross_entropy"

#: The metric table's rows, in order: the cross-entropy first, then the objective (named in
#: the ``objective`` row; ``val_loss``, ``best_val_loss`` and ``train_loss`` are its
#: values), then the run's extent and speed. Other metrics follow, sorted.
METRIC_ORDER = (
    "val_ce",
    "val_ppl",
    "best_val_ce",
    "objective",
    "val_loss",
    "best_val_loss",
    "train_loss",
    "step",
    "tokens",
    "trained_tokens",
    "tokens_per_s",
    "trained_tokens_per_s",
    "elapsed",
)


@dataclass
class RunSummary:
    """One run: its label, flattened resolved spec, metrics and curves."""

    label: str
    path: Path
    spec: dict[str, Any]
    metrics: dict[str, Any]
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` → ``{"a.b": 1, "c": [1, 2]}`` (lists of scalars stay
    values; lists of tables get indices)."""
    out: dict[str, Any] = {}
    if isinstance(value, dict):
        for key, sub in value.items():
            out.update(flatten(sub, f"{prefix}{key}."))
        return out
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        for i, sub in enumerate(value):
            out.update(flatten(sub, f"{prefix}{i}."))
        return out
    out[prefix.rstrip(".")] = value
    return out


def run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """The run directories named: a run itself, or every run under a directory of runs (a
    sweep's ``trials/``, or ``runs/``), in order."""
    from llmkit.runs import SPEC_FILE

    out: list[Path] = []
    for given in paths:
        p = Path(given)
        if (p / SPEC_FILE).is_file():
            out.append(p)
            continue
        if not p.exists():
            raise LlmkitError(f"run not found: {p}")
        base = p / "trials" if (p / "trials").is_dir() else p
        found = sorted(d for d in base.iterdir() if (d / SPEC_FILE).is_file())
        if not found:
            raise LlmkitError(f"{p} is not a run directory and holds none")
        out.extend(found)
    if not out:
        raise LlmkitError("no runs to compare")
    return out


def summarize(path: Path, label: str | None = None) -> RunSummary:
    """A run's resolved spec (flattened) and metrics."""
    from llmkit.errors import SpecError
    from llmkit.runs import METRICS_FILE, open_run
    from llmkit.runs.metrics import MetricsLog

    run = open_run(path)
    try:
        spec = run.resolve().to_dict()
    except SpecError:  # a spec this llmkit no longer resolves: compare it as written
        spec = dict(run.raw)
    flat = {
        k: v
        for k, v in flatten(spec).items()
        if not any(k == p or k.startswith(p + ".") for p in HIDDEN_PREFIXES)
    }
    records = MetricsLog(run.dir / METRICS_FILE).read()
    metrics = _metrics(records)
    if "val_loss" in metrics or "train_loss" in metrics:
        metrics["objective"] = objective_name(flat)
    return RunSummary(label or run.dir.name, run.dir, flat, metrics, _curves(records))


def objective_name(flat: dict[str, Any]) -> str:
    """What a run minimized, from its flattened spec, named as ``llmkit train`` names it:
    ``cross_entropy``, the ``train.loss`` component's name, ``distill`` or
    ``distill(<loss>)``."""
    loss = flat.get("train.loss.name")
    base = loss if isinstance(loss, str) else CROSS_ENTROPY
    if flat.get("train.distill.teacher") is not None:
        return "distill" if loss is None else f"distill({base})"
    return base


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _metrics(records: list[dict[str, Any]]) -> dict[str, Any]:
    train = [r for r in records if _number(r.get("loss")) is not None and "eval" not in r]
    val = [r for r in records if _number(r.get("val_loss")) is not None]
    out: dict[str, Any] = {}
    if train:
        last = train[-1]
        out.update(step=last.get("step"), train_loss=last["loss"])
        for key in ("tokens", "trained_tokens", "elapsed"):
            if key in last:
                out[key] = last[key]
        for key in ("tokens_per_s", "trained_tokens_per_s"):
            speeds = [r[key] for r in train if _number(r.get(key))]
            if speeds:
                out[key] = round(sum(speeds) / len(speeds), 1)
    if val:
        # The cross-entropy: ``val_ce`` (every evaluation writes it now); a record without
        # one is from a run whose objective was the cross-entropy, so its val_loss is it.
        ces = [_number(r.get("val_ce", r["val_loss"])) for r in val]
        if ces[-1] is not None:
            out["val_ce"] = ces[-1]
        if "val_ppl" in val[-1]:
            out["val_ppl"] = val[-1]["val_ppl"]
        elif ces[-1] is not None:
            out["val_ppl"] = round(math.exp(min(ces[-1], 80.0)), 4)
        known = [c for c in ces if c is not None]
        if known:
            out["best_val_ce"] = min(known)
        out["val_loss"] = val[-1]["val_loss"]
        out["best_val_loss"] = min(r["val_loss"] for r in val)
    for record in records:  # the latest evaluation of each task wins
        task = record.get("eval")
        if isinstance(task, str):
            for key, value in record.items():
                if key.startswith(f"{task}/") and not key.endswith("_stderr"):
                    out[key] = value
    return out


def _curves(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """The training loss (the objective), the validation loss (the objective), the
    validation cross-entropy (``val_loss`` where a record has no ``val_ce``: the objective
    was the cross-entropy) and the tokens seen, by step."""
    out: dict[str, list[tuple[int, float]]] = {
        "loss": [],
        "val_loss": [],
        "val_ce": [],
        "tokens": [],
    }
    for r in records:
        step = r.get("step")
        if not isinstance(step, int) or "eval" in r:
            continue
        for key in out:
            value = _number(r.get(key))
            if key == "val_ce" and "val_ce" not in r:
                value = _number(r.get("val_loss"))
            if value is not None:
                out[key].append((step, value))
    return out


def differences(runs: Sequence[RunSummary]) -> dict[str, list[Any]]:
    """The spec paths where the runs disagree (a path one run lacks counts as differing),
    each with every run's value (None where absent), in path order."""
    keys = sorted(set().union(*(r.spec for r in runs)))
    out: dict[str, list[Any]] = {}
    for key in keys:
        values = [r.spec.get(key) for r in runs]
        if any(v != values[0] for v in values[1:]):
            out[key] = values
    return out


def metric_table(runs: Sequence[RunSummary]) -> dict[str, list[Any]]:
    """Every metric any run has, each with every run's value (None where absent); the
    common ones first (:data:`METRIC_ORDER`: the cross-entropy leads)."""
    keys = [k for k in METRIC_ORDER if any(k in r.metrics for r in runs)]
    keys += sorted({k for r in runs for k in r.metrics} - set(METRIC_ORDER))
    return {k: [r.metrics.get(k) for r in runs] for k in keys}


def best_run(runs: Sequence[RunSummary], metric: str = RANK_METRIC) -> RunSummary | None:
    """The run of lowest ``metric`` (the validation cross-entropy: comparable whatever
    each run's objective); None when fewer than two runs have it."""
    ranked = [r for r in runs if _number(r.metrics.get(metric)) is not None]
    if len(ranked) < 2:
        return None
    return min(ranked, key=lambda r: r.metrics[metric])


def plot_curves(runs: Sequence[RunSummary], path: Path, *, x: str = "step") -> None:
    """Training loss (thin; the objective) and validation cross-entropy (thick; comparable
    whatever the objective) of every run, overlaid, against the step or the tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        to_x = _x_axis(run, x)
        objective = run.metrics.get("objective", CROSS_ENTROPY)
        train = "train" if objective == CROSS_ENTROPY else f"train {objective}"
        for key, width, style in (("loss", 1.0, "-"), ("val_ce", 2.0, "o-")):
            points = [(to_x(s), v) for s, v in run.curves.get(key, []) if to_x(s) is not None]
            if points:
                xs, ys = zip(*points)
                label = f"{run.label} ({'val ce' if key == 'val_ce' else train})"
                ax.plot(xs, ys, style, color=color, lw=width, ms=3, label=label, alpha=0.85)
    ax.set_xlabel("tokens" if x == "tokens" else "step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _x_axis(run: RunSummary, x: str) -> Any:
    if x != "tokens":
        return lambda step: step
    tokens = dict(run.curves.get("tokens", []))
    per_step = next((t / s for s, t in sorted(tokens.items()) if s), None)
    return lambda step: tokens.get(step, step * per_step if per_step else None)


def compare(paths: Sequence[str | Path]) -> list[RunSummary]:
    """The runs named (run directories, or directories holding runs), summarized."""
    dirs = run_dirs(paths)
    labels = _labels(dirs)
    return [summarize(d, label) for d, label in zip(dirs, labels)]


def _labels(dirs: Sequence[Path]) -> list[str]:
    """Each run's directory name, with its parent's where two names clash."""
    names = [d.name for d in dirs]
    return [f"{d.parent.name}/{d.name}" if names.count(d.name) > 1 else d.name for d in dirs]
