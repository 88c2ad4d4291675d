"""``llmkit compare``: only what differs between specs, each run's metrics and latest task
results, overlaid curves, and directories of runs."""

from __future__ import annotations

import json

import pytest

from llmkit.cli import main
from llmkit.errors import LlmkitError
from llmkit.experiments.compare import (
    best_run,
    compare,
    differences,
    flatten,
    metric_table,
    objective_name,
)
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
        # The cross-entropy leads; for these runs it is also their objective.
        assert table["val_ce"][i] == table["val_loss"][i]
        assert table["objective"][i] == "cross_entropy"
        assert table["trained_tokens"][i] == table["tokens"][i]
    assert list(table)[:3] == ["val_ce", "val_ppl", "best_val_ce"]


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


def test_runs_are_ranked_by_cross_entropy_not_by_their_objectives(runs, tmp_path, capsys):
    """A distilled student's objective (α·T²·KL + (1−α)·CE) looked better than a student
    trained alone (3.32 against 5.94) while its cross-entropy was worse (6.06 against
    5.89): compare leads with val_ce and ranks by it, the objective labelled beside it."""
    import shutil

    for name, val in (
        ("distilled", {"val_loss": 3.32, "val_ce": 6.06, "val_ppl": 428.38}),
        ("alone", {"val_loss": 5.94, "val_ce": 5.89, "val_ppl": 361.41}),
    ):
        run = tmp_path / name
        shutil.copytree(runs / "a", run)
        lines = [r for r in records(run) if "val_loss" not in r]
        lines.append({"step": 4, **val, "best_val_loss": val["val_loss"]})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    # A run logged before every evaluation carried val_ce: its val_loss is the cross-entropy.
    old = tmp_path / "old"
    shutil.copytree(runs / "b", old)
    lines = [{k: v for k, v in r.items() if k != "val_ce"} for r in records(old)]
    (old / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))

    summaries = compare([tmp_path / "distilled", tmp_path / "alone", old])
    table = metric_table(summaries)
    assert table["val_ce"][:2] == [6.06, 5.89] and table["val_loss"][:2] == [3.32, 5.94]
    assert table["val_ce"][2] == table["val_loss"][2]
    assert best_run(summaries[:2]).label == "alone"  # not the lower objective
    assert main(["compare", str(tmp_path / "distilled"), str(tmp_path / "alone")]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert rows.index("val_ce") < rows.index("val_ppl") < rows.index("objective")
    assert rows.index("val_ce") < rows.index("val_loss") < rows.index("train_loss")
    assert "val_loss (objective)" in out and "best_val_loss (objective)" in out
    assert "best by val_ce (cross-entropy): alone (5.8900)" in out


def test_the_objective_is_named_from_the_spec():
    assert objective_name({"train.max_steps": 4}) == "cross_entropy"
    assert objective_name({"train.loss.name": "z_loss"}) == "z_loss"
    assert objective_name({"train.distill.teacher": "/runs/t"}) == "distill"
    both = {"train.distill.teacher": "/runs/t", "train.loss.name": "label_smoothing"}
    assert objective_name(both) == "distill(label_smoothing)"


def test_bad_paths_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(LlmkitError, match="run not found"):
        compare([tmp_path / "nope"])
    with pytest.raises(LlmkitError, match="holds none"):
        compare([tmp_path])
    assert main(["compare", str(tmp_path / "nope")]) != 0
    assert "Traceback" not in capsys.readouterr().err
