"""``llmkit compare``: only what differs between specs, each run's metrics and latest task
results, overlaid curves, and directories of runs."""

from __future__ import annotations

import json

import pytest

from llmkit.cli import main
from llmkit.errors import LlmkitError
from llmkit.experiments.compare import compare, differences, flatten, metric_table
from llmkit.training import train
from tests.helpers import write_train_spec

CORPUS = "the quick brown fox jumps over the lazy dog.\n" * 120


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    spec = write_train_spec(root, CORPUS, max_steps=4, eval_interval=2, log_interval=1)
    quiet = {"log": lambda _m: None, "progress": False}
    train(str(spec), run_dir=root / "runs" / "a", **quiet)
    train(str(spec), run_dir=root / "runs" / "b", overrides=["optimizer.lr=0.01"], **quiet)
    return root / "runs"


def records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_flatten_keeps_scalar_lists_and_indexes_tables():
    assert flatten({"a": {"b": 1}, "c": [1, 2], "d": [{"e": 3}]}) == {
        "a.b": 1,
        "c": [1, 2],
        "d.0.e": 3,
    }


def test_only_the_differences_and_every_metric(runs):
    a, b = compare([runs / "a", runs / "b"])
    assert differences([a, b]) == {"optimizer.lr": [0.003, 0.01]}
    table = metric_table([a, b])
    for i, run in enumerate((runs / "a", runs / "b")):
        val = [r["val_loss"] for r in records(run) if "val_loss" in r]
        assert table["val_loss"][i] == val[-1] and table["best_val_loss"][i] == min(val)
        assert table["step"][i] == 4 and table["train_loss"][i] == records(run)[-2]["loss"]
    assert list(table)[:3] == ["step", "tokens", "train_loss"]


def test_task_results_show_once_evaluated(runs):
    with (runs / "b" / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": 4, "eval": "demo", "demo/acc": 0.5, "demo/acc_stderr": 0.1}))
        fh.write("\n")
        fh.write(json.dumps({"step": 4, "eval": "demo", "demo/acc": 0.75}) + "\n")
    table = metric_table(compare([runs / "a", runs / "b"]))
    assert table["demo/acc"] == [None, 0.75] and "demo/acc_stderr" not in table
    assert table["val_loss"][1] is not None  # an eval record is no training record


def test_a_directory_of_runs_and_the_command(runs, tmp_path, capsys):
    assert [r.label for r in compare([runs])] == ["a", "b"]
    plot = tmp_path / "curves.png"
    assert main(["compare", str(runs), "--plot", str(plot), "--x", "tokens", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in report["runs"]] == ["a", "b"]
    assert report["differences"] == {"optimizer.lr": [0.003, 0.01]}
    assert plot.stat().st_size > 10_000
    assert main(["compare", str(runs / "a"), str(runs / "b")]) == 0
    out = capsys.readouterr().out
    assert "optimizer.lr" in out and "best_val_loss" in out


def test_bad_paths_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(LlmkitError, match="run not found"):
        compare([tmp_path / "nope"])
    with pytest.raises(LlmkitError, match="holds none"):
        compare([tmp_path])
    assert main(["compare", str(tmp_path / "nope")]) != 0
    assert "Traceback" not in capsys.readouterr().err
