"""Shrinking a shipped sweep or search from the command line (``--set``, ``--max-steps``,
``--max-time``, passed to every trial's ``llmkit train``; a rerun must repeat the first two),
``base`` read relative to the sweep or search file (a one-line error naming both paths when
it is missing), and what ``llmkit search`` prints while it runs."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from llmkit.cli import main
from llmkit.errors import LlmkitError
from llmkit.experiments import trial as trial_runner
from llmkit.experiments.search import run_search
from llmkit.experiments.sweep import load_plan, run_sweep
from llmkit.experiments.trial import TrialJob, train_command
from tests.experiments.test_sweep_search_trials import FAKE_TRAIN
from tests.helpers import write_train_spec

CORPUS = "the quick brown fox jumps over the lazy dog. " * 120


def sweep_cli(*argv: str) -> int:
    """``llmkit sweep ARGV`` through the command's own parser and handler."""
    from llmkit.cli.sweep import configure_sweep, run_sweep_command

    parser = argparse.ArgumentParser()
    configure_sweep(parser)
    return run_sweep_command(parser.parse_args(argv))


def fake_trainer(monkeypatch: pytest.MonkeyPatch) -> list[TrialJob]:
    """Trials run the stand-in trainer (test_sweep_search_trials.py), which reads
    ``--max-steps`` as its ``train.max_steps``; the jobs, in order."""
    jobs: list[TrialJob] = []

    def command(job: TrialJob) -> list[str]:
        jobs.append(job)
        cut = [f"train.max_steps={job.cut_steps}"] if job.cut_steps is not None else []
        return [sys.executable, "-c", FAKE_TRAIN, str(job.run_dir), *job.overrides, *cut]

    monkeypatch.setattr(trial_runner, "train_command", command)
    return jobs


# -- sweeps ---------------------------------------------------------------------------------------


def test_sweep_max_steps_and_set_reach_every_trials_run(tmp_path, monkeypatch, capsys):
    """The real trainer: ``--max-steps 3`` cuts the 20-step base (its 10-step warmup scaled
    down, with llmkit train's note), ``--set`` lands after the file's ``set``; a rerun with
    other limits is refused in one line, with the same ones it has nothing left to do."""
    monkeypatch.chdir(tmp_path)
    write_train_spec(tmp_path, CORPUS, max_steps=20, eval_interval=10, log_interval=1)
    path = tmp_path / "sweep.toml"
    path.write_text(
        'base = "spec.yaml"\nset = ["train.eval_interval=5", "schedule.warmup_steps=10"]\n'
        '[axes]\n"optimizer.lr" = [0.003]\n'
    )
    out = tmp_path / "out"
    flags = [
        "--out",
        str(out),
        "--no-progress",
        "--max-steps",
        "3",
        "--set",
        "train.eval_interval=2",
    ]
    assert sweep_cli(str(path), *flags) == 0
    shown = capsys.readouterr().out
    assert "each with --set train.eval_interval=2 --max-steps 3" in shown
    row = json.loads((out / "results.jsonl").read_text())
    assert row["status"] == "done" and row["steps"] == 3
    trained = yaml.safe_load((out / row["run_dir"] / "spec.yaml").read_text())["train"]
    assert trained["max_steps"] == 3 and trained["eval_interval"] == 2
    log = (out / "logs" / f"{row['trial']}.log").read_text()
    assert "--set train.eval_interval=2 --set optimizer.lr=0.003 --max-steps 3" in log
    assert "warmup" in log  # plan_run's note: the 10-step warmup scaled down to fit 3 steps
    warmup = yaml.safe_load((out / row["run_dir"] / "spec.yaml").read_text())["schedule"]
    assert 1 <= warmup["warmup_steps"] < 3
    recorded = json.loads((out / "sweep.json").read_text())
    assert recorded["max_steps"] == 3 and recorded["set"] == ["train.eval_interval=2"]

    with pytest.raises(LlmkitError) as info:
        sweep_cli(str(path), "--out", str(out), "--no-progress", "--max-steps", "4")
    message = str(info.value)
    assert "\n" not in message
    assert "was run with --set train.eval_interval=2 --max-steps 3" in message
    assert "this sweep with --max-steps 4" in message
    assert sweep_cli(str(path), *flags) == 0
    assert "(1 already ended, 0 to run)" in capsys.readouterr().out


def test_sweep_limits_are_passed_to_new_trials_and_max_time_to_resumed_ones(tmp_path, monkeypatch):
    jobs = fake_trainer(monkeypatch)
    write_train_spec(tmp_path, CORPUS, max_steps=8, eval_interval=2)
    path = tmp_path / "sweep.toml"
    path.write_text('base = "spec.yaml"\n[axes]\n"optimizer.lr" = [0.01, 0.02]\n')
    result = run_sweep(
        path, out=tmp_path / "out", log=lambda _: None, progress=False,
        overrides=["train.grad_clip=0.5"], max_steps=4, max_time=30,
    )  # fmt: skip
    assert [r["status"] for r in result.rows] == ["done", "done"]
    assert [r["steps"] for r in result.rows] == [4, 4]
    assert [(j.cut_steps, j.max_time, j.max_steps) for j in jobs] == [(4, 30, 4)] * 2
    assert jobs[0].overrides == ["train.grad_clip=0.5", "optimizer.lr=0.01"]
    cmd = train_command(jobs[0])  # the real command line of that trial
    assert cmd[cmd.index("--max-steps") + 1] == "4" and cmd[cmd.index("--max-time") + 1] == "30.0"
    resumed = train_command(TrialJob(tmp_path / "r", tmp_path / "l", resume=True, max_time=5))
    assert "--max-steps" not in resumed and resumed[resumed.index("--max-time") + 1] == "5.0"


def test_sweep_overrides_may_not_touch_what_the_sweep_varies(tmp_path):
    write_train_spec(tmp_path, CORPUS, max_steps=8)
    path = tmp_path / "sweep.toml"
    path.write_text(
        'base = "spec.yaml"\nseeds = 2\n[axes]\n"train.max_steps" = [4, 8]\n'
        '"model.position" = [{ name = "rope" }]\n'
    )
    for kwargs, message in (
        ({"overrides": ["train.max_steps=3"]}, "--set train.max_steps=3: this sweep varies"),
        ({"overrides": ["model.position.name=alibi"]}, "this sweep varies model.position"),
        ({"overrides": ["train.seed=3"]}, "this sweep varies train.seed"),
        ({"overrides": ["nonsense"]}, "expected KEY=VALUE"),
        ({"max_steps": 3}, "--max-steps 3: this sweep varies train.max_steps"),
    ):
        with pytest.raises(LlmkitError, match=message):
            load_plan(path, **kwargs)
    assert len(load_plan(path, overrides=["model.d_model=64"]).trials) == 4


def test_a_copied_sweep_file_reads_its_base_beside_it_from_any_directory(
    tmp_path, monkeypatch, capsys
):
    mine = tmp_path / "mine"
    write_train_spec(mine, CORPUS, max_steps=4)
    (mine / "sweep.toml").write_text('base = "spec.yaml"\n[axes]\n"model.n_heads" = [2, 4]\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_plan("../mine/sweep.toml").base == (mine / "spec.yaml").resolve()
    assert sweep_cli("../mine/sweep.toml", "--dry-run") == 0
    assert "2 trials, all valid" in capsys.readouterr().out


def test_a_missing_base_is_one_line_naming_it_as_written_and_as_read(tmp_path, capsys):
    copied = tmp_path / "copied"
    copied.mkdir()
    for name in ("sweep.toml", "search.toml"):
        (copied / name).write_text(
            'name = "x"\nbase = "../specs/tiny.toml"\n'
            + ('[axes]\n"optimizer.lr" = [0.1]\n' if name == "sweep.toml" else "")
            + (
                '[params]\n"optimizer.lr" = { log_uniform = [1e-4, 1e-2] }\n'
                if "search" in name
                else ""
            )
        )
    resolved = (tmp_path / "specs" / "tiny.toml").resolve()
    for argv in (
        ["sweep", str(copied / "sweep.toml"), "--dry-run"],
        ["search", str(copied / "search.toml")],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith("error: base '../specs/tiny.toml' (relative to ")
            and err.count("\n") == 1
        )
        assert f"no spec file {resolved}," in err, err


# -- searches -------------------------------------------------------------------------------------


def write_search(tmp_path: Path, body: str) -> Path:
    write_train_spec(tmp_path, CORPUS, max_steps=8, eval_interval=2)
    path = tmp_path / "search.toml"
    path.write_text('name = "unit"\nbase = "spec.yaml"\n' + body)
    return path


def test_search_prints_each_trial_and_no_optuna_warnings(tmp_path, monkeypatch, capsys):
    """Through the CLI: a line when each trial starts (its parameters), one per evaluation,
    one when it ends (value, complete or pruned, steps, seconds); Optuna's experimental
    (heartbeat) and deprecation warnings stay out; ``pruned_at`` only on pruned rows."""
    jobs = fake_trainer(monkeypatch)
    path = write_search(
        tmp_path,
        'trials = 6\nsampler = "random"\nseed = 0\nstartup_trials = 2\n'
        '[params]\n"optimizer.lr" = { choice = [0.01, 0.05] }\n',
    )
    out = tmp_path / "out"
    argv = ["search", str(path), "--out", str(out), "--max-steps", "6", "--max-time", "60"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*argv, "--set", "train.grad_clip=0.5"]) == 0
    assert not [w for w in caught if "optuna" in str(w.filename) + str(w.message).lower()], [
        str(w.message) for w in caught
    ]
    printed = capsys.readouterr().out
    assert "trial 0: started, 6 steps: optimizer.lr=" in printed
    assert "trial 0: step 2/6: val_ce " in printed
    assert [(j.cut_steps, j.max_time, j.max_steps) for j in jobs] == [(6, 60, 6)] * 6
    assert all(j.overrides[0] == "train.grad_clip=0.5" for j in jobs)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert "last_reported_step" not in rows[0] and list(rows[0])[4:6] == ["steps", "pruned_at"]
    for row in rows:
        n = row["trial"]
        if row["state"] == "COMPLETE":
            assert row["pruned_at"] is None and row["steps"] == 6
            assert f"trial {n}: complete, best_val_ce {row['value']:.4f} (6 steps, " in printed
        else:
            assert row["state"] == "PRUNED" and row["pruned_at"] < row["steps"] < 6
            assert f"trial {n}: step {row['pruned_at']}/6: val_ce " in printed
            assert f"trial {n}: pruned at step {row['pruned_at']}, best_val_ce " in printed
    assert any(r["state"] == "PRUNED" for r in rows)

    # the study records its overrides: a process giving others is refused, in one line
    with pytest.raises(LlmkitError) as info:
        run_search(path, out=out, trials=7, max_steps=4, log=lambda _: None)
    assert "\n" not in str(info.value) and "study unit was run with set/--set " in str(info.value)
    assert "--max-steps 6, now with no set/--set and --max-steps 4" in str(info.value)
    with pytest.raises(LlmkitError, match=r"--set optimizer\.lr=0\.1: this search varies"):
        run_search(path, out=out, overrides=["optimizer.lr=0.1"], log=lambda _: None)
    again = run_search(
        path, out=out, trials=7, overrides=["train.grad_clip=0.5"], max_steps=6,
        log=lambda _: None,
    )  # fmt: skip
    assert len(again.rows) == 7


def test_a_search_over_tables_warns_nothing_and_shows_them_as_set_values(tmp_path, monkeypatch):
    fake_trainer(monkeypatch)
    path = write_search(
        tmp_path,
        '[params]\n"model.position" = { choice = [{ name = "rope" }, { name = "alibi" }] }\n',
    )
    said: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_search(path, out=tmp_path / "out", trials=1, log=said.append)
    assert not caught, [str(w.message) for w in caught]
    assert said[1].startswith('trial 0: started, 8 steps: model.position={"name" = "')
