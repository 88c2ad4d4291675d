"""Experiment trackers (kind ``logger``, ``train.loggers``): each built-in writes what
``metrics.jsonl`` holds, a resumed run leaves no duplicate, a plugin adds one, and a tracker
that cannot start is a one-line error before step 1."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from llmkit.contracts import LoggerContext, MetricsLogger, NoOptions
from llmkit.errors import SpecError
from llmkit.hookspecs import hookimpl
from llmkit.spec import load_spec, load_spec_dict
from llmkit.training import RunPlan, Trainer, train
from tests.helpers import registry_with, tiny_spec, write_train_spec

CORPUS = "the quick brown fox jumps over the lazy dog.\n" * 120


def quiet() -> dict:
    return {"log": lambda _m: None, "progress": False}


def run_with(tmp_path: Path, loggers: str, **train_args) -> Path:
    spec = write_train_spec(tmp_path, CORPUS, max_steps=6, eval_interval=3, log_interval=2)
    out = tmp_path / "run"
    train(str(spec), run_dir=out, overrides=[f"train.loggers={loggers}", *train_args.pop(
        "overrides", [])], **quiet(), **train_args)  # fmt: skip
    return out


def jsonl(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def numeric(record: dict) -> dict:
    return {
        k: v
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and math.isfinite(v)
    }


def test_logger_entries_are_validated_like_components():
    base = tiny_spec()
    base["train"] = {"loggers": [{"name": "csvv"}, {"name": "csv", "file": "../x.csv"}]}
    with pytest.raises(SpecError) as err:
        load_spec_dict(base)
    text = str(err.value)
    assert "train.loggers[0].name: unknown logger 'csvv' (did you mean 'csv'?)" in text
    assert "train.loggers[1].file" in text
    base["train"] = {"loggers": [{"name": "csv"}, {"name": "tensorboard", "dir": "tb"}]}
    rs = load_spec_dict(base)
    assert [r.name for r in rs.loggers] == ["csv", "tensorboard"]
    assert rs.to_dict()["train"]["loggers"][1] == {"name": "tensorboard", "dir": "tb"}


def test_csv_holds_every_record_and_a_resumed_run_rewrites_none_twice(tmp_path, monkeypatch):
    spec = write_train_spec(tmp_path, CORPUS, max_steps=8, eval_interval=3, log_interval=1)
    out = tmp_path / "run"
    over = ['train.loggers=[{name="csv"}]']
    monkeypatch.setenv("LLMKIT_FAIL_AT", "0:8")  # dies before step 8; last checkpoint: 6
    with pytest.raises(RuntimeError, match="injected failure"):
        train(str(spec), run_dir=out, overrides=over, **quiet())
    with (out / "metrics.csv").open() as fh:
        assert max(int(r["step"]) for r in csv.DictReader(fh)) == 7
    monkeypatch.delenv("LLMKIT_FAIL_AT")
    train(None, run_dir=out, resume=True, **quiet())
    with (out / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    records = jsonl(out)
    assert [int(r["step"]) for r in rows] == [r["step"] for r in records]  # no step twice
    for row, record in zip(rows, records):
        for key, value in numeric(record).items():
            assert float(row[key]) == pytest.approx(value)


def test_tensorboard_scalars_match_the_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = run_with(tmp_path, '[{name="tensorboard"}]')
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    records = jsonl(run)
    for key in ("loss", "val_loss", "lr"):
        expected = [(r["step"], r[key]) for r in records if key in r]
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in expected]
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)


def test_mlflow_run_in_a_local_store_holds_the_metrics_and_the_spec(tmp_path):
    from mlflow.tracking import MlflowClient

    run = run_with(tmp_path, '[{name="mlflow", experiment="unit"}]')
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    exp = client.get_experiment_by_name("unit")
    (found,) = client.search_runs([exp.experiment_id])
    assert found.info.status == "FINISHED" and found.data.params["model.d_model"] == "32"
    history = client.get_metric_history(found.info.run_id, "val_loss")
    expected = [(r["step"], r["val_loss"]) for r in jsonl(run) if "val_loss" in r]
    got = sorted((m.step, m.value) for m in history)
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert [v for _, v in got] == pytest.approx([v for _, v in expected])


def test_wandb_runs_offline_in_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = run_with(tmp_path, '[{name="wandb", project="unit"}]')
    # ``run.finish()`` returns once the run is complete; the service may still hold the last
    # block of the transaction log until it shuts down, which a CLI run's exit does (atexit).
    import wandb

    wandb.teardown()
    (offline,) = (run / "wandb").glob("offline-run-*")
    (data,) = offline.glob("run-*.wandb")
    blob = data.read_bytes()
    assert b"val_loss" in blob and b"grad_norm" in blob  # the records, as W&B stores them


def test_a_missing_tracker_package_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    from llmkit.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb → ImportError
    spec = write_train_spec(tmp_path, CORPUS, max_steps=2)
    code = main(["train", str(spec), "--out", str(tmp_path / "run"), "--set",
                 'train.loggers=[{name="wandb"}]'])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "pip install 'llmkit[wandb]'" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "model.safetensors").exists()


class Recorder(MetricsLogger):
    """A plugin's logger: keeps what it gets."""

    Options = NoOptions
    seen: ClassVar[list[dict]] = []
    contexts: ClassVar[list[LoggerContext]] = []
    closed = 0

    def __init__(self, options: NoOptions, ctx: LoggerContext) -> None:
        Recorder.contexts.append(ctx)

    def log(self, record: dict) -> None:
        Recorder.seen.append(record)

    def close(self) -> None:
        Recorder.closed += 1


class RecorderPlugin:
    distribution = "llmkit-recorder"
    name = "recorder"

    @hookimpl
    def register_components(self, register):
        register("logger", "recorder", Recorder, summary="keeps records in memory")


def test_a_plugin_logger_gets_every_record(tmp_path):
    reg = registry_with(RecorderPlugin())
    spec = write_train_spec(tmp_path, CORPUS, max_steps=4, eval_interval=2, log_interval=1)
    rs = load_spec(spec, overrides=['train.loggers=[{name="recorder"}]'], registry=reg)
    Trainer(RunPlan.settle(rs, tmp_path / "run"), **quiet()).fit()
    assert Recorder.seen == jsonl(tmp_path / "run") and Recorder.closed == 1
    (ctx,) = Recorder.contexts
    assert ctx.run_dir == tmp_path / "run" and ctx.resume_step is None
    assert ctx.config["model"]["d_model"] == 32


def test_evaluation_results_go_through_the_run_loggers(tmp_path):
    from llmkit.evaluation import ItemScore, TaskResult
    from llmkit.evaluation.runner import log_results, weights_step
    from llmkit.runs import open_run

    run = run_with(tmp_path, '[{name="csv"}]')
    item = ItemScore(0, 0, [-1.0, -2.0], [1, 1], [1, 1], [1, 1], [True, False])
    result = TaskResult("demo", "multiple_choice", 0, 1, [item], {"acc": 1.0, "chance": 0.5})
    step = weights_step(run / "model.safetensors", run)
    assert step == 6
    log_results(open_run(run).resolve(), run, [result], step)
    last = jsonl(run)[-1]
    assert last == {"step": 6, "eval": "demo", "demo/acc": 1.0, "demo/chance": 0.5,
                    "demo/items": 1, "demo/num_fewshot": 0}  # fmt: skip
    with (run / "metrics.csv").open() as fh:
        assert list(csv.DictReader(fh))[-1]["demo/acc"] == "1.0"
