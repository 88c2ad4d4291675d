"""The one trial runner of sweeps and searches (``llmkit.experiments.trial``): a trial is an
``llmkit train`` process, watched through its ``metrics.jsonl``, stopped by a signal, read
back from its run directory and log. A stand-in trainer keeps these tests fast; the real
trainer runs through the same runner in test_sweep.py and test_search.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from llmkit.experiments import trial as trial_runner
from llmkit.experiments.search import run_search
from llmkit.experiments.sweep import run_sweep
from llmkit.experiments.trial import TrialJob, run_trial
from tests.helpers import write_train_spec

#: A stand-in for ``llmkit train`` (argv: the run directory, then its --set overrides): a
#: step every 50 ms, an evaluation every 2 steps and at the end, on SIGTERM one more step
#: and an evaluation, then its ``done:`` line as the CLI prints it. The loss grows with
#: optimizer.lr; ``description=ce_apart`` writes a ``val_ce`` (10 - val_loss) that ranks
#: trials against their objective, as a distillation's CE may; ``fake.end_at=N`` ends it at
#: step N on its own (as early stopping would), deaf to SIGTERM.
FAKE_TRAIN = r"""
import json, pathlib, signal, sys, time
run = pathlib.Path(sys.argv[1])
sets = dict(a.split("=", 1) for a in sys.argv[2:])
steps = int(sets.get("train.max_steps", 8))
end_at = int(sets.get("fake.end_at", 0))
ce_apart = sets.get("description") == "ce_apart"
loss = float(sets.get("optimizer.lr", "0.01")) * 100
stop = []
if end_at:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: stop.append("SIGTERM"))
run.mkdir(parents=True, exist_ok=True)
metrics = run / "metrics.jsonl"
step, reason = 0, "max_steps"
while step < steps:
    step += 1
    time.sleep(0.05)
    last = step == steps or step == end_at or bool(stop)
    with metrics.open("a") as fh:
        record = {"step": step, "loss": loss, "tokens": 10 * step, "elapsed": 0.05 * step}
        fh.write(json.dumps(record) + "\n")
        if step % 2 == 0 or last:
            evaluation = {"step": step, "val_loss": loss + 1 / step}
            if ce_apart:
                evaluation["val_ce"] = 10 - evaluation["val_loss"]
            fh.write(json.dumps(evaluation) + "\n")
    if step == end_at:
        time.sleep(0.2)  # the watcher sees this evaluation while the run is still alive
        reason = "early_stopping"
        break
    if stop:
        reason = stop[0]
        break
print(f"done: {step} steps, {10 * step} tokens in 0.1s ({reason}); val loss {loss}; run: {run}")
"""


def fake_trainer(monkeypatch: pytest.MonkeyPatch) -> list[TrialJob]:
    """Every trial (of a sweep or a search) runs :data:`FAKE_TRAIN`; the jobs, in order."""
    jobs: list[TrialJob] = []

    def command(job: TrialJob) -> list[str]:
        jobs.append(job)
        return [sys.executable, "-c", FAKE_TRAIN, str(job.run_dir), *job.overrides]

    monkeypatch.setattr(trial_runner, "train_command", command)
    return jobs


def job(tmp_path: Path, *overrides: str, max_steps: int = 8) -> TrialJob:
    return TrialJob(
        run_dir=tmp_path / "run",
        log=tmp_path / "logs" / "run.log",
        spec=tmp_path / "spec.yaml",
        overrides=list(overrides),
        max_steps=max_steps,
        threads=1,
    )


def test_a_watcher_sees_every_evaluation_but_the_last(tmp_path, monkeypatch):
    fake_trainer(monkeypatch)
    seen: list[tuple[int, float]] = []
    ended = run_trial(job(tmp_path), lambda step, loss: seen.append((step, loss)) or False)
    assert [s for s, _ in seen] == [2, 4, 6]  # step 8 is max_steps: the run's last
    assert seen[0][1] == pytest.approx(1.5)
    assert (ended.returncode, ended.stopped, ended.error, ended.stopped_at) == (
        0,
        "max_steps",
        None,
        None,
    )
    assert ended.numbers["steps"] == 8 and ended.numbers["final_val_loss"] == 1 + 1 / 8
    log = (tmp_path / "logs" / "run.log").read_text()
    assert log.startswith("=== ") and "done: 8 steps" in log


def test_a_watcher_stops_a_trial_which_ends_after_its_next_step(tmp_path, monkeypatch):
    fake_trainer(monkeypatch)
    seen: list[int] = []

    def on_eval(step: int, _loss: float) -> bool:
        seen.append(step)
        return step == 4

    ended = run_trial(job(tmp_path), on_eval)
    assert seen == [2, 4]  # nothing is offered after the stop
    assert ended.stopped == "SIGTERM" and ended.stopped_at == 4
    assert 4 < ended.numbers["steps"] < 8


def test_a_run_that_ended_on_its_own_at_the_evaluation_was_not_stopped(tmp_path, monkeypatch):
    """The trainer offers no evaluation it ends at (early stopping) to ``on_eval``; the
    runner, reading it while the process still runs, may — the run's end decides."""
    fake_trainer(monkeypatch)
    ended = run_trial(job(tmp_path, "fake.end_at=4"), lambda step, _loss: step == 4)
    assert ended.stopped == "early_stopping" and ended.numbers["steps"] == 4
    assert ended.stopped_at is None


def test_a_failed_trial_reports_its_error_line(tmp_path, monkeypatch):
    monkeypatch.setattr(
        trial_runner,
        "train_command",
        lambda job: [sys.executable, "-c", "import sys; print('error: no data'); sys.exit(2)"],
    )
    ended = run_trial(job(tmp_path))
    assert (ended.returncode, ended.error, ended.stopped) == (2, "no data", None)


def test_evaluations_are_read_as_the_file_grows_and_after_it_is_rewritten(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 2, "val_loss": 3.0}, {"step": 3, "loss": 2.0}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    evals = trial_runner._Evaluations(path)
    assert evals.new() == []  # what was there before the trial started is not new
    with path.open("a") as fh:
        fh.write(json.dumps({"step": 4, "val_loss": 2.5}) + '\n{"step": 6, "val_')
    assert evals.new() == [(4, 2.5)]  # a half-written line waits
    with path.open("a") as fh:
        fh.write('loss": 2.25}\n')
    assert evals.new() == [(6, 2.25)]
    # a resumed run rewrites the file up to its checkpoint, then goes on
    tmp = tmp_path / "new"
    tmp.write_text(json.dumps({"step": 4, "val_loss": 2.5}) + "\n")
    tmp.replace(path)
    assert evals.new() == []
    with path.open("a") as fh:
        fh.write(json.dumps({"step": 8, "val_loss": 2.0}) + "\n")
    assert evals.new() == [(8, 2.0)]


def test_sweeps_and_searches_train_their_trials_through_one_runner(tmp_path, monkeypatch):
    """The same stand-in trainer serves a sweep (two trials to their end) and a search
    (trials of the worse lr pruned: stopped by SIGTERM after the step they were judged at)."""
    jobs = fake_trainer(monkeypatch)
    write_train_spec(tmp_path, "the quick brown fox. " * 50, max_steps=8, eval_interval=2)
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('base = "spec.yaml"\n[axes]\n"optimizer.lr" = [0.01, 0.02]\n')
    result = run_sweep(sweep, out=tmp_path / "sweep", log=lambda _: None, progress=False)
    assert [r["status"] for r in result.rows] == ["done", "done"]
    assert [r["final_val_loss"] for r in result.rows] == [1 + 1 / 8, 2 + 1 / 8]
    assert [(j.max_steps, j.resume) for j in jobs] == [(8, False), (8, False)]

    search = tmp_path / "search.toml"
    search.write_text(
        'name = "unit"\nbase = "spec.yaml"\ntrials = 6\nsampler = "random"\nseed = 0\n'
        'startup_trials = 2\n[params]\n"optimizer.lr" = { choice = [0.01, 0.05] }\n'
    )
    out = tmp_path / "search"
    rows = run_search(search, out=out, log=lambda _: None).rows
    assert len(jobs) == 2 + 6 and all(j.max_steps == 8 for j in jobs)
    assert {r["state"] for r in rows} == {"COMPLETE", "PRUNED"}
    for row in rows:
        log = (out / "logs" / f"trial-{row['trial']:04d}.log").read_text()
        if row["state"] == "PRUNED":
            assert row["optimizer.lr"] == 0.05 and row["pruned_at"] < 8
            assert "(SIGTERM)" in log and row["steps"] < 8
        else:
            assert row["value"] == pytest.approx(row["optimizer.lr"] * 100 + 1 / 8)
            assert "(max_steps)" in log and row["steps"] == 8


def test_trials_are_ranked_by_the_cross_entropy_not_the_objective(tmp_path, monkeypatch):
    """Sweeps and searches rank by val_ce by default (comparable across objectives); the
    objective (val_loss) only when asked. Here they disagree, as under distillation."""
    fake_trainer(monkeypatch)
    write_train_spec(tmp_path, "the quick brown fox. " * 50, max_steps=8, eval_interval=2)
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(
        'base = "spec.yaml"\nset = ["description=ce_apart"]\n'
        '[axes]\n"optimizer.lr" = [0.01, 0.02]\n'
    )
    result = run_sweep(sweep, out=tmp_path / "sweep", log=lambda _: None, progress=False)
    row = result.rows[0]
    assert row["final_val_ce"] == pytest.approx(10 - (1 + 1 / 8))
    assert row["best_val_ce"] == pytest.approx(10 - (1 + 1 / 2))  # the CE rises as val_loss falls
    assert row["final_val_loss"] == pytest.approx(1 + 1 / 8)
    assert result.best()["optimizer.lr"] == 0.02  # the lower CE, the higher objective
    sweep.write_text(sweep.read_text().replace("[axes]", 'metric = "val_loss"\n[axes]'))
    again = run_sweep(sweep, out=tmp_path / "sweep-objective", log=lambda _: None, progress=False)
    assert again.best()["optimizer.lr"] == 0.01

    search = tmp_path / "search.toml"
    search.write_text(
        'name = "ce"\nbase = "spec.yaml"\nset = ["description=ce_apart"]\ntrials = 2\n'
        'sampler = "random"\npruner = "none"\n[params]\n"optimizer.lr" = { choice = [0.01] }\n'
    )
    printed: list[str] = []
    rows = run_search(search, out=tmp_path / "search", log=printed.append).rows
    assert [r["value"] for r in rows] == [pytest.approx(10 - (1 + 1 / 2))] * 2  # best_val_ce
    assert any("step 2/8: val_ce " in line for line in printed)
