"""``llmkit search``: Optuna studies over spec paths — validation before any trial, trials
as run directories trained by the trial runner sweeps use, pruning on the trainer's
validation loss, and a study that goes on (rerun, or another process on the same storage)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from llmkit.cli import main
from llmkit.errors import SpecError
from llmkit.experiments.search import read_search, run_search
from tests.helpers import write_train_spec

CORPUS = "the quick brown fox jumps over the lazy dog.\n" * 120


def write_search(tmp_path: Path, body: str) -> Path:
    write_train_spec(tmp_path, CORPUS, max_steps=9, eval_interval=3, log_interval=3)
    path = tmp_path / "search.toml"
    path.write_text('name = "unit"\nbase = "spec.yaml"\n' + body)
    return path


def best_val(run_dir: str) -> float:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return min(json.loads(x)["val_loss"] for x in lines if "val_loss" in x)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ('"optimizer.lr" = { log_uniform = [1e-2, 1e-4] }', "must go from low to high"),
        ('"optimizer.lr" = { uniform = [0, 1], choice = [1] }', "exactly one of"),
        ('"optimizer.lr" = { log_uniform = [0, 1] }', "positive low end"),
    ],
)
def test_bad_distributions_are_refused(tmp_path, params, message):
    path = write_search(tmp_path, f"[params]\n{params}\n")
    with pytest.raises(SpecError, match=message):
        read_search(path)


def test_every_bad_end_is_reported_before_anything_runs(tmp_path, capsys):
    path = write_search(
        tmp_path,
        '[params]\n"model.n_heads" = { choice = [2, 3, 5] }\n'
        '"optimizer.lr" = { uniform = [-1.0, 0.01] }\n',
    )
    assert main(["search", str(path), "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err
    assert "model.n_heads = 3" in err and "model.n_heads = 5" in err
    assert "optimizer.lr = -1.0" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_study_prunes_poor_trials_and_goes_on_where_it_stopped(tmp_path):
    path = write_search(
        tmp_path,
        'trials = 6\nsampler = "random"\nseed = 0\nstartup_trials = 2\n'
        '[params]\n"optimizer.lr" = { choice = [0.02, 1e-6] }\n',
    )
    out = tmp_path / "out"
    result = run_search(path, out=out, log=lambda _m: None)
    rows = result.rows
    assert len(rows) == 6 and {r["state"] for r in rows} <= {"COMPLETE", "PRUNED"}
    for row in rows:  # a trial is a normal run; its value is its best validation loss
        assert Path(row["run_dir"]).parent == out / "trials"
        if row["state"] == "COMPLETE":
            assert row["value"] == pytest.approx(best_val(row["run_dir"]))
            assert row["steps"] == 9
    slow_late = [r for r in rows[2:] if r["optimizer.lr"] == 1e-6]
    assert slow_late and all(r["state"] == "PRUNED" and r["steps"] < 9 for r in slow_late)
    for row in slow_late:  # judged at step 3, stopped by the trial runner: SIGTERM, one step
        assert row["pruned_at"] == 3
        log = (out / "logs" / f"trial-{row['trial']:04d}.log").read_text()
        assert "(SIGTERM)" in log and "Traceback" not in log
    assert result.best["optimizer.lr"] == 0.02
    assert (out / "results.csv").is_file() and (out / "plots" / "history.png").is_file()
    # rerun: nothing left to do; more trials asked for: only those run
    assert len(run_search(path, out=out, log=lambda _m: None).rows) == 6
    assert len(run_search(path, out=out, trials=7, log=lambda _m: None).rows) == 7


def test_processes_share_a_study_through_its_storage(tmp_path):
    path = write_search(
        tmp_path,
        'trials = 2\nstartup_trials = 1\n[params]\n"schedule.warmup_steps" = { int = [0, 3] }\n',
    )
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    first = run_search(path, out=tmp_path / "a", storage=storage, log=lambda _m: None)
    second = run_search(path, out=tmp_path / "b", trials=3, storage=storage, log=lambda _m: None)
    assert len(first.rows) == 2 and len(second.rows) == 3
    assert [r["trial"] for r in second.rows] == [0, 1, 2]
    assert not list((tmp_path / "b" / "trials").iterdir())[1:]  # b ran one trial itself


def test_processes_on_one_study_draw_different_trials(tmp_path):
    """Two processes with one seed would suggest the same parameters side by side; each
    gets its own seed offset (``--workers`` numbers them)."""
    path = write_search(
        tmp_path,
        'trials = 2\nsampler = "random"\nseed = 0\n'
        '[params]\n"optimizer.lr" = { log_uniform = [1e-4, 1e-2] }\n',
    )
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    run_search(path, out=tmp_path / "a", trials=1, storage=storage, log=lambda _m: None)
    rows = run_search(
        path, out=tmp_path / "b", trials=2, storage=storage, seed_offset=1000,
        log=lambda _m: None,
    ).rows  # fmt: skip
    assert rows[0]["optimizer.lr"] != rows[1]["optimizer.lr"]


def test_table_choices_reach_the_trials_as_tables(tmp_path):
    path = write_search(
        tmp_path,
        '[params]\n"model.position" = { choice = [{ name = "rope" }, { name = "learned" }] }\n',
    )
    result = run_search(path, out=tmp_path / "out", trials=2, log=lambda _m: None)
    chosen = {json.dumps(r["model.position"], sort_keys=True) for r in result.rows}
    assert all(r["state"] == "COMPLETE" for r in result.rows) and len(result.rows) == 2
    assert chosen <= {'{"name": "rope"}', '{"name": "learned"}'}


def test_a_search_whose_trials_all_fail_stops_and_says_why(tmp_path, monkeypatch):
    """Each trial is an ``llmkit train`` process started by the trial runner sweeps use
    too; here a stand-in that fails as the CLI does (its ``error:`` line, exit 2)."""
    from llmkit.experiments import trial as trial_runner

    calls: list[Path] = []

    def failing(job):
        calls.append(job.run_dir)
        if len(calls) > 20:
            raise SystemExit("the search never stopped")
        script = "import sys; print('error: out of memory (simulated)'); sys.exit(2)"
        return [sys.executable, "-c", script]

    monkeypatch.setattr(trial_runner, "train_command", failing)
    path = write_search(tmp_path, '[params]\n"optimizer.lr" = { log_uniform = [1e-4, 1e-2] }\n')
    said: list[str] = []
    result = run_search(path, out=tmp_path / "out", trials=3, log=said.append)
    assert len(calls) == 3 and result.best is None
    assert [r["state"] for r in result.rows] == ["FAIL"] * 3
    assert [r["error"] for r in result.rows] == ["out of memory (simulated)"] * 3
    assert any("3 trials failed" in m and "out of memory (simulated)" in m for m in said)
    log = (tmp_path / "out" / "logs" / "trial-0000.log").read_text()
    assert "error: out of memory (simulated)" in log
