"""``llmkit sweep``: sweep files, axis expansion and trial ids, validation of every trial
before any runs, parallel trials with failures recorded, and resuming after a kill."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from llmkit.errors import LlmkitError, SpecError
from llmkit.experiments.sweep import load_plan, run_sweep, threads_per_worker
from llmkit.experiments.sweep_axes import (
    SweepFile,
    expand,
    read_sweep,
    sweep_schema,
    toml_literal,
)
from llmkit.spec import parse_value
from tests.helpers import write_train_spec

CORPUS = "the quick brown fox jumps over the lazy dog. " * 120

COLUMNS = [
    "trial",
    "status",
    "optimizer.lr",
    "data.source.paths",
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


def sweep_file(tmp_path: Path, text: str, name: str = "sweep.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def cli(*argv: str) -> int:
    """``llmkit sweep ARGV`` through the command's own parser and handler."""
    from llmkit.cli.sweep import configure_sweep, run_sweep_command

    parser = argparse.ArgumentParser()
    configure_sweep(parser)
    return run_sweep_command(parser.parse_args(argv))


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- the sweep file and its trials --------------------------------------------------------------


def test_a_grid_is_the_product_of_axes_and_zip_groups_repeated_per_seed():
    sweep = SweepFile.model_validate(
        {
            "base": "spec.yaml",
            "set": ["train.max_steps=5"],
            "seeds": [0, 1],
            "axes": {
                "optimizer.lr": {"log": [1e-4, 1e-2], "num": 3},
                "model.n_heads": [2, 4],
            },
            "zip": [{"model.d_model": [32, 64], "model.n_layers": [4, 2]}],
        }
    )
    trials = expand(sweep)
    assert len(trials) == 3 * 2 * 2 * 2
    assert [t.values["optimizer.lr"] for t in trials[::8]] == [0.0001, 0.001, 0.01]  # exact
    first = trials[0]
    assert first.id == "t000-lr=0.0001-n_heads=2-d_model=32-n_layers=4-seed=0"
    assert first.overrides == [
        "train.max_steps=5",
        "optimizer.lr=0.0001",
        "model.n_heads=2",
        "model.d_model=32",
        "model.n_layers=4",
        "train.seed=0",
    ]
    assert [t.seed for t in trials[:4]] == [0, 1, 0, 1]  # seeds vary fastest
    assert {(t.values["model.d_model"], t.values["model.n_layers"]) for t in trials} == {
        (32, 4),
        (64, 2),
    }  # zipped axes vary together
    assert len({t.id for t in trials}) == len(trials)
    assert [t.id for t in expand(sweep)] == [t.id for t in trials]  # stable


def test_ranges_integers_seed_counts_and_sanitized_ids():
    sweep = SweepFile.model_validate(
        {
            "base": "x",
            "seeds": 2,
            "axes": {
                "model.d_model": {"log": [64, 512], "num": 4, "integer": True},
                "train.grad_clip": {"linear": [0.5, 1.5], "num": 3},
                "data.source.paths": [["a/b c.txt"]],
                "model.position": [{"name": "rope"}],
            },
        }
    )
    trials = expand(sweep)
    assert sweep.seeds == [0, 1]
    assert sorted({t.values["model.d_model"] for t in trials}) == [64, 128, 256, 512]
    assert sorted({t.values["train.grad_clip"] for t in trials}) == [0.5, 1.0, 1.5]
    assert trials[0].id == "t000-d_model=64-grad_clip=0.5-paths=a_b_c.txt-position=rope-seed=0"
    assert 'data.source.paths=["a/b c.txt"]' in trials[0].overrides
    assert 'model.position={"name" = "rope"}' in trials[0].overrides


def test_random_samples_are_reproducible_from_their_seed():
    def sample(seed: int) -> list[dict]:
        sweep = SweepFile.model_validate(
            {
                "base": "x",
                "random": {
                    "samples": 6,
                    "seed": seed,
                    "axes": {
                        "optimizer.lr": {"log_uniform": [1e-4, 1e-2]},
                        "model.n_layers": {"int": [1, 8]},
                        "model.norm": {"choice": [{"name": "rmsnorm"}, {"name": "layernorm"}]},
                    },
                },
            }
        )
        return [t.values for t in expand(sweep)]

    first = sample(0)
    assert first == sample(0)
    assert first != sample(1)
    assert len(first) == 6
    for values in first:
        assert 1e-4 <= values["optimizer.lr"] <= 1e-2
        assert values["model.n_layers"] in range(1, 9)


def test_set_values_read_back_as_written():
    values = [3, 0.001, 1e-05, True, "sdpa", 'a "q" \\ é', [1, 2.5], {"name": "rope", "x": [1]}]
    for value in values:
        assert parse_value(toml_literal(value)) == value


def test_bad_sweep_files_are_refused_with_every_problem(tmp_path):
    path = sweep_file(
        tmp_path,
        """
        base = "spec.yaml"
        sed = [1]
        [axes]
        "optimizer.lr" = 0.001
        "model.n_heads" = { log = [0, 8], num = 3 }
        [[zip]]
        "model.d_model" = [32, 64]
        "model.n_layers" = [2]
        """,
    )
    with pytest.raises(SpecError) as info:
        read_sweep(path)
    problems = "\n".join(info.value.problems)
    assert "sed: unknown key; did you mean 'seeds'?" in problems
    assert 'axes["optimizer.lr"]: an axis is a list of values' in problems
    assert 'axes["model.n_heads"].log: a log-spaced range needs two values > 0' in problems
    for bad in (
        {"base": "x", "axes": {"a": [1]}, "random": {"samples": 1, "axes": {"b": {"choice": [1]}}}},
        {"base": "x", "seeds": [1], "axes": {"train.seed": [1, 2]}},
        {"base": "x", "axes": {"a": [1]}, "zip": [{"a": [2]}]},
        {"base": "x", "axes": {"a": [None]}},
    ):
        with pytest.raises(ValueError):
            SweepFile.model_validate(bad)


def test_a_yaml_file_and_a_model_plan_the_same_trials(tmp_path, monkeypatch):
    write_train_spec(tmp_path, CORPUS)
    toml = sweep_file(
        tmp_path,
        """
        base = "spec.yaml"
        seeds = [3, 4]
        [axes]
        "optimizer.lr" = { log = [1e-3, 1e-2], num = 2 }
        """,
    )
    yaml_file = sweep_file(
        tmp_path,
        """
        base: spec.yaml
        seeds: [3, 4]
        axes:
          optimizer.lr: {log: [1.0e-3, 1.0e-2], num: 2}
        """,
        "sweep.yaml",
    )
    monkeypatch.chdir(tmp_path)  # a model's base is relative to the current directory
    model = SweepFile.model_validate({"base": "spec.yaml", "seeds": [3, 4], "axes": {}})
    model = model.model_copy(update={"axes": read_sweep(toml).axes})
    plans = [load_plan(toml), load_plan(yaml_file), load_plan(model)]
    assert [p.name for p in plans] == ["sweep", "sweep", "sweep"]
    assert {p.base for p in plans} == {(tmp_path / "spec.yaml").resolve()}
    ids = [[(t.id, tuple(t.overrides)) for t in p.trials] for p in plans]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 4


def test_the_schema_is_the_sweep_files(capsys):
    schema = sweep_schema()
    assert schema["additionalProperties"] is False
    assert {"base", "set", "seeds", "axes", "zip", "random", "metric"} <= set(schema["properties"])
    assert cli("--schema") == 0
    assert json.loads(capsys.readouterr().out)["title"] == "llmkit sweep"


def test_threads_are_shared_out_among_workers():
    assert threads_per_worker(2, cores=8) == 4
    assert threads_per_worker(3, cores=8) == 2
    assert threads_per_worker(16, cores=8) == 1


# -- validation before anything runs ------------------------------------------------------------


def test_every_bad_trial_is_reported_at_once_and_nothing_runs(tmp_path, capsys):
    write_train_spec(tmp_path, CORPUS, max_steps=4)
    path = sweep_file(
        tmp_path,
        """
        name = "bad"
        base = "spec.yaml"
        [axes]
        "model.n_heads" = [2, 3, 4, 5]
        "optimizer.lr" = [0.001, -1.0]
        """,
    )
    out = tmp_path / "out"
    with pytest.raises(SpecError) as info:
        run_sweep(path, out=out, log=lambda _: None)
    message = str(info.value)
    assert "(6 of 8 trials invalid; none was run)" in message
    divisible = "model: d_model (32) must be divisible by n_heads"
    assert f"t002-n_heads=3-lr=0.001: {divisible} (3)" in message
    assert f"t006-n_heads=5-lr=0.001: {divisible} (5)" in message
    assert "t001-n_heads=2-lr=-1: optimizer.lr: Input should be greater than 0" in message
    assert not out.exists()

    good = sweep_file(tmp_path, 'base = "spec.yaml"\n[axes]\n"model.n_heads" = [2, 4]\n', "ok.toml")
    assert cli(str(good), "--dry-run", "--out", str(out)) == 0
    listing = capsys.readouterr().out
    assert "t001-n_heads=4" in listing and "model.n_heads=4" in listing
    assert "2 trials, all valid; nothing was run" in listing
    assert not out.exists()
    with pytest.raises(LlmkitError, match=r"base .nope.toml. \(relative to .*: no spec file"):
        load_plan(sweep_file(tmp_path, 'base = "nope.toml"\n', "nobase.toml"))


def test_a_model_that_cannot_be_built_is_caught_before_anything_runs(tmp_path):
    """A spec that resolves but whose model cannot be built (RoPE on an odd head size) is
    reported with the others, not found when its trial starts."""
    write_train_spec(tmp_path, CORPUS, max_steps=4)
    path = sweep_file(
        tmp_path,
        'base = "spec.yaml"\nset = ["model.n_heads=4"]\n[axes]\n"model.d_model" = [32, 36]\n',
    )
    with pytest.raises(SpecError) as info:
        run_sweep(path, out=tmp_path / "out", log=lambda _: None)
    message = str(info.value)
    assert "(1 of 2 trials invalid; none was run)" in message
    assert "t001-d_model=36: " in message and "rotary dimensions" in message
    assert not (tmp_path / "out").exists()


# -- running ------------------------------------------------------------------------------------


def test_trials_run_in_parallel_and_a_failure_is_recorded(tmp_path, monkeypatch, capsys):
    """Four trials on two workers; one names a corpus that does not exist (valid as a spec,
    it fails when its data is read) and is recorded while the others finish. A rerun skips
    every ended trial."""
    monkeypatch.chdir(tmp_path)
    write_train_spec(tmp_path, CORPUS, max_steps=6, eval_interval=3)
    path = sweep_file(
        tmp_path,
        """
        name = "par"
        base = "spec.yaml"
        set = ["train.max_steps=6"]
        metric = "best_val_loss"
        [[zip]]
        "optimizer.lr" = [0.001, 0.003, 0.01, 0.002]
        "data.source.paths" = [["corpus.txt"], ["corpus.txt"], ["corpus.txt"], ["missing.txt"]]
        """,
    )
    out = tmp_path / "out"
    assert cli(str(path), "--workers", "2", "--out", str(out), "--no-progress") == 1
    shown = capsys.readouterr().out.splitlines()
    assert f"2 worker(s) × {threads_per_worker(2)} thread(s)" in shown[0]
    first_end = next(i for i, line in enumerate(shown) if ": done" in line or ": failed" in line)
    assert sum(": starting" in line for line in shown[:first_end]) == 2  # two at once

    with open(out / "results.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert list(table[0]) == COLUMNS
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["trial"] for r in rows] == [r["trial"] for r in table]
    assert [r["status"] for r in rows] == ["done", "done", "done", "failed"]
    for row in rows[:3]:
        run = out / row["run_dir"]
        assert (run / "model.safetensors").is_file()
        assert row["steps"] == 6 and row["tokens"] == 6 * 4 * 32  # batch 4 x block 32
        assert row["final_val_loss"] == metrics(run)[-1]["val_loss"]
        assert row["final_val_ce"] == metrics(run)[-1]["val_ce"]
        assert row["best_val_loss"] <= row["final_val_loss"]
        assert row["params"] > row["non_embedding_params"] > 0
        assert row["flops"] > 6 * row["non_embedding_params"] * row["tokens"]
        assert row["wall_s"] > 0 and row["seed"] == 1337 and row["error"] is None
    assert rows[0]["optimizer.lr"] == 0.001 and rows[0]["data.source.paths"] == ["corpus.txt"]
    assert "missing.txt" in rows[3]["error"]
    assert table[3]["error"] == rows[3]["error"] and table[3]["final_val_loss"] == ""
    assert (out / "sweep.toml").read_text() == path.read_text()
    plots = ["best_val_loss-vs-optimizer.lr.png", "best_val_loss-vs-data.source.paths.png"]
    for plot in (*plots, "loss-curves.png"):
        assert (out / "plots" / plot).stat().st_size > 0

    logs = {p.name: p.stat().st_size for p in (out / "logs").iterdir()}
    lines: list[str] = []
    result = run_sweep(path, out=out, log=lines.append, progress=False)
    assert "(4 already ended, 0 to run)" in lines[0]
    assert [r["status"] for r in result.rows] == ["done", "done", "done", "failed"]
    assert {p.name: p.stat().st_size for p in (out / "logs").iterdir()} == logs

    path.write_text(path.read_text().replace("0.002", "0.004"))
    with pytest.raises(LlmkitError, match="holds a sweep with other trials"):
        run_sweep(path, out=out, log=lines.append, progress=False)


#: A stand-in for ``llmkit train`` that fails while ``<sweep>/fail`` exists, else
#: ends a 4-step run (checkpoint, weights, metrics) as the trainer would.
FAKE_RUN = """
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
run.mkdir(parents=True, exist_ok=True)
if (run.parent.parent / "fail").exists():  # <sweep>/fail
    sys.exit("error: boom")
(run / "checkpoints" / "step-000004").mkdir(parents=True)
(run / "checkpoints" / "latest.json").write_text(json.dumps({"step": 4, "dir": "step-000004"}))
(run / "model.safetensors").write_bytes(b"")
lines = [{"step": 4, "loss": 2.5, "tokens": 512, "elapsed": 1.0}, {"step": 4, "val_loss": 2.25}]
(run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\\n" for x in lines))
print("done: 4 steps, 512 tokens in 1.0s (max_steps); val loss 2.2500; run: " + str(run))
"""


def fake_trainer(monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """Trials run ``script`` (given the trial's run directory) instead of ``llmkit train``:
    the trial runner's one command, shared with ``llmkit search``."""
    from llmkit.experiments import trial

    monkeypatch.setattr(
        trial, "train_command", lambda job: [sys.executable, "-c", script, str(job.run_dir)]
    )


def test_failed_trials_stay_failed_unless_retried(tmp_path, monkeypatch):
    fake_trainer(monkeypatch, FAKE_RUN)
    write_train_spec(tmp_path, CORPUS, max_steps=4)
    path = sweep_file(tmp_path, 'base = "spec.yaml"\nseeds = 2\n')
    out = tmp_path / "out"
    (out / "fail").parent.mkdir()
    (out / "fail").write_text("")
    quiet = {"out": out, "log": lambda _: None, "progress": False}
    result = run_sweep(path, workers=2, **quiet)
    assert [(r["status"], r["error"]) for r in result.rows] == [("failed", "boom")] * 2
    logs = {p: p.read_text() for p in (out / "logs").iterdir()}

    (out / "fail").unlink()
    result = run_sweep(path, **quiet)
    assert [(r["status"], r["error"]) for r in result.rows] == [("failed", "boom")] * 2
    assert {p: p.read_text() for p in (out / "logs").iterdir()} == logs  # nothing ran

    result = run_sweep(path, retry_failed=True, **quiet)
    assert [(r["status"], r["error"]) for r in result.rows] == [("done", None)] * 2
    assert [r["final_val_loss"] for r in result.rows] == [2.25, 2.25]
    assert result.rows[0]["flops"] > 512 * result.rows[0]["non_embedding_params"]


#: A stand-in for ``llmkit train``: it trains until SIGTERM, then saves "checkpoint 3" and
#: ends, as the trainer does; the sweep's handling of a stop is what is tested.
FAKE_STOP = """
import json, pathlib, signal, sys, time
run = pathlib.Path(sys.argv[1])
run.mkdir(parents=True, exist_ok=True)
def stop(signum, frame):
    (run / "checkpoints" / "step-000003").mkdir(parents=True)
    (run / "checkpoints" / "latest.json").write_text(json.dumps({"step": 3, "dir": "step-000003"}))
    print("done: 3 steps, 384 tokens in 1.0s (SIGTERM); val loss n/a; run: " + str(run))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
(run / "started").write_text("")
time.sleep(120)
"""


def test_sigterm_stops_the_running_trials_which_keep_their_checkpoint(tmp_path, monkeypatch):
    fake_trainer(monkeypatch, FAKE_STOP)
    write_train_spec(tmp_path, CORPUS, max_steps=4)
    path = sweep_file(tmp_path, 'base = "spec.yaml"\nseeds = 3\n')
    out = tmp_path / "out"
    trials = out / "trials"

    def stop_when_running() -> None:
        deadline = time.time() + 60
        while len(list(trials.glob("*/started"))) < 2 and time.time() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill SWEEP_PID`, or Ctrl-C

    stopper = threading.Thread(target=stop_when_running)
    stopper.start()
    lines: list[str] = []
    try:
        result = run_sweep(path, out=out, workers=2, log=lines.append, progress=False)
    finally:
        stopper.join()
    assert result.stopped == "SIGTERM"
    assert [r["status"] for r in result.rows] == ["interrupted", "interrupted", "pending"]
    assert [json.loads(line)["status"] for line in (out / "results.jsonl").open()] == [
        "interrupted",
        "interrupted",
        "pending",
    ]
    assert not (trials / "t002-seed=2").exists()  # nothing started after the stop
    assert any("SIGTERM: stopping" in line for line in lines)
    assert "rerun the sweep to finish it" in lines[-1]


def _latest_step(run: Path) -> int | None:
    try:
        return json.loads((run / "checkpoints" / "latest.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None


def test_a_killed_sweep_resumes_its_interrupted_trial_exactly(tmp_path):
    """Kill the sweep (and its trial) with SIGKILL after the trial's first checkpoint; the
    rerun resumes that trial from the checkpoint, and it ends with the numbers of the same
    trial trained without interruption (the sweep's second, identical trial)."""
    write_train_spec(tmp_path, CORPUS, max_steps=40, eval_interval=5)
    path = sweep_file(
        tmp_path,
        """
        name = "kill"
        base = "spec.yaml"
        [axes]
        "train.log_interval" = [1, 1]  # two identical trials: the second is the reference
        """,
    )
    out = tmp_path / "out"
    code = (
        "from llmkit.experiments.sweep import run_sweep; "
        f"run_sweep({str(path)!r}, out={str(out)!r})"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # the sweep and its trial in one process group
    )
    first = out / "trials" / "t000-log_interval=1"
    deadline = time.time() + 240
    try:
        while (_latest_step(first) or 0) < 5:
            assert proc.poll() is None, "the sweep ended before it could be killed"
            assert time.time() < deadline, "no checkpoint in time"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = _latest_step(first)
    assert killed_at is not None and killed_at < 40 and not (first / "model.safetensors").exists()
    assert not (out / "trials" / "t001-log_interval=1").exists()

    lines: list[str] = []  # one worker, as before the kill: the same threads, the same sums
    result = run_sweep(path, out=out, log=lines.append, progress=False)
    assert any(f"t000-log_interval=1: resuming from step {killed_at}" in line for line in lines)
    assert "resumed from" in (out / "logs" / "t000-log_interval=1.log").read_text()
    resumed, reference = result.rows
    assert resumed["status"] == reference["status"] == "done"
    steps = [m["step"] for m in metrics(first) if "loss" in m]
    assert steps == list(range(1, 41))  # continued: every step once, none trained twice
    for key in (
        "final_val_ce",
        "final_val_loss",
        "best_val_loss",
        "final_train_loss",
        "steps",
        "tokens",
    ):
        assert resumed[key] == reference[key], key
    ref_run = out / reference["run_dir"]
    assert [m["loss"] for m in metrics(first) if "loss" in m] == [
        m["loss"] for m in metrics(ref_run) if "loss" in m
    ]
    assert (out / "plots" / "loss-curves.png").is_file()


# -- branch_budgets ----------------------------------------------------------------------------

WSD_SET = 'set = ["schedule={name = \\"wsd\\", warmup_steps = 2, decay_fraction = 0.25}"]'


def test_branch_budgets_train_a_short_budget_as_a_cooldown_branch_of_the_long_one(tmp_path):
    """Budgets 6 and 12 of one configuration ("a") share a run: the 12-step trial keeps a
    checkpoint at step 4 (6 − max(1, round(0.25 · 6))), the 6-step trial is branched from it
    and trains steps 5-6 only, ending exactly as configuration "b"'s 6 steps trained alone
    (sample_prompt changes nothing with --no-sample: it only makes "b" a group of its own)."""
    write_train_spec(tmp_path, CORPUS, max_steps=6, eval_interval=3)
    path = sweep_file(
        tmp_path,
        f"""
        name = "budgets"
        base = "spec.yaml"
        branch_budgets = true
        {WSD_SET}
        [[zip]]
        "train.max_steps" = [6, 12, 6]
        "train.sample_prompt" = ["a", "a", "b"]
        """,
    )
    out = tmp_path / "out"
    lines: list[str] = []
    result = run_sweep(path, out=out, log=lines.append, progress=False)
    short, long, alone = result.rows
    assert [r["status"] for r in result.rows] == ["done"] * 3
    assert long["trial"] == "t001-max_steps=12-sample_prompt=a"
    defined = json.loads((out / "sweep.json").read_text())["trials"]
    assert defined[1]["overrides"][-1] == "train.checkpoint_steps=[4]"
    assert "checkpoint_steps" not in " ".join(defined[0]["overrides"] + defined[2]["overrides"])

    log = (out / "logs" / f"{short['trial']}.log").read_text()
    assert f"branched from {long['trial']} at step 4" in log
    assert "step-000004 at step 4" in log and "--set train.max_steps=6" in log
    branch = out / short["run_dir"]
    assert json.loads((branch / "branch.json").read_text())["step"] == 4
    for key in (
        "final_val_ce",
        "final_val_loss",
        "best_val_loss",
        "final_train_loss",
        "steps",
        "tokens",
    ):
        assert short[key] == alone[key], key
    assert short["steps"] == 6 and long["steps"] == 12
    assert [r["branched_from"] for r in result.rows] == [f"{long['trial']}@4", None, None]
    assert result.columns[-1] == "branched_from"
    with open(out / "results.csv", newline="") as fh:
        assert next(csv.DictReader(fh))["branched_from"] == f"{long['trial']}@4"
    losses = [[m["loss"] for m in metrics(out / r["run_dir"]) if "loss" in m] for r in result.rows]
    assert losses[0] == losses[2] and len(losses[0]) == 6
    assert losses[1][:4] == losses[0][:4]  # the shared stable phase
    assert 4 in [int(p.name[5:]) for p in (out / long["run_dir"] / "checkpoints").glob("step-*")]


def test_branch_budgets_refuse_a_schedule_other_than_wsd_or_a_decay_in_the_warmup(tmp_path):
    write_train_spec(tmp_path, CORPUS, max_steps=6)
    out = tmp_path / "out"
    cosine = sweep_file(
        tmp_path, 'base = "spec.yaml"\nbranch_budgets = true\n[axes]\n"train.max_steps" = [6, 12]\n'
    )
    with pytest.raises(
        SpecError, match="branch_budgets needs a schedule with a stable phase, not 'cosine'"
    ):
        run_sweep(cosine, out=out, log=lambda _: None)
    early = sweep_file(
        tmp_path,
        f'base = "spec.yaml"\nbranch_budgets = true\n{WSD_SET}\n'
        '[axes]\n"train.max_steps" = [3, 12]\n',
        "early.toml",
    )
    with pytest.raises(SpecError, match=r"t000-max_steps=3: its decay would start at step 2, wit"):
        run_sweep(early, out=out, log=lambda _: None)
    assert not out.exists()


def test_integer_draws_give_every_integer_of_the_range_its_share():
    import random
    from collections import Counter

    from llmkit.experiments.distributions import Int

    rng = random.Random(0)
    flat = Counter(Int(int=(2, 8)).draw(rng) for _ in range(14_000))
    assert sorted(flat) == list(range(2, 9))
    assert all(abs(n / 14_000 - 1 / 7) < 0.015 for n in flat.values())  # the ends too
    log = Counter(Int(int=(1, 8), log=True).draw(rng) for _ in range(14_000))
    share = {k: math.log((k + 0.5) / (k - 0.5)) / math.log(8.5 / 0.5) for k in range(1, 9)}
    assert sorted(log) == list(range(1, 9))
    assert all(abs(log[k] / 14_000 - share[k]) < 0.015 for k in share)
    with pytest.raises(ValueError, match="valid integer"):
        Int(int=(2.2, 2.8))
