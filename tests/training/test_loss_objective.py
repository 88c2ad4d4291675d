"""The ``loss`` kind (plugins/llmkit-losses) as the training objective: chosen at
``train.loss``, minimized by the trainer, evaluated the same way, resumed exactly."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmkit.errors import SpecError
from llmkit.evaluation.perplexity import evaluate_batches
from llmkit.model import Objective
from llmkit.registry import get_registry, reset_registry
from llmkit.spec import load_spec
from llmkit.training import train
from tests.helpers import write_train_spec
from tests.training.kill_resume import losses, read_metrics, train_killed_and_resumed, val_losses

CORPUS = "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs.\n" * 60


@pytest.fixture
def losses_on(monkeypatch):
    """The process registry with the llmkit-losses plugin loaded, dropped afterwards."""
    monkeypatch.setenv("LLMKIT_PLUGINS", "losses")
    reset_registry()
    reg = get_registry()
    assert "loss" in reg.kinds, (
        "llmkit-losses is not installed: pip install -e plugins/llmkit-losses"
    )
    yield reg
    reset_registry()


def write_spec(tmp_path: Path, loss: dict | None = None, **train) -> Path:
    settings = {"max_steps": 6, "eval_interval": 3, **train}
    if loss is not None:
        settings["loss"] = loss
    return write_train_spec(tmp_path, CORPUS, **settings)


def quiet(**kw):
    return {"log": lambda _m: None, "progress": False, **kw}


def train_losses(result) -> list[float]:
    return [m["loss"] for m in result.history if "loss" in m]


def test_the_kind_has_a_spec_section(losses_on, tmp_path):
    assert losses_on.kinds["loss"].section == "train.loss"
    rs = load_spec(write_spec(tmp_path, {"name": "z_loss", "weight": 1e-4}))
    assert rs.component("loss").name == "z_loss" and rs.component("loss").options.weight == 1e-4
    assert rs.components["train.loss"] is rs.component("loss")
    assert load_spec(write_spec(tmp_path / "plain")).component("loss") is None  # optional


def test_a_bad_loss_option_is_a_one_line_spec_error_with_its_path(losses_on, tmp_path, capsys):
    from llmkit.cli import main

    spec = write_spec(tmp_path, {"name": "label_smoothing", "smoothing": 1.5})
    with pytest.raises(SpecError) as info:
        train(spec, run_dir=tmp_path / "run", **quiet())
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("train.loss.smoothing:")
    assert not (tmp_path / "run").exists()
    assert main(["train", str(spec), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.loss.smoothing" in err, err


def test_label_smoothing_trains_a_different_curve_than_cross_entropy(losses_on, tmp_path):
    runs, vals = {}, {}
    for name, loss in {
        "default": None,
        "cross_entropy": {"name": "cross_entropy"},
        "label_smoothing": {"name": "label_smoothing", "smoothing": 0.1},
    }.items():
        result = train(
            write_spec(tmp_path / name, loss), run_dir=tmp_path / name / "run", **quiet()
        )
        runs[name] = train_losses(result)
        (vals[name],) = [m for m in result.history if m.get("step") == 6 and "val_ppl" in m]
    # The loss component cross_entropy is the model's own objective, by another path.
    assert runs["cross_entropy"] == pytest.approx(runs["default"], abs=1e-4)
    # Label smoothing on the same seed and batches: from the same initial weights (where a
    # near-uniform softmax makes both objectives almost equal) the curves part, and the gap
    # grows as the model grows confident.
    smooth, plain = runs["label_smoothing"], runs["default"]
    assert len(smooth) == len(plain) == 6
    gaps = [s - p for s, p in zip(smooth, plain, strict=True)]
    assert abs(gaps[0]) > 1e-4 and all(g > 5e-3 for g in gaps[1:]) and gaps[-1] > gaps[1]
    # Other updates, not only another measure: the models' validation cross-entropy differs
    # (slightly, after six steps; the cross_entropy component's run matches to the digit).
    ce_gap = vals["label_smoothing"]["val_ce"] - vals["default"]["val_loss"]
    assert abs(ce_gap) > 1e-5
    assert vals["cross_entropy"]["val_loss"] == vals["default"]["val_loss"]
    assert vals["default"]["val_ce"] == vals["default"]["val_loss"]  # the same number there
    assert vals["cross_entropy"]["val_ce"] == vals["cross_entropy"]["val_loss"]


def test_a_z_loss_run_reports_its_cross_entropy_first_and_names_its_objective(
    losses_on, tmp_path, capsys
):
    """The numbers users compare runs by are cross-entropies: the log's evaluation line
    and the done line lead with val_ce (ppl), the objective beside them, named."""
    from llmkit.cli import main
    from llmkit.experiments.trial import stop_reason

    spec = write_spec(tmp_path, {"name": "z_loss", "weight": 0.1}, max_steps=4, eval_interval=4)
    run = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(run), "--no-sample", "--no-progress"]) == 0
    out = capsys.readouterr().out
    (val,) = [m for m in read_metrics(run) if "val_loss" in m]
    assert val["val_loss"] > val["val_ce"] + 1e-3  # two numbers, told apart below
    number = r"([\d.]+)"
    (done,) = [line for line in out.splitlines() if line.startswith("done: ")]
    found = re.search(
        rf"\(max_steps\); val loss: ce {number} \(ppl {number}\), objective z_loss {number}; ",
        done,
    )
    assert found, done
    ce, ppl, objective = (float(found[i]) for i in (1, 2, 3))
    assert ce == pytest.approx(val["val_ce"], abs=1e-4)
    assert ppl == pytest.approx(math.exp(val["val_ce"]), rel=1e-3)
    assert objective == pytest.approx(val["val_loss"], abs=1e-4)
    line = rf"^step 4: val ce {number} \(ppl {number}\), objective z_loss {number} \(best\)$"
    assert re.search(line, out, re.M), out
    assert re.search(r"^step 4/4: objective z_loss [\d.]+ lr ", out, re.M), out  # not a bare "loss"
    assert stop_reason(out.splitlines()) == "max_steps"  # what sweeps read still parses


def test_validation_reports_the_objective_evaluated_like_a_training_step(losses_on, tmp_path):
    from llmkit.data import eval_batches, prepare_data

    spec = write_spec(tmp_path, {"name": "z_loss", "weight": 0.1}, max_steps=4, eval_interval=4)
    result = train(spec, run_dir=tmp_path / "run", **quiet())
    lines = read_metrics(tmp_path / "run")
    steps = [m for m in lines if "loss" in m]
    assert all({"metric/loss.cross_entropy", "metric/loss.z_loss"} <= set(m) for m in steps)
    for m in steps:  # the logged loss is the objective: cross-entropy + the z-loss term
        parts = m["metric/loss.cross_entropy"] + m["metric/loss.z_loss"]
        assert m["loss"] == pytest.approx(parts, abs=1e-5)
    (val,) = [m for m in lines if "val_loss" in m]
    assert val["val_ppl"] == pytest.approx(math.exp(val["val_ce"]), rel=1e-3)
    assert val["val_loss"] > val["val_ce"]  # the z-loss term is positive
    assert result.best_val_loss == pytest.approx(val["val_loss"], abs=1e-6)
    assert result.val_ce == pytest.approx(val["val_ce"], abs=1e-6)
    assert result.objective == "z_loss"

    # The same numbers from the final weights, evaluated by hand on the same blocks.
    rs, model = result.spec, result.model
    data = prepare_data(rs, tmp_path / "run", log=lambda _m: None)
    t = rs.spec.train
    block = rs.spec.data.block_size or rs.model.max_seq_len
    batches = list(eval_batches(data.validation, block, t.batch_size, t.eval_batches))
    objective = Objective.from_spec(rs)
    res = evaluate_batches(model, batches, torch.device("cpu"), objective=objective)
    assert res.loss == pytest.approx(val["val_loss"], abs=1e-5)
    assert res.cross_entropy == pytest.approx(val["val_ce"], abs=1e-5)
    model.eval()
    with torch.no_grad():
        total = count = 0.0
        for x, y in batches:
            logits = model(x).logits
            ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            log_z = torch.logsumexp(logits.float(), -1)
            n = y.numel()
            total += float(ce + 0.1 * log_z.square().mean()) * n
            count += n
    assert total / count == pytest.approx(val["val_loss"], abs=1e-4)


def test_evaluation_without_an_objective_is_cross_entropy(losses_on):
    from llmkit.model import build_model
    from llmkit.spec import load_spec_dict
    from tests.helpers import tiny_spec

    torch.manual_seed(0)
    model = build_model(load_spec_dict(tiny_spec()))
    x = torch.randint(0, 64, (2, 8))
    y = torch.randint(0, 64, (2, 8))
    y[1, :3] = -100  # ignored targets are not counted
    plain = evaluate_batches(model, [(x, y)], torch.device("cpu"))
    assert plain.cross_entropy is None and plain.ce == plain.loss
    smooth = Objective.from_spec(
        load_spec_dict({**tiny_spec(), "train": {"loss": {"name": "label_smoothing"}}})
    )
    res = evaluate_batches(model, [(x, y)], torch.device("cpu"), objective=smooth)
    with torch.no_grad():
        logits = model(x).logits.view(-1, 64)
    want = F.cross_entropy(logits, y.view(-1), label_smoothing=0.1)
    assert res.loss == pytest.approx(float(want), abs=1e-5)
    assert res.cross_entropy == pytest.approx(plain.loss, abs=1e-6) and res.tokens == 13
    assert res.ppl == pytest.approx(plain.ppl)  # perplexity stays the cross-entropy's


def test_a_run_with_a_loss_component_resumes_exactly(tmp_path):
    # One component stands for all: resume restores the objective's state the same way for
    # every loss (label smoothing's own numbers are checked above, without a kill).
    loss = {"name": "z_loss", "weight": 1e-3}
    spec = write_spec(
        tmp_path,
        loss,
        max_steps=40,
        eval_interval=20,
        checkpoint_interval=10,
        batch_size=8,
    )
    full, run, killed_at = train_killed_and_resumed(spec, tmp_path, kill_at=10, plugins="losses")
    assert killed_at < 40
    assert losses(run) == losses(full) and len(losses(full)) == 40
    assert val_losses(run) == val_losses(full)
    keys = [set(m) for m in read_metrics(run) if "loss" in m]
    assert all("metric/loss.z_loss" in k for k in keys)


def test_llmkit_eval_reports_the_runs_objective_beside_cross_entropy(losses_on, tmp_path, capsys):
    import json

    from llmkit.cli import main

    spec = write_spec(tmp_path, {"name": "z_loss", "weight": 0.1}, max_steps=2, eval_interval=2)
    train(spec, run_dir=tmp_path / "run", **quiet())
    text = tmp_path / "held_out.txt"
    text.write_text(CORPUS[:400])
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--data", str(text), "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert "objective (z_loss)" in captured.err and "cross-entropy" in captured.err
    assert report["loss"] > report["cross_entropy"] > 0  # the z-loss term is positive
    assert report["ppl"] == pytest.approx(math.exp(report["cross_entropy"]), rel=1e-6)
