"""Hyperparameter search with Optuna: TPE (or random) sampling, pruning of poor trials on
the validation loss the trainer reports, and a study in a database several processes or
machines share.

A search file (TOML or YAML) names a base spec, fixed ``set`` overrides, and the parameters
to search, each a spec path with a distribution (:mod:`llmkit.experiments.distributions`,
the vocabulary of a random sweep's axes too)::

    name = "lr-warmup"
    base = "../specs/tiny.toml"
    set = ["train.max_steps=200", "train.eval_interval=50"]
    trials = 16
    [params]
    "optimizer.lr" = { log_uniform = [1e-4, 3e-2] }
    "schedule.warmup_steps" = { int = [0, 100], step = 10 }
    "model.norm" = { choice = ["layernorm", "rmsnorm"] }

Each trial is a normal run directory (``OUT/trials/trial-NNNN``, its output in
``OUT/logs/trial-NNNN.log``), trained as a sweep's trials are: an ``llmkit train``
subprocess (:mod:`llmkit.experiments.trial`). Its value is the best validation loss
(``metric``). Each evaluation the trainer writes is reported to the trial as it appears,
and when the pruner (median by default; Optuna's ``MedianPruner``) says so the trial is
stopped (it ends after its next step, saving a checkpoint) and counts as pruned. The
study lives in ``storage`` (default ``sqlite:///OUT/study.db``); every process that runs the
same search file against the same storage works on the same study, until ``trials``
trials have completed or been pruned. Rerunning after a kill goes on where it stopped: a
trial whose process died (no heartbeat) is marked failed and its parameters tried again.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmkit.errors import LlmkitError, SpecError, first_line, validation_problems
from llmkit.experiments import trial as trial_runner
from llmkit.experiments.distributions import DISTRIBUTIONS, Choice, Distribution, table_keys
from llmkit.experiments.sweep_axes import METRIC_COLUMNS, toml_literal

#: Seconds between a running trial's heartbeats; a trial silent for longer is stale.
HEARTBEAT_S = 20


class SearchSpec(BaseModel):
    """A search file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)
    base: str = Field(description="the base spec file, relative to the search file")
    set: list[str] = Field(default_factory=list, description="overrides of every trial")
    params: dict[str, Distribution] = Field(min_length=1)
    trials: int = Field(20, ge=1, le=100_000, description="completed or pruned trials wanted")
    metric: Literal["best_val_loss", "val_loss"] = "best_val_loss"
    sampler: Literal["tpe", "random"] = "tpe"
    seed: int | None = 0
    startup_trials: int = Field(
        5, ge=0, description="random trials before TPE; trials before pruning starts"
    )
    pruner: Literal["median", "none"] = "median"
    prune_after_steps: int = Field(
        0, ge=0, description="no trial is pruned before this training step"
    )
    storage: str | None = Field(
        None, description="a database URL (default: sqlite:///OUT/study.db)"
    )


def read_search(path: str | Path) -> tuple[SearchSpec, Path]:
    """A validated search file and its directory (relative paths start there)."""
    from llmkit.spec.files import read_spec_file

    p = Path(path)
    if not p.is_file():
        raise LlmkitError(f"search file not found: {p}")
    data = read_spec_file(p)
    try:
        return SearchSpec.model_validate(data), p.parent
    except ValidationError as exc:
        problems = validation_problems(exc, top="search", shown=_shown, allowed=_allowed)
        raise SpecError(problems, str(p)) from None


def _is_tag(loc: tuple[Any, ...], i: int) -> bool:
    """Whether ``loc[i]`` is the tag pydantic adds to a parameter's errors (not in the file):
    ``params.<path>.<tag>``."""
    return i == 2 and loc[0] == "params" and loc[i] in DISTRIBUTIONS


def _shown(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(part for i, part in enumerate(loc) if not _is_tag(loc, i))


def _allowed(loc: tuple[Any, ...]) -> list[str]:
    """The keys of the table an unknown key at ``loc`` sits in."""
    if len(loc) > 3 and _is_tag(loc, 2):
        return table_keys(DISTRIBUTIONS[loc[2]])
    return table_keys(SearchSpec)


def default_out(name: str) -> Path:
    """Where a search writes by default: where a sweep does, ``runs/sweeps/<name>``."""
    from llmkit.experiments.sweep import DEFAULT_ROOT

    return DEFAULT_ROOT / name


#: What fails one trial (recorded, and the study goes on) rather than the whole search.
FAILURES = (LlmkitError, RuntimeError, ValueError)


def _override(path: str, value: Any) -> str:
    return f"{path}={toml_literal(value)}"


def check_search(search: SearchSpec, base: Path) -> None:
    """Resolve the base spec with every parameter at each end of its range (each choice):
    all problems at once, before any trial runs."""
    from llmkit.model import build_problems
    from llmkit.spec import load_spec

    problems: list[str] = []
    tried: set[tuple[str, str]] = set()
    for path, dist in search.params.items():
        for value in dist.ends():
            key = (path, json.dumps(value))
            if key in tried:
                continue
            tried.add(key)
            try:
                rs = load_spec(base, [*search.set, _override(path, value)])
                found = build_problems(rs)
                if found:
                    raise SpecError(found)
            except SpecError as exc:
                problems += [f"{path} = {value!r}: {p}" for p in exc.problems]
            except LlmkitError as exc:
                problems.append(f"{path} = {value!r}: {exc}")
    if problems:
        raise SpecError(sorted(set(problems)), f"search {search.name}")


@dataclass
class SearchResult:
    """The study's trials (one row each) and its best trial's row."""

    rows: list[dict[str, Any]]
    best: dict[str, Any] | None
    out: Path


def _study(search: SearchSpec, out: Path, storage: str | None, seed_offset: int = 0) -> Any:
    import optuna
    from optuna.storages import RDBStorage, RetryFailedTrialCallback

    url = storage or search.storage or f"sqlite:///{(out / 'study.db').resolve()}"
    rdb = RDBStorage(
        url,
        heartbeat_interval=HEARTBEAT_S,
        grace_period=2 * HEARTBEAT_S,
        heartbeat_stale_trial_callback=RetryFailedTrialCallback(max_retry=1),
    )
    # every process needs its own seed: equal seeds would draw equal trials side by side
    seed = None if search.seed is None else search.seed + seed_offset
    if search.sampler == "tpe":
        sampler: Any = optuna.samplers.TPESampler(seed=seed, n_startup_trials=search.startup_trials)
    else:
        sampler = optuna.samplers.RandomSampler(seed=seed)
    pruner: Any = (
        optuna.pruners.MedianPruner(
            n_startup_trials=search.startup_trials, n_warmup_steps=search.prune_after_steps
        )
        if search.pruner == "median"
        else optuna.pruners.NopPruner()
    )
    return optuna.create_study(
        study_name=search.name,
        storage=rdb,
        sampler=sampler,
        pruner=pruner,
        direction="minimize",
        load_if_exists=True,
    )


def run_search(
    path: str | Path,
    *,
    out: str | Path | None = None,
    trials: int | None = None,
    storage: str | None = None,
    seed_offset: int = 0,
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> SearchResult:
    """Run (or go on with) the search of a search file until its study holds ``trials``
    (default: the file's) completed or pruned trials; this process's share of the work
    when others run the same study. Each process working on one study needs its own
    ``seed_offset`` (added to the file's seed): ``--workers`` numbers its processes, and
    machines sharing a study pass ``--seed-offset``. Each trial is an ``llmkit train``
    subprocess (:mod:`llmkit.experiments.trial`) with ``threads`` CPU threads (default:
    every core this process may use)."""
    try:
        import optuna
    except ImportError:
        raise LlmkitError("llmkit search needs Optuna: pip install 'llmkit[optuna]'") from None

    from llmkit.experiments.sweep import LOGS_DIR
    from llmkit.spec import load_spec

    search, where = read_search(path)
    if trials is not None:
        search = search.model_copy(update={"trials": trials})
    base = where / search.base
    check_search(search, base)
    out_dir = Path(out) if out else default_out(search.name)
    (out_dir / "trials").mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = _study(search, out_dir, storage, seed_offset)
    done_states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    threads = threads if threads is not None else trial_runner.threads_per_worker(1)

    def objective(trial: Any) -> float:
        try:
            return run_trial(trial)
        except FAILURES as exc:  # recorded and reported; Optuna marks the trial failed
            trial.set_user_attr("error", first_line(exc))
            log(f"trial {trial.number}: failed: {first_line(exc)}")
            raise

    def run_trial(trial: Any) -> float:
        values = {p: d.suggest(trial, p) for p, d in search.params.items()}
        name = f"trial-{trial.number:04d}"
        run_dir = out_dir / "trials" / name
        trial.set_user_attr("run_dir", str(run_dir))
        overrides = [*search.set, *(_override(p, v) for p, v in values.items())]
        shown = ", ".join(f"{p}={_short(v)}" for p, v in values.items())
        log(f"trial {trial.number}: {shown}")
        max_steps = load_spec(base, overrides).spec.train.max_steps
        reported: list[float] = []

        def on_eval(step: int, val_loss: float) -> bool:
            trial.report(val_loss, step)
            reported.append(val_loss)
            return bool(trial.should_prune())

        job = trial_runner.TrialJob(
            run_dir=run_dir,
            log=out_dir / LOGS_DIR / f"{name}.log",
            spec=base,
            overrides=overrides,
            max_steps=max_steps,
            threads=threads,
        )
        ended = trial_runner.run_trial(job, on_eval)
        if ended.error is not None:
            raise LlmkitError(ended.error)
        numbers = ended.numbers
        trial.set_user_attr("steps", numbers.get("steps"))
        trial.set_user_attr("tokens", numbers.get("tokens"))
        trial.set_user_attr("wall_s", ended.wall_s)
        if ended.stopped_at is not None:
            at = min(reported) if search.metric == "best_val_loss" else reported[-1]
            log(f"trial {trial.number}: pruned at step {ended.stopped_at} (val {at:.4f})")
            raise optuna.TrialPruned()
        value = numbers.get(METRIC_COLUMNS[search.metric])
        if value is None or not math.isfinite(value):
            raise LlmkitError(f"trial {trial.number} ended without a finite validation loss")
        log(f"trial {trial.number}: {search.metric} {value:.4f}")
        return float(value)

    from optuna.study import MaxTrialsCallback

    done = len(study.get_trials(deepcopy=False, states=done_states))
    if done < search.trials:
        log(f"study {search.name}: {done} of {search.trials} trials done; going on")
        study.optimize(
            objective,
            callbacks=[
                MaxTrialsCallback(search.trials, states=done_states),
                _FailureLimit(study, search.trials, log),
            ],
            catch=FAILURES,
        )
    rows = trial_rows(study, search)
    write_results(out_dir, rows, search)
    best = min(
        (r for r in rows if r["state"] == "COMPLETE" and r["value"] is not None),
        key=lambda r: r["value"],
        default=None,
    )
    return SearchResult(rows, best, out_dir)


class _FailureLimit:
    """Stops a study once as many trials have failed in this call as it was asked to
    complete (failed trials do not count towards ``trials``, so a search whose every trial
    fails would otherwise never end), saying why the last one failed."""

    def __init__(self, study: Any, limit: int, log: Callable[[str], None]) -> None:
        import optuna

        self.fail = optuna.trial.TrialState.FAIL
        self.before = len(study.get_trials(deepcopy=False, states=(self.fail,)))
        self.limit, self.log = max(1, limit), log

    def __call__(self, study: Any, trial: Any) -> None:
        if trial.state != self.fail:
            return
        failed = len(study.get_trials(deepcopy=False, states=(self.fail,))) - self.before
        if failed >= self.limit:
            reason = trial.user_attrs.get("error", "see the log")
            self.log(f"study stopped: {failed} trials failed; the last: {reason}")
            study.stop()


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def trial_rows(study: Any, search: SearchSpec) -> list[dict[str, Any]]:
    """One row per trial: number, state, value, each parameter, steps, tokens, wall time,
    run directory."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        row: dict[str, Any] = {"trial": t.number, "state": t.state.name, "value": t.value}
        row.update({p: t.params.get(p) for p in search.params})
        for key in ("steps", "tokens", "wall_s", "run_dir", "error"):
            row[key] = t.user_attrs.get(key)
        if t.intermediate_values:
            row["last_reported_step"] = max(t.intermediate_values)
        rows.append(row)
    return rows


def write_results(out: Path, rows: list[dict[str, Any]], search: SearchSpec) -> None:
    """``results.csv``, ``results.jsonl`` and ``plots/`` (the value against each parameter,
    and the best value so far against the trial number)."""
    from llmkit.files import write_text_atomic

    columns = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(out / "results.csv", buf.getvalue())
    write_text_atomic(out / "results.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    _plot(out / "plots", rows, search)


def _plot(directory: Path, rows: list[dict[str, Any]], search: SearchSpec) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["state"] == "COMPLETE" and r["value"] is not None]
    if not done:
        return
    directory.mkdir(parents=True, exist_ok=True)
    for path, dist in search.params.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r[path] for r in done]
        categorical = isinstance(dist, Choice)
        ax.scatter([str(x) for x in xs] if categorical else xs, [r["value"] for r in done])
        if dist.log:
            ax.set_xscale("log")
        ax.set_xlabel(path)
        ax.set_ylabel(search.metric)
        ax.set_title(f"{search.name}: {len(done)} completed trials")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(directory / f"{path.replace('.', '_')}.png", dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    ordered = sorted(done, key=lambda r: r["trial"])
    best, running = math.inf, []
    for r in ordered:
        best = min(best, r["value"])
        running.append(best)
    ax.plot([r["trial"] for r in ordered], [r["value"] for r in ordered], "o", label="trial")
    ax.plot([r["trial"] for r in ordered], running, "-", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(search.metric)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(directory / "history.png", dpi=110)
    plt.close(fig)
