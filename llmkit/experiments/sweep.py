"""Sweeps: many trainings of one base spec over axes of values (``llmkit sweep SWEEP_FILE``).

:func:`run_sweep` reads a sweep file (:mod:`llmkit.experiments.sweep_axes`: its format,
axes and trial ids), resolves every trial's spec before any trial starts (all problems of
all trials reported at once), and trains the trials ``workers`` at a time, each an
``llmkit train`` subprocess with its share of the CPU threads, started, stopped and read
through the trial runner every experiment uses (:mod:`llmkit.experiments.trial`). Each
trial is a normal run directory under ``<sweep>/trials/``. Rerunning the same sweep skips
the done trials, resumes the interrupted ones from their last checkpoint (``llmkit train
--resume``: exact) and starts the rest; a failed trial is recorded and rerun only with
``retry_failed``.
Results (:mod:`llmkit.experiments.sweep_report`) are rewritten after every trial.

Layout of ``<sweep>/``::

    sweep.toml / sweep.yaml  a copy of the sweep file
    sweep.json               the trials and their overrides (a rerun must match them)
    trials/<id>/             each trial's run directory
    logs/<id>.log            each trial's output (appended on every attempt)
    results.jsonl, results.csv, plots/
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmkit.errors import LlmkitError, SpecError, first_line
from llmkit.experiments import sweep_branches
from llmkit.experiments import sweep_report as report
from llmkit.experiments.sweep_axes import (
    METRIC_COLUMNS,
    SweepFile,
    Trial,
    axis_paths,
    check_overrides,
    expand,
    log_axes,
    read_sweep,
    varied_paths,
    zip_partners,
)
from llmkit.experiments.trial import (
    TrialJob,
    TrialProcess,
    cut_overrides,
    model_problems,
    summarize,
    threads_per_worker,
    visible_gpus,
)

#: Where a sweep's directory goes by default: ``runs/sweeps/<name>`` under the current
#: directory, beside the runs ``llmkit train`` makes (``runs/<name>-<time>``).
DEFAULT_ROOT = Path("runs") / "sweeps"
DEFINITION_FILE = "sweep.json"
TRIALS_DIR = "trials"
LOGS_DIR = "logs"
WEIGHTS = "model.safetensors"
#: Seconds between looks at the running trials.
POLL_S = 0.1


@dataclass
class SweepPlan:
    """A sweep file read and expanded: its trials, and the base spec they start from.
    ``sets`` and ``max_steps``: the command line's ``--set`` overrides (in every trial's
    overrides, after the file's ``set``) and ``--max-steps`` (passed to every new trial's
    ``llmkit train``); both are part of what the sweep trains, so a rerun must repeat them."""

    sweep: SweepFile
    name: str
    base: Path
    trials: list[Trial]
    source: Path | None = None
    sets: list[str] = field(default_factory=list)
    max_steps: int | None = None

    @property
    def axes(self) -> list[str]:
        return axis_paths(self.sweep)

    def overrides(self, trial: Trial) -> list[str]:
        """What the trial's ``llmkit train`` resolves: its overrides, cut to ``max_steps``."""
        return cut_overrides(self.base, trial.overrides, self.max_steps)


@dataclass
class SweepResult:
    """How a sweep ended: its directory, one row per trial (the results columns), the plots
    drawn, and the signal that stopped it early (None when it ran to the end)."""

    dir: Path
    rows: list[dict[str, Any]]
    columns: list[str]
    metric: str
    plots: list[Path] = field(default_factory=list)
    stopped: str | None = None

    def counts(self) -> dict[str, int]:
        """Trials by status (done, failed, interrupted, running, pending)."""
        return {s: sum(1 for r in self.rows if r["status"] == s) for s in report.STATUSES}

    def best(self) -> dict[str, Any] | None:
        """The done trial with the lowest metric, or None."""
        done = [r for r in self.rows if r["status"] == "done" and r.get(self.metric) is not None]
        return min(done, key=lambda r: r[self.metric]) if done else None


def load_plan(
    sweep: str | Path | SweepFile,
    *,
    overrides: list[str] | None = None,
    max_steps: int | None = None,
) -> SweepPlan:
    """Read (a path) or take (a :class:`SweepFile`) a sweep and expand its trials; a file's
    ``base`` is relative to the file, a model's to the current directory. ``overrides``
    (``--set``) and ``max_steps`` (``--max-steps``) apply to every trial, as ``llmkit
    train``'s do; neither may touch what the sweep varies (one-line :class:`LlmkitError`)."""
    if isinstance(sweep, SweepFile):
        model, source = sweep, None
    else:
        source = Path(sweep)
        model = read_sweep(source)
    sets = list(overrides or [])
    check_overrides(sets, max_steps, varied_paths(model), "sweep")
    name = model.name or (source.stem if source is not None else "sweep")
    base = resolve_base(model.base, source, "sweep")
    return SweepPlan(model, name, base, expand(model, sets), source, sets, max_steps)


def resolve_base(base: str, source: Path | None, what: str = "sweep") -> Path:
    """The spec file a sweep's or search's ``base`` names: a path relative to the ``source``
    file (to the current directory without one), or a preset name. When there is none, a
    one-line :class:`LlmkitError` names ``base`` as written and the path it was read as."""
    from llmkit.spec import presets

    where = f"relative to {source}" if source is not None else "relative to the current directory"
    try:
        candidate = Path(base).expanduser()  # RuntimeError: ~user of no such user
        if not candidate.is_absolute():
            candidate = (source.parent if source is not None else Path.cwd()) / candidate
        if candidate.is_file():  # ValueError: a NUL byte; OSError: a name too long
            from llmkit.spec import load_raw

            load_raw(candidate)  # one line for a file that is no spec, not one per trial
            return candidate.resolve()
        shown = str(candidate.resolve())
    except (OSError, ValueError, RuntimeError) as exc:
        raise LlmkitError(
            f"base {base[:200]!r} ({where}): not a path to a spec file ({first_line(exc)}); "
            f"fix `base` in the {what} file"
        ) from None
    known = presets()
    if base in known:
        return known[base]
    raise LlmkitError(
        f"base {base!r} ({where}): no spec file {shown}, nor a preset of that "
        f"name; fix `base` in the {what} file"
    )


def validate_plan(plan: SweepPlan) -> dict[str, Any]:
    """Every trial's resolved spec, by trial id; a :class:`SpecError` listing each invalid
    trial's problems (every one of them) when any trial does not resolve."""
    from llmkit.spec import load_spec

    specs: dict[str, Any] = {}
    problems: list[str] = []
    bad = 0
    for trial in plan.trials:
        try:
            specs[trial.id] = rs = load_spec(plan.base, plan.overrides(trial))
            found = model_problems(rs)  # too large to build here; bad dimensions
            if found:
                raise SpecError(found)
        except SpecError as exc:
            bad += 1
            problems += [f"{trial.id}: {p}" for p in exc.problems]
        except LlmkitError as exc:
            bad += 1
            problems.append(f"{trial.id}: {exc}")
    if problems:
        where = str(plan.source) if plan.source is not None else f"sweep {plan.name}"
        n = len(plan.trials)
        raise SpecError(problems, f"{where} ({bad} of {n} trials invalid; none was run)")
    return specs


def trial_state(run_dir: Path, max_steps: int) -> str:
    """What a trial's run directory holds: ``pending`` (nothing to resume from),
    ``interrupted`` (a checkpoint before the end) or ``done`` (final weights at the last
    step)."""
    from llmkit.runs.checkpoints import Checkpoints

    if not run_dir.is_dir():
        return "pending"
    latest = Checkpoints(run_dir).latest()
    if latest is None:
        return "pending"
    step = int(latest.name.removeprefix("step-"))
    return "done" if step >= max_steps and (run_dir / WEIGHTS).is_file() else "interrupted"


def run_sweep(
    sweep: str | Path | SweepFile,
    *,
    workers: int = 1,
    out: str | Path | None = None,
    retry_failed: bool = False,
    log: Callable[[str], None] = print,
    progress: bool | None = None,
    overrides: list[str] | None = None,
    max_steps: int | None = None,
    max_time: float | None = None,
) -> SweepResult:
    """Run (or finish) a sweep into ``out`` (default ``runs/sweeps/<name>``): every trial
    validated first, then trained ``workers`` at a time; done trials are skipped, interrupted
    ones resumed, failed ones rerun only with ``retry_failed``. SIGINT/SIGTERM stop the
    running trials at their next step, each saving a checkpoint (a second signal kills
    them). ``overrides``, ``max_steps`` and ``max_time`` are ``llmkit train``'s ``--set``,
    ``--max-steps`` and ``--max-time`` for every trial; a rerun must give the same
    ``overrides`` and ``max_steps`` (they change what the trials train), ``max_time`` may
    differ (it limits each trial's training time, as on ``llmkit train --resume``)."""
    if workers < 1:
        raise LlmkitError(f"workers must be at least 1, got {workers}")
    if max_time is not None and not max_time > 0:
        raise LlmkitError(f"max_time must be a number of seconds > 0, got {max_time}")
    plan = load_plan(sweep, overrides=overrides, max_steps=max_steps)
    specs = validate_plan(plan)
    branches = sweep_branches.plan_branches(plan, specs) if plan.sweep.branch_budgets else {}
    out_dir = Path(out) if out is not None else DEFAULT_ROOT / plan.name
    out_dir.mkdir(parents=True, exist_ok=True)
    from llmkit.runs.lock import LOCK_FILE, RunInUse, RunLock

    lock = RunLock(out_dir)
    try:
        lock.acquire()
    except RunInUse:
        holder = (out_dir / LOCK_FILE).read_text().strip() or "unknown"
        raise LlmkitError(
            f"{out_dir} is in use by another sweep (pid {holder}); wait for it to end or stop it"
        ) from None
    try:
        runner = _Runner(plan, specs, out_dir.absolute(), workers, retry_failed, log, progress)
        runner.branches, runner.max_time = branches, max_time
        return runner.run()
    finally:
        lock.release()


@dataclass
class _Running:
    trial: Trial
    proc: TrialProcess
    slot: int


class _Runner:
    """One run of a sweep over its directory: the trials' states, the subprocesses, the
    rows."""

    def __init__(
        self,
        plan: SweepPlan,
        specs: dict[str, Any],
        out: Path,
        workers: int,
        retry_failed: bool,
        log: Callable[[str], None],
        progress: bool | None,
    ) -> None:
        self.plan, self.specs, self.out = plan, specs, out
        self.workers, self.retry_failed, self.log = workers, retry_failed, log
        self.progress_enabled = progress
        self.metric = METRIC_COLUMNS[plan.sweep.metric]
        self.status: dict[str, str] = {}
        self.errors: dict[str, str | None] = {}
        self.rows: dict[str, dict[str, Any]] = {}
        self.running: dict[str, _Running] = {}
        self.stopping: str | None = None
        self.display: Any = None  # the SweepProgress while trials run
        self._accounts: dict[tuple[str, bool], dict[str, Any]] = {}
        self._shapes: dict[str, dict[str, Any]] = {}  # accounting by model shape
        #: ``branch_budgets``: trial id -> (the trial it branches from, at which step).
        self.branches: dict[str, tuple[str, int]] = {}
        self.threads = threads_per_worker(workers)
        self.gpus = visible_gpus() if workers > 1 else 0
        self.max_time: float | None = None  # --max-time of every trial

    # -- set-up ------------------------------------------------------------------------------
    def _prepare(self) -> None:
        """Check the directory holds this sweep (or none), record its definition, and read
        each trial's state from the last run's rows and its run directory."""
        definition = {
            "name": self.plan.name,
            "base": str(self.plan.base),
            "base_sha256": _spec_digest(self.plan.base),
            "set": self.plan.sets,
            "max_steps": self.plan.max_steps,
            "trials": [{"id": t.id, "overrides": t.overrides} for t in self.plan.trials],
        }
        path = self.out / DEFINITION_FILE
        if path.is_file():
            try:
                before = json.loads(path.read_text())
            except ValueError:
                before = {}
            _check_same_sweep(self.out, before, definition)
            if before.get("base_sha256") != definition["base_sha256"]:
                raise LlmkitError(
                    f"the base spec {self.plan.base} changed since {self.out} was started; "
                    "its done trials used the old one: choose another --out, or remove it"
                )
        from llmkit.files import write_text_atomic

        write_text_atomic(path, json.dumps(definition, indent=2) + "\n")
        if self.plan.source is not None:
            shutil.copyfile(self.plan.source, self.out / f"sweep{self.plan.source.suffix}")
        else:
            dump = self.plan.sweep.model_dump(mode="json", by_alias=True, exclude_none=True)
            write_text_atomic(self.out / "sweep.yaml", yaml.safe_dump(dump, sort_keys=False))
        (self.out / TRIALS_DIR).mkdir(exist_ok=True)
        (self.out / LOGS_DIR).mkdir(exist_ok=True)
        before_rows = report.read_results(self.out)
        for trial in self.plan.trials:
            prev = before_rows.get(trial.id, {})
            run = self._run_dir(trial)
            state = trial_state(run, self._max_steps(trial))
            if prev.get("status") == "done" and (run / WEIGHTS).is_file():
                state = "done"  # also a run that stopped early (early stopping, max_time)
            elif prev.get("status") == "failed" and not self.retry_failed:
                state = "failed"
                self.errors[trial.id] = prev.get("error")
            self._set(trial, state)

    def _run_dir(self, trial: Trial) -> Path:
        return self._run_dir_of(trial.id)

    def _run_dir_of(self, trial_id: str) -> Path:
        return self.out / TRIALS_DIR / trial_id

    def _max_steps(self, trial: Trial) -> int:
        return self.specs[trial.id].spec.train.max_steps

    # -- rows --------------------------------------------------------------------------------
    def _set(self, trial: Trial, status: str, error: str | None = None) -> None:
        """Record a trial's status and rebuild its row."""
        self.status[trial.id] = status
        if error is not None:
            self.errors[trial.id] = error
        elif status != "failed":
            self.errors.pop(trial.id, None)
        run = self._run_dir(trial)
        row: dict[str, Any] = {"trial": trial.id, "status": status, **trial.values}
        seed = trial.seed if trial.seed is not None else self.specs[trial.id].spec.train.seed
        numbers = summarize(run) if run.is_dir() else {}
        row.update({c: None for c in report.TAIL_COLUMNS}, **numbers, seed=seed)
        acct = self._accounting(trial)
        row["params"] = acct.get("params")
        row["non_embedding_params"] = acct.get("non_embedding_params")
        per_token, tokens = acct.get("train_flops_per_token"), row.get("tokens")
        row["flops"] = round(per_token * tokens) if per_token is not None and tokens else None
        row["run_dir"] = f"{TRIALS_DIR}/{trial.id}"
        row["error"] = self.errors.get(trial.id)
        if self.plan.sweep.branch_budgets:
            source = self.branches.get(trial.id)
            row[report.BRANCH_COLUMN] = f"{source[0]}@{source[1]}" if source else None
        self.rows[trial.id] = row

    def _extra_columns(self) -> list[str]:
        return [report.BRANCH_COLUMN] if self.plan.sweep.branch_budgets else []

    def _accounting(self, trial: Trial) -> dict[str, Any]:
        """Parameters and FLOPs per token, from the run's own spec once it has one (it holds
        the tokenizer's vocabulary size), else from the trial's resolved spec; each model
        shape is built once (on the meta device)."""
        spec_file = self._run_dir(trial) / "spec.yaml"
        key = (trial.id, spec_file.is_file())
        if key not in self._accounts:
            try:
                if key[1]:
                    from llmkit.runs import open_run

                    rs = open_run(spec_file.parent).resolve()
                else:
                    rs = self.specs[trial.id]
                shape = json.dumps([rs.to_dict()["model"], rs.spec.data.block_size])
                if shape not in self._shapes:
                    self._shapes[shape] = report.accounting(rs)
                self._accounts[key] = self._shapes[shape]
            except Exception:  # a report, best effort: a model that cannot be built has none
                self._accounts[key] = {}
        return self._accounts[key]

    def _write(self) -> None:
        rows = [self.rows[t.id] for t in self.plan.trials]
        report.write_results(self.out, rows, self.plan.axes, self._extra_columns())

    # -- running -----------------------------------------------------------------------------
    def run(self) -> SweepResult:
        self._prepare()
        todo = {"pending", "interrupted"} | ({"failed"} if self.retry_failed else set())
        queue = deque(t for t in self.plan.trials if self.status[t.id] in todo)
        self.display = display = report.SweepProgress(
            self.plan.name,
            len(self.plan.trials),
            self.metric,
            self.log,
            self.progress_enabled,
        )
        for t in self.plan.trials:
            display.set_status(t.id, self.status[t.id], self.rows[t.id])
        skipped = len(self.plan.trials) - len(queue)
        display.log(
            f"sweep {self.plan.name}: {len(self.plan.trials)} trials ({skipped} already "
            f"ended, {len(queue)} to run){self._limits()}, {self.workers} worker(s) × "
            f"{self.threads} thread(s) -> {self.out}"
        )
        self._write()
        old = self._install_signals()
        try:
            while queue or self.running:
                while queue and not self.stopping and len(self.running) < self.workers:
                    trial = self._next(queue, display)
                    if trial is None:  # only branches waiting for their source
                        break
                    self._start(trial, display)
                for tid in list(self.running):
                    if self.running[tid].proc.poll() is not None:
                        self._finish(self.running.pop(tid), display)
                if self.stopping and not self.running:
                    break
                display.refresh()
                time.sleep(POLL_S)
        finally:
            self._stop_all(signal.SIGKILL)  # none left, unless the sweep itself failed
            for r in self.running.values():
                r.proc.wait()
            for sig, handler in old.items():
                signal.signal(sig, handler)
            display.close()
        self._write()
        rows = [self.rows[t.id] for t in self.plan.trials]
        plots = report.draw_plots(
            self.out,
            rows,
            self.plan.axes,
            zip_partners(self.plan.sweep),
            log_axes(self.plan.sweep),
            self.metric,
        )
        result = SweepResult(
            self.out,
            rows,
            report.columns(self.plan.axes, self._extra_columns()),
            self.metric,
            plots,
            self.stopping,
        )
        self.log(display.summary() + f"; results: {self.out / 'results.csv'}")
        if self.stopping:
            self.log(f"stopped by {self.stopping}: rerun the sweep to finish it")
        return result

    def _limits(self) -> str:
        """The command line's limits of every trial, for the sweep's first line."""
        parts = [f"--set {a}" for a in self.plan.sets]
        if self.plan.max_steps is not None:
            parts.append(f"--max-steps {self.plan.max_steps}")
        if self.max_time is not None:
            parts.append(f"--max-time {self.max_time:g}")
        return f", each with {' '.join(parts)}" if parts else ""

    def _next(self, queue: deque[Trial], display: report.SweepProgress) -> Trial | None:
        """The first queued trial that can start now (taken off the queue): a branch waits
        for the trial it branches from, and fails when that one ended otherwise."""
        for trial in list(queue):
            source = self.branches.get(trial.id)
            if source is None or self._has_checkpoint(trial):
                queue.remove(trial)
                return trial
            status = self.status[source[0]]
            if status == "done":
                queue.remove(trial)
                return trial
            waiting = status == "running" or any(t.id == source[0] for t in queue)
            if not waiting:
                queue.remove(trial)
                self._set(trial, "failed", f"branch source {source[0]} is {status}")
                self._write()
                display.ended(trial, self.rows[trial.id])
        return None

    def _has_checkpoint(self, trial: Trial) -> bool:
        from llmkit.runs.checkpoints import Checkpoints

        run = self._run_dir(trial)
        return run.is_dir() and Checkpoints(run).latest() is not None

    def _start(self, trial: Trial, display: report.SweepProgress) -> None:
        from llmkit.runs.branch import branch_run
        from llmkit.runs.checkpoints import Checkpoints
        from llmkit.runs.lock import RunInUse

        run = self._run_dir(trial)
        latest = Checkpoints(run).latest() if run.is_dir() else None
        branched = None
        try:
            if latest is None and run.exists():
                _clear_run_dir(run)  # left before its first checkpoint: start afresh
            if latest is None and trial.id in self.branches:
                source, step = self.branches[trial.id]
                latest = Checkpoints(branch_run(self._run_dir_of(source), step, run)).latest()
                branched = f"branched from {source} at step {step}"
        except (RunInUse, LlmkitError) as exc:
            self._set(trial, "failed", str(exc))
            self._write()
            display.ended(trial, self.rows[trial.id])
            return
        slot = min(set(range(self.workers)) - {r.slot for r in self.running.values()})
        resume = latest is not None
        extra = []
        if resume and trial.id in self.branches:  # its spec is still the long trial's
            extra = [f"{sweep_branches.MAX_STEPS}={self._max_steps(trial)}"]
        job = TrialJob(
            run_dir=run,
            log=self.out / LOGS_DIR / f"{trial.id}.log",
            spec=self.plan.base,
            overrides=extra if resume else list(trial.overrides),
            resume=resume,
            max_steps=self._max_steps(trial),
            threads=self.threads,
            gpu=slot % self.gpus if self.gpus > 1 else None,
            note=branched,
            cut_steps=None if resume else self.plan.max_steps,  # a resumed run's spec has it
            max_time=self.max_time,
        )
        proc = TrialProcess(job)
        proc.start()
        self.running[trial.id] = _Running(trial, proc, slot)
        self._set(trial, "running")
        resume_step = int(latest.name.removeprefix("step-")) if latest is not None else None
        display.started(trial, run, self._max_steps(trial), resume_step)

    def _finish(self, running: _Running, display: report.SweepProgress) -> None:
        trial, ended = running.trial, running.proc.outcome()
        run = self._run_dir(trial)
        state = trial_state(run, self._max_steps(trial))
        error = None
        if ended.returncode == 0:
            signalled = ended.stopped is not None and ended.stopped.startswith("SIG")
            status = "done" if state == "done" or not (self.stopping or signalled) else state
        elif self.stopping:
            status = state if state != "done" else "interrupted"
        else:
            status, error = "failed", ended.error
        self._set(trial, status, error)
        self._write()
        display.ended(trial, self.rows[trial.id])

    # -- signals -----------------------------------------------------------------------------
    def _install_signals(self) -> dict[int, Any]:
        def handler(signum: int, _frame: Any) -> None:
            name = signal.Signals(signum).name
            if self.stopping:
                self.display.log(f"{name} again: killing the running trials")
                self._stop_all(signal.SIGKILL)
                return
            self.stopping = name
            self.display.log(
                f"{name}: stopping; the running trials save a checkpoint at their next step "
                "(again: kill them)"
            )
            self._stop_all(signal.SIGTERM)

        old: dict[int, Any] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                old[sig] = signal.signal(sig, handler)
        return old

    def _stop_all(self, sig: int) -> None:
        """Send ``sig`` to every running trial (not waiting: the loop reaps them; this also
        runs in the signal handler)."""
        for r in self.running.values():
            r.proc.stop(sig)


def _check_same_sweep(out: Path, before: dict[str, Any], now: dict[str, Any]) -> None:
    """Refuse, in one line, a rerun into ``out`` that trains other trials than its
    ``sweep.json`` records: other axes, values or ``set``, another ``--set`` or
    ``--max-steps`` (older directories, without the last two, had neither)."""

    def flags(d: dict[str, Any]) -> str:
        parts = [f"--set {a}" for a in d.get("set") or []]
        if d.get("max_steps") is not None:
            parts.append(f"--max-steps {d['max_steps']}")
        return " ".join(parts) or "neither --set nor --max-steps"

    ids = [t.get("id") for t in before.get("trials") or [] if isinstance(t, dict)]
    same_ids = ids == [t["id"] for t in now["trials"]]
    if same_ids and flags(before) != flags(now):
        raise LlmkitError(
            f"{out} was run with {flags(before)}, this sweep with {flags(now)}: rerun it "
            "with the same --set and --max-steps, or choose another --out"
        )
    if before.get("trials") != now["trials"]:
        raise LlmkitError(
            f"{out} holds a sweep with other trials ({DEFINITION_FILE}); "
            "choose another --out, or remove the directory"
        )


def _spec_digest(path: Path) -> str:
    """A digest of the base spec as merged (its ``extends`` chain included)."""
    from llmkit.spec import load_raw

    text = json.dumps(load_raw(path), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _clear_run_dir(run: Path) -> None:
    """Remove a trial's directory that holds no checkpoint, unless a process trains in it."""
    from llmkit.runs.lock import RunLock

    lock = RunLock(run)
    lock.acquire()  # RunInUse when another process holds it: reported, nothing removed
    try:
        shutil.rmtree(run)
    finally:
        lock.release()
