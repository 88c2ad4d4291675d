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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmkit.errors import LlmkitError, SpecError, first_line, validation_problems
from llmkit.experiments import trial as trial_runner
from llmkit.experiments.distributions import DISTRIBUTIONS, Choice, Distribution, table_keys
from llmkit.experiments.search_storage import (
    given_storage,
    open_given_storage,
    open_storage,
    quiet_optuna,
    storage_problem,
)
from llmkit.experiments.sweep_axes import (
    METRIC_COLUMNS,
    PATH_PATTERN,
    check_assignments,
    check_overrides,
    toml_literal,
)

#: The largest sampler seed (the file's ``seed`` plus ``--seed-offset``): Optuna's samplers
#: seed NumPy, which takes 0 … 2**32 - 1.
MAX_SEED = 2**32 - 1


class SearchSpec(BaseModel):
    """A search file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)
    base: str = Field(min_length=1, description="the base spec file, relative to the search file")
    set: list[str] = Field(default_factory=list, description="overrides of every trial")
    params: dict[str, Distribution] = Field(min_length=1)
    trials: int = Field(20, ge=1, le=100_000, description="completed or pruned trials wanted")
    metric: Literal["best_val_ce", "val_ce", "best_val_loss", "val_loss"] = Field(
        "best_val_ce",
        description="what trials are ranked and pruned by: the best or final validation "
        "cross-entropy (comparable across objectives) or objective (val_loss)",
    )
    sampler: Literal["tpe", "random"] = "tpe"
    seed: int | None = Field(0, ge=0, le=MAX_SEED, description="the sampler's seed")
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

    @field_validator("set")
    @classmethod
    def _assignments(cls, sets: list[str]) -> list[str]:
        return check_assignments(sets)

    @field_validator("params")
    @classmethod
    def _paths(cls, params: dict[str, Any]) -> dict[str, Any]:
        bad = [p for p in params if not PATH_PATTERN.fullmatch(p)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a spec path such as optimizer.lr")
        return params

    @field_validator("storage")
    @classmethod
    def _storage(cls, url: str | None) -> str | None:
        problem = None if url is None else storage_problem(url)
        if problem:
            raise ValueError(problem)
        return url


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


def check_seed(search: SearchSpec, seed_offset: int) -> None:
    """The sampler's seed (the file's plus ``seed_offset``) must be one NumPy takes."""
    if search.seed is not None and search.seed + seed_offset > MAX_SEED:
        raise LlmkitError(
            f"seed {search.seed} + --seed-offset {seed_offset} = {search.seed + seed_offset} "
            f"is above {MAX_SEED}, the largest seed Optuna's samplers take; use smaller ones"
        )


#: What fails one trial (recorded, and the study goes on) rather than the whole search.
FAILURES = (LlmkitError, RuntimeError, ValueError)


def _override(path: str, value: Any) -> str:
    return f"{path}={toml_literal(value)}"


def prepare_search(
    path: str | Path,
    *,
    trials: int | None = None,
    overrides: list[str] | None = None,
    max_steps: int | None = None,
) -> tuple[SearchSpec, Path]:
    """A search file read, with ``trials`` and the command line's ``--set`` ``overrides``
    (after the file's ``set``; none may touch a searched parameter) folded in, and its base
    spec (relative to the file, or a preset; a one-line error naming both paths when
    missing)."""
    from llmkit.experiments.sweep import resolve_base

    search, _ = read_search(path)
    sets = list(overrides or [])
    check_overrides(sets, max_steps, list(search.params), "search")
    update: dict[str, Any] = {"set": [*search.set, *sets]}
    if trials is not None:
        update["trials"] = trials
    return search.model_copy(update=update), resolve_base(search.base, Path(path), "search")


def check_search(search: SearchSpec, base: Path, max_steps: int | None = None) -> None:
    """Resolve the base spec with every parameter at each end of its range (each choice),
    cut to ``max_steps`` (``--max-steps``) as the trials will be, and check each model
    (:func:`llmkit.experiments.trial.model_problems`: it fits this machine's memory, its
    components take their dimensions; built on the meta device when large): all problems at
    once, before any trial runs. When every end passes, combinations are checked too, up to
    the first that fails: each parameter at the end that gave the largest model (the largest
    model the search can draw when sizes grow with each parameter), all at their high ends,
    all at their low ends; so that no trial meets what no single end showed (a model too
    large for this machine, above all). Each trial is checked again as it starts
    (:func:`llmkit.experiments.trial.memory_problems`)."""
    problems: list[str] = []
    sizes: dict[str, list[tuple[int, Any]]] = {}  # path -> [(model size, value)]
    for path, dist in search.params.items():
        for value in dist.ends():
            if any(json.dumps(v) == json.dumps(value) for _, v in sizes.get(path, [])):
                continue
            found, size = _check_values(search, base, max_steps, {path: value})
            problems += [f"{path} = {value!r}: {p}" for p in found]
            sizes.setdefault(path, []).append((size or 0, value))
    if not problems and len(search.params) > 1:
        largest = {p: max(vs, key=lambda sv: sv[0])[1] for p, vs in sizes.items()}
        corners = {
            "the largest model": largest,
            "every parameter at its high end": {p: d.ends()[-1] for p, d in search.params.items()},
            "every parameter at its low end": {p: d.ends()[0] for p, d in search.params.items()},
        }
        tried: set[str] = set()
        for what, values in corners.items():
            key = json.dumps(values, sort_keys=True)
            if key in tried:
                continue
            tried.add(key)
            found, _ = _check_values(search, base, max_steps, values)
            shown = ", ".join(f"{p} = {v!r}" for p, v in values.items())
            problems += [f"{shown} ({what}): {p}" for p in found]
            if problems:  # the first corner that fails says enough: the others repeat it
                break
    if problems:
        raise SpecError(sorted(set(problems)), f"search {search.name}")


def _check_values(
    search: SearchSpec, base: Path, max_steps: int | None, values: dict[str, Any]
) -> tuple[list[str], int | None]:
    """The problems of a trial with ``values`` (spec path -> value), and its model's size
    (:func:`llmkit.experiments.trial.model_size`; None when it does not resolve)."""
    from llmkit.spec import load_spec

    sets = [*search.set, *(_override(p, v) for p, v in values.items())]
    try:
        rs = load_spec(base, trial_runner.cut_overrides(base, sets, max_steps))
        return trial_runner.model_problems(rs), trial_runner.model_size(rs)
    except SpecError as exc:
        return list(exc.problems), None
    except LlmkitError as exc:
        return [str(exc)], None


@dataclass
class SearchResult:
    """The study's trials (one row each) and its best trial's row."""

    rows: list[dict[str, Any]]
    best: dict[str, Any] | None
    out: Path


#: The study's user attribute recording the command line's ``--set`` and ``--max-steps``.
PLAN_ATTR = "llmkit_plan"


def _check_same_plan(study: Any, plan: dict[str, Any]) -> None:
    """A study's trials must all train the same way: the first process records ``plan``
    (the trials' overrides and ``--max-steps``), every later one must match it (one line)."""

    def flags(d: dict[str, Any]) -> str:
        sets = " ".join(d.get("set") or [])
        steps = d.get("max_steps")
        return (f"set/--set {sets}" if sets else "no set/--set") + (
            f" and --max-steps {steps}" if steps is not None else " and no --max-steps"
        )

    before = study.user_attrs.get(PLAN_ATTR)
    if before is None:
        study.set_user_attr(PLAN_ATTR, plan)
    elif before != plan:
        raise LlmkitError(
            f"study {study.study_name} was run with {flags(before)}, now with {flags(plan)}: "
            "its trials would not compare; rerun with the same ones, or use another --out "
            "(or --storage)"
        )


def _study(search: SearchSpec, storage: Any, seed_offset: int = 0) -> Any:
    """The search's study in ``storage`` (:func:`open_storage`), made or loaded."""
    import optuna

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
        storage=storage,
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
    overrides: list[str] | None = None,
    max_steps: int | None = None,
    max_time: float | None = None,
) -> SearchResult:
    """Run (or go on with) the search of a search file until its study holds ``trials``
    (default: the file's) completed or pruned trials; this process's share of the work
    when others run the same study. Each process working on one study needs its own
    ``seed_offset`` (added to the file's seed): ``--workers`` numbers its processes, and
    machines sharing a study pass ``--seed-offset``. Each trial is an ``llmkit train``
    subprocess (:mod:`llmkit.experiments.trial`) with ``threads`` CPU threads (default:
    every core this process may use). ``overrides``, ``max_steps`` and ``max_time`` are
    ``llmkit train``'s ``--set`` (after the file's ``set``), ``--max-steps`` and
    ``--max-time`` for every trial; the study records the first two, and a process giving
    others is refused (its trials would not compare)."""
    try:
        import optuna  # noqa: F401  (quiet_optuna and the study import it)
    except ImportError:
        raise LlmkitError("llmkit search needs Optuna: pip install 'llmkit[optuna]'") from None

    with quiet_optuna():
        return _run_search(
            path, out, trials, storage, seed_offset, threads, log, overrides, max_steps, max_time
        )


def _run_search(
    path: str | Path,
    out: str | Path | None,
    trials: int | None,
    storage: str | None,
    seed_offset: int,
    threads: int | None,
    log: Callable[[str], None],
    overrides: list[str] | None,
    max_steps: int | None,
    max_time: float | None,
) -> SearchResult:
    import optuna

    from llmkit.experiments.sweep import LOGS_DIR
    from llmkit.spec import load_spec

    search, base = prepare_search(path, trials=trials, overrides=overrides, max_steps=max_steps)
    check_search(search, base, max_steps)
    check_seed(search, seed_offset)
    out_dir = Path(out) if out else default_out(search.name)
    rdb = open_given_storage(search, storage, path, out_dir)  # before OUT is made
    (out_dir / "trials").mkdir(parents=True, exist_ok=True)
    if rdb is None:
        given = given_storage(search, storage, path)
        url = given[0] if given else f"sqlite:///{(out_dir / 'study.db').resolve()}"
        rdb = open_storage(url, given[1] if given else f"the study's database in {out_dir}")
    study = _study(search, rdb, seed_offset)
    _check_same_plan(study, {"set": search.set, "max_steps": max_steps})
    done_states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    threads = threads if threads is not None else trial_runner.threads_per_worker(1)
    watched = search.metric.removeprefix("best_")  # the record key each evaluation reports

    def objective(trial: Any) -> float:
        try:
            return run_trial(trial)
        except FAILURES as exc:  # recorded and reported; Optuna marks the trial failed
            trial.set_user_attr("error", first_line(exc))
            took = trial.user_attrs.get("wall_s")
            after = f" after {took:.1f} s" if took is not None else ""
            log(f"trial {trial.number}: failed{after}: {first_line(exc)}")
            raise

    def run_trial(trial: Any) -> float:
        values = {p: d.suggest(trial, p) for p, d in search.params.items()}
        name = f"trial-{trial.number:04d}"
        run_dir = out_dir / "trials" / name
        trial.set_user_attr("run_dir", str(run_dir))
        overrides = [*search.set, *(_override(p, v) for p, v in values.items())]
        shown = ", ".join(f"{p}={_short(v)}" for p, v in values.items())
        cut = trial_runner.cut_overrides(base, overrides, max_steps)
        rs = load_spec(base, cut)
        too_big = trial_runner.memory_problems(rs)  # refused before any process allocates it
        if too_big:
            raise LlmkitError(f"{shown}: {too_big[0]}")
        last = rs.spec.train.max_steps
        scaled = cut[len(overrides) : -1]  # the warmup --max-steps scales down to fit
        if scaled:
            shown += f" (--max-steps {max_steps} sets {scaled[0]})"
        log(f"trial {trial.number}: started, {last} steps: {shown}")
        reported: list[float] = []

        def on_eval(step: int, value: float) -> bool:
            trial.report(value, step)
            reported.append(value)
            prune = bool(trial.should_prune())
            verdict = "; pruned: stopping it" if prune else ""
            log(f"trial {trial.number}: step {step}/{last}: {watched} {value:.4f}{verdict}")
            return prune

        job = trial_runner.TrialJob(
            run_dir=run_dir,
            log=out_dir / LOGS_DIR / f"{name}.log",
            spec=base,
            overrides=overrides,
            max_steps=last,
            threads=threads,
            cut_steps=max_steps,
            max_time=max_time,
        )
        ended = trial_runner.run_trial(job, on_eval, key=watched)
        trial.set_user_attr("wall_s", ended.wall_s)
        if ended.error is not None:
            raise LlmkitError(ended.error)
        numbers = ended.numbers
        trial.set_user_attr("steps", numbers.get("steps"))
        trial.set_user_attr("tokens", numbers.get("tokens"))
        trained = f"{numbers.get('steps')} steps, {ended.wall_s:.1f} s"
        if ended.stopped_at is not None:
            trial.set_user_attr("pruned_at", ended.stopped_at)
            at = min(reported) if search.metric.startswith("best_") else reported[-1]
            log(
                f"trial {trial.number}: pruned at step {ended.stopped_at}, "
                f"{search.metric} {at:.4f} ({trained})"
            )
            raise optuna.TrialPruned()
        value = numbers.get(METRIC_COLUMNS[search.metric])
        if value is None or not math.isfinite(value):
            raise LlmkitError(f"trial {trial.number} ended without a finite validation loss")
        log(f"trial {trial.number}: complete, {search.metric} {value:.4f} ({trained})")
        return float(value)

    from optuna.study import MaxTrialsCallback

    done = len(study.get_trials(deepcopy=False, states=done_states))
    if max_steps is not None and search.pruner != "none" and search.prune_after_steps >= max_steps:
        log(
            f"note: prune_after_steps ({search.prune_after_steps}) is not below --max-steps "
            f"({max_steps}): no trial will be pruned"
        )
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
    """A parameter's value as a trial's line shows it: floats to 4 digits, else as --set."""
    if isinstance(value, float):
        return f"{value:.4g}"
    try:
        return toml_literal(value)
    except ValueError:
        return str(value)


def trial_rows(study: Any, search: SearchSpec) -> list[dict[str, Any]]:
    """One row per trial: number, state, value, each parameter, steps trained, ``pruned_at``
    (a pruned trial's evaluation step it was judged at; it trains one step past it), tokens,
    wall time, run directory, error."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        row: dict[str, Any] = {"trial": t.number, "state": t.state.name, "value": t.value}
        row.update({p: t.params.get(p) for p in search.params})
        row["steps"] = t.user_attrs.get("steps")
        row["pruned_at"] = None
        if t.state.name == "PRUNED":  # older studies did not record it: their last report
            last = max(t.intermediate_values, default=None)
            row["pruned_at"] = t.user_attrs.get("pruned_at", last)
        for key in ("tokens", "wall_s", "run_dir", "error"):
            row[key] = t.user_attrs.get(key)
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
