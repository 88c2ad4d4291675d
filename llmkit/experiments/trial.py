"""One way to run a trial, for sweeps and searches alike: an ``llmkit train`` subprocess.

:class:`TrialProcess` is the one code path that starts a trial (its ``--set`` overrides, or
``--resume``; its threads and GPU; its output appended to its log; SIGTERM to it should the
parent die), watches its evaluations (``metrics.jsonl`` read as it grows), stops it (a
signal: the trainer saves a checkpoint at its next step and ends) and collects how it ended
(exit status, the trainer's stop reason or error line, its numbers). ``llmkit sweep`` keeps
several at once (:mod:`llmkit.experiments.sweep`); ``llmkit search`` runs one at a time with
:func:`run_trial`, which feeds each evaluation to the pruner and stops the trial when it says
so (:mod:`llmkit.experiments.search`).

A subprocess rather than a call of :func:`llmkit.training.train`: a trial that crashes (or
leaks memory) cannot take the sweep or the study with it, each trial gets its thread count
before torch starts, and an interrupted trial resumes through the ``train --resume`` users
run. The price is a few seconds of imports per trial.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Seconds between looks at a running trial (its exit, its new evaluations).
POLL_S = 0.02
#: Seconds a trial stopped by SIGTERM is given to save its checkpoint before SIGKILL, when
#: the process watching it ends abnormally.
GRACE_S = 30.0
#: Stop reasons of a run that a signal ended (the others: it ended on its own).
SIGNALLED = ("SIGTERM", "SIGINT")


@dataclass(frozen=True)
class TrialJob:
    """What a trial trains: a new run of ``spec`` with ``overrides`` in ``run_dir``, or (with
    ``resume``) the run in ``run_dir`` resumed with ``overrides`` as edits; its output is
    appended to ``log`` (after ``note``, when given). ``threads`` sets ``OMP_NUM_THREADS``
    (and MKL's, Rayon's); ``gpu`` sets ``CUDA_VISIBLE_DEVICES`` (None: inherited).
    ``max_steps``: an evaluation at that step is the run's last, never offered to a
    watcher (as the trainer's own ``on_eval``). ``cut_steps`` and ``max_time`` are
    ``llmkit train``'s ``--max-steps`` (a longer warmup scaled down to fit, with a note) and
    ``--max-time``: a sweep's or search's command-line limits, passed to every trial."""

    run_dir: Path
    log: Path
    spec: Path | None = None
    overrides: list[str] = field(default_factory=list)
    resume: bool = False
    max_steps: int | None = None
    threads: int | None = None
    gpu: int | None = None
    note: str | None = None
    cut_steps: int | None = None
    max_time: float | None = None


def train_command(job: TrialJob) -> list[str]:
    """``llmkit train`` for a trial: its spec and overrides, or ``--resume``."""
    cmd = [sys.executable, "-m", "llmkit.cli", "train"]
    if job.resume:
        cmd += ["--resume", str(job.run_dir)]
    else:
        if job.spec is None:
            raise ValueError("a new trial needs its spec file")
        cmd += [str(job.spec), "--out", str(job.run_dir)]
    for assignment in job.overrides:
        cmd += ["--set", assignment]
    if job.cut_steps is not None:
        cmd += ["--max-steps", str(job.cut_steps)]
    if job.max_time is not None:
        cmd += ["--max-time", repr(float(job.max_time))]
    return [*cmd, "--no-sample", "--no-progress"]


def cut_overrides(spec: Path, overrides: list[str], max_steps: int | None) -> list[str]:
    """The overrides ``llmkit train SPEC --set … --max-steps N`` trains with: ``overrides``,
    then the edit scaling the schedule's warmup down to fit ``max_steps`` (when it needs
    one) and ``train.max_steps=N``, as :func:`llmkit.training.plan.plan_run` applies them; so
    a sweep or search checks (and reads the length of) the run its trial will train."""
    if max_steps is None:
        return list(overrides)
    from llmkit.errors import LlmkitError
    from llmkit.spec import apply_override, fit_warmup, load_raw

    extra: list[str] = []
    try:
        data = load_raw(spec)
        for assignment in overrides:
            apply_override(data, assignment)
        fitted = fit_warmup(data, max_steps)
    except LlmkitError:  # a spec that does not read: resolving it reports the problem
        fitted = None
    if fitted is not None:
        extra.append(fitted[0])
    return [*overrides, *extra, f"train.max_steps={max_steps}"]


# -- a trial's model, checked before it runs --------------------------------------------------

#: A trial builds its model in fp32 on the CPU before training moves it anywhere: at least
#: this many bytes of this machine's memory per parameter.
WEIGHT_BYTES = 4


def machine_memory() -> int | None:
    """This machine's physical memory in bytes; None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def model_size(rs: Any) -> int:
    """The values a trial's model allocates, bounded for checking it: llmkit's parameter
    estimate (:func:`llmkit.spec.limits.estimate_parameters`) plus one ``max_seq_len ×
    d_model`` table, which the estimate leaves out (learned positions are such a table;
    sinusoidal and rotary ones are computed at that size)."""
    from llmkit.spec.limits import estimate_parameters

    m = rs.spec.model
    return estimate_parameters(rs.spec, rs.layers) + m.max_seq_len * m.d_model


def memory_problems(rs: Any) -> list[str]:
    """A trial whose model's fp32 weights alone (:data:`WEIGHT_BYTES` per value of
    :func:`model_size`) exceed this machine's memory: refused before anything allocates it."""
    n = model_size(rs)
    have, need = machine_memory(), n * WEIGHT_BYTES
    if have is None or need <= have:
        return []
    return [
        f"model: about {n:.3g} parameters, {need / 2**30:,.1f} GiB of fp32 weights alone: more "
        f"than this machine's memory ({have / 2**30:,.1f} GiB); make the model smaller"
    ]


def model_problems(rs: Any) -> list[str]:
    """What stops a trial's model from being trained here, before any trial runs: weights
    beyond this machine's memory (:func:`memory_problems`), or a component refusing its
    dimensions (:func:`llmkit.model.build_problems`: the model built on the CPU when small,
    tables included, else on the meta device, which allocates nothing)."""
    problems = memory_problems(rs)
    if problems:
        return problems
    from llmkit.model import build_problems

    return build_problems(rs)


def trial_env(threads: int | None, gpu: int | None) -> dict[str, str]:
    """The environment of a trial: this one, with its thread count and GPU."""
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    if threads is not None:
        n = str(threads)
        env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, RAYON_NUM_THREADS=n)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


def threads_per_worker(workers: int, cores: int | None = None) -> int:
    """CPU threads for each of ``workers`` trials at once: the cores this process may use,
    shared out, at least one."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
    return max(1, cores // max(1, workers))


def visible_gpus() -> int:
    """CUDA devices to share out among workers (one each, round robin); 0 when
    ``CUDA_VISIBLE_DEVICES`` is set already (it is kept) or there is no GPU."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to send the trial SIGTERM when its parent dies (so it
    saves a checkpoint and ends, instead of training on unseen); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    set_pdeathsig = 1  # PR_SET_PDEATHSIG

    def setup() -> None:
        prctl(set_pdeathsig, int(signal.SIGTERM))

    return setup


# -- what a trial's files say ---------------------------------------------------------------------


def log_tail(path: Path, start: int) -> list[str]:
    """The lines a trial's attempt wrote to its log (from byte ``start``)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]


def stop_reason(lines: list[str]) -> str | None:
    """Why ``llmkit train`` ended, from its ``done: ... (reason); val loss`` line."""
    for line in reversed(lines):
        if line.startswith("done: ") and "); val loss" in line:
            return line.rpartition("); val loss")[0].rpartition("(")[2]
    return None


def error_line(lines: list[str], rc: int) -> str:
    """A failed trial's error: the CLI's ``error:`` line, else the last line it wrote (an
    exception's), else how it ended."""
    for line in reversed(lines):
        if line.startswith("error: "):
            return line.removeprefix("error: ")[:500]
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-rc).name}"
    tail = [line for line in lines if not line.startswith("===")]
    return tail[-1][:500] if tail else f"exit status {rc}"


def read_records(path: Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (lines that do not parse are skipped); with
    ``tail_bytes``, only those in its last bytes."""
    try:
        with open(path, "rb") as fh:
            if tail_bytes is not None:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(max(0, size - tail_bytes))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    from llmkit.runs.metrics import parse_records

    return parse_records(text)


def finite(value: Any) -> bool:
    """Whether ``value`` is a finite number (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def summarize(run_dir: Path) -> dict[str, Any]:
    """A run's numbers from ``metrics.jsonl`` and its latest checkpoint: final and best
    validation cross-entropy (``val_ce``: what compares across objectives) and objective
    (``val_loss``; the same number for the cross-entropy), final training loss, steps, tokens
    and training seconds (the trainer's elapsed time, carried across resumes)."""
    records = read_records(run_dir / "metrics.jsonl")
    train = [r for r in records if finite(r.get("loss"))]
    evals = [r for r in records if "val_loss" in r]
    out: dict[str, Any] = {
        "final_val_ce": None,
        "best_val_ce": None,
        "final_val_loss": None,
        "best_val_loss": None,
        "final_train_loss": None,
        "steps": None,
        "tokens": None,
        "wall_s": None,
    }
    if train:
        last = train[-1]
        out.update(
            final_train_loss=last["loss"],
            steps=last.get("step"),
            tokens=last.get("tokens"),
            wall_s=last.get("elapsed"),
        )
    if evals:
        vals = [r["val_loss"] for r in evals if finite(r.get("val_loss"))]
        out["final_val_loss"] = evals[-1].get("val_loss")
        out["best_val_loss"] = evals[-1].get("best_val_loss", min(vals) if vals else None)
        # A record without val_ce is from a cross-entropy run: its val_loss is the CE.
        ces = [r.get("val_ce", r.get("val_loss")) for r in evals]
        out["final_val_ce"] = ces[-1]
        known = [v for v in ces if finite(v)]
        out["best_val_ce"] = min(known) if known else None
        step = evals[-1].get("step")
        if isinstance(step, int) and (out["steps"] is None or step > out["steps"]):
            out["steps"] = step
    latest = read_records(run_dir / "checkpoints" / "latest.json")
    if latest and latest[0].get("step") == out["steps"] and "tokens" in latest[0]:
        out["tokens"] = latest[0]["tokens"]  # exact at the last step, whatever log_interval
    return out


class _Evaluations:
    """The validation losses a run appends to its ``metrics.jsonl``, read as the file grows:
    only whole lines, only steps past the last one seen (the trainer rewrites the file when
    it resumes, dropping what followed its checkpoint)."""

    def __init__(self, path: Path, key: str = "val_loss") -> None:
        self.path, self.key = path, key
        self.offset, self.inode = 0, None
        self.seen = max((r["step"] for r in self._all() if _is_eval(r)), default=0)
        self._sync()

    def _all(self) -> list[dict[str, Any]]:
        return read_records(self.path)

    def _sync(self) -> None:
        try:
            st = self.path.stat()
        except OSError:
            return
        self.offset, self.inode = st.st_size, st.st_ino

    def new(self) -> list[tuple[int, float]]:
        try:
            st = self.path.stat()
        except OSError:
            return []
        if st.st_ino != self.inode or st.st_size < self.offset:  # replaced: read it again
            self.offset, self.inode = 0, st.st_ino
        if st.st_size == self.offset:
            return []
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read(st.st_size - self.offset)
        except OSError:
            return []
        whole = chunk.rfind(b"\n") + 1  # a line still being written waits for the next look
        self.offset += whole
        out = []
        for line in chunk[:whole].decode("utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if _is_eval(record) and record["step"] > self.seen:
                self.seen = record["step"]
                out.append((record["step"], float(record.get(self.key, record["val_loss"]))))
        return out


def _is_eval(record: Any) -> bool:
    return (
        isinstance(record, dict)
        and isinstance(record.get("step"), int)
        and finite(record.get("val_loss"))
    )


@dataclass
class TrialOutcome:
    """How a trial's process ended: its exit status, why the trainer stopped (its ``done:``
    line: ``max_steps``, ``early_stopping``, ``max_time``, ``SIGTERM`` …; None without
    one), the error line of a failed trial, the evaluation step a watcher stopped it at
    (:func:`run_trial`'s ``on_eval``; None otherwise), its numbers (:func:`summarize`) and
    the seconds the process ran."""

    returncode: int
    stopped: str | None
    error: str | None
    stopped_at: int | None
    numbers: dict[str, Any]
    wall_s: float


class TrialProcess:
    """One trial's ``llmkit train`` process: :meth:`start`, :meth:`poll`, :meth:`evaluations`
    as they appear, :meth:`stop` (a signal), :meth:`outcome` once it ended."""

    def __init__(self, job: TrialJob, key: str = "val_loss") -> None:
        self.job, self.key = job, key
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_from = 0
        self.stopped_at: int | None = None
        self._evals: _Evaluations | None = None
        self._t0 = 0.0
        self._t1: float | None = None

    def start(self) -> None:
        job = self.job
        cmd = train_command(job)
        job.log.parent.mkdir(parents=True, exist_ok=True)
        self._evals = _Evaluations(job.run_dir / "metrics.jsonl", self.key)
        with open(job.log, "ab") as fh:
            self.log_from = fh.tell()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            if job.note is not None:
                fh.write(f"=== {stamp}: {job.note}\n".encode())
            fh.write(f"=== {stamp}: {' '.join(cmd[2:])}\n".encode())
            fh.flush()
            self._t0 = time.perf_counter()
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=trial_env(job.threads, job.gpu),
                preexec_fn=die_with_parent(),
            )

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        assert self.proc is not None, "start() first"
        rc = self.proc.poll()
        if rc is not None and self._t1 is None:
            self._t1 = time.perf_counter()
        return rc

    def evaluations(self) -> list[tuple[int, float]]:
        """The ``(step, value)`` evaluations written since the last call, but the one at
        ``max_steps`` (the run's last); the value: the record's ``key`` (``val_loss``, the
        objective, or ``val_ce``; ``val_loss`` where a record lacks it)."""
        assert self._evals is not None, "start() first"
        last = self.job.max_steps
        return [(s, v) for s, v in self._evals.new() if last is None or s < last]

    def stop(self, sig: int = signal.SIGTERM, at: int | None = None) -> None:
        """Send ``sig`` unless it ended (SIGTERM/SIGINT: the trainer stops after its current
        step and saves a checkpoint; SIGKILL: at once). ``at``: the evaluation step it is
        stopped for, reported as :attr:`TrialOutcome.stopped_at`. Safe in a signal handler."""
        if at is not None and self.stopped_at is None:
            self.stopped_at = at
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def end(self) -> None:
        """Make sure it ended (after an error in the watching process): SIGTERM, a grace
        period to save its checkpoint, then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.stop(signal.SIGTERM)
        if self.wait(GRACE_S) is None:
            self.stop(signal.SIGKILL)
            self.wait()

    def outcome(self) -> TrialOutcome:
        """How it ended (it must have)."""
        assert self.proc is not None and self.proc.returncode is not None
        rc = self.proc.returncode
        tail = log_tail(self.job.log, self.log_from)
        numbers = summarize(self.job.run_dir) if self.job.run_dir.is_dir() else {}
        stopped = stop_reason(tail) if rc == 0 else None
        stopped_at = self.stopped_at
        if stopped not in SIGNALLED and numbers.get("steps") == stopped_at:
            stopped_at = None  # it ended on its own at that evaluation: its last one
        return TrialOutcome(
            rc,
            stopped,
            None if rc == 0 else error_line(tail, rc),
            stopped_at,
            numbers,
            round((self._t1 or time.perf_counter()) - self._t0, 2),
        )


def run_trial(
    job: TrialJob,
    on_eval: Callable[[int, float], bool] | None = None,
    *,
    key: str = "val_loss",
    poll_s: float = POLL_S,
) -> TrialOutcome:
    """Train one trial to its end: ``on_eval(step, value)`` (the record's ``key``: the
    objective ``val_loss`` or the cross-entropy ``val_ce``) is called for each of its
    evaluations but the last, as the trainer writes them, and a True answer stops the trial
    (SIGTERM: it trains to its next step, saves a checkpoint and ends; no later evaluation
    is offered). If this process is interrupted, the trial is stopped too."""
    trial = TrialProcess(job, key)
    trial.start()
    try:
        while True:
            ended = trial.poll() is not None  # before reading: nothing is written after it
            evaluations = trial.evaluations()
            if ended and evaluations:  # the run's last one, which the trainer offers no one
                evaluations.pop()
            for step, loss in evaluations:
                if on_eval is not None and trial.stopped_at is None and on_eval(step, loss):
                    trial.stop(signal.SIGTERM, at=step)
            if ended:
                break
            time.sleep(poll_s)
    finally:
        trial.end()
    return trial.outcome()
