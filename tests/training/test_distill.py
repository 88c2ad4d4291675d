"""Knowledge distillation: the loss as defined, a frozen teacher whose activations are not
kept, both parts logged, a shared tokenizer, exact resume, and clear errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from llmkit.cli import main
from llmkit.errors import LlmkitError
from llmkit.model import build_model
from llmkit.model.objective import Objective
from llmkit.spec import load_spec_dict
from llmkit.training import train
from llmkit.training.distill import Distillation, distillation_kl
from tests.helpers import tiny_spec, write_train_spec
from tests.training.kill_resume import losses, read_metrics, train_killed_and_resumed, val_losses

CORPUS = "Some text to learn: a cat, a hat, a bat and a mat sat in a flat.\n" * 120


def quiet() -> dict:
    return {"log": lambda _m: None, "progress": False}


def models(seed_student=0, seed_teacher=1):
    rs = load_spec_dict(tiny_spec())
    torch.manual_seed(seed_student)
    student = build_model(rs)
    torch.manual_seed(seed_teacher)
    teacher = build_model(load_spec_dict(tiny_spec(n_layers=3)))
    return student, teacher


def test_kl_matches_its_definition_and_skips_ignored_targets():
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    y = torch.randint(0, 11, (2, 5))
    y[0, :2] = -100
    T = 2.5
    want = []
    for b in range(2):
        for i in range(5):
            if y[b, i] == -100:
                continue
            p = F.softmax(t[b, i] / T, -1)
            q = F.softmax(s[b, i] / T, -1)
            want.append(float((p * (p.log() - q.log())).sum()))
    got = float(distillation_kl(s, t, y, T))
    assert got == pytest.approx(sum(want) / len(want), rel=1e-5)
    assert float(distillation_kl(t, t, y, T)) == pytest.approx(0.0, abs=1e-6)


def test_the_loss_mixes_the_parts_and_only_the_student_learns():
    student, teacher = models()
    x = torch.randint(0, 64, (2, 16))
    y = torch.randint(0, 64, (2, 16))
    obj = Distillation(Objective(), teacher, temperature=2.0, alpha=0.3)
    out = obj(student, x, y)
    ce = student(x, y).loss
    kl = distillation_kl(student(x).logits, teacher(x).logits, y, 2.0)
    assert float(out.loss.detach()) == pytest.approx((0.3 * 4 * kl + 0.7 * ce).item(), rel=1e-5)
    assert float(out.metrics["distill.kl"]) == pytest.approx(kl.item(), rel=1e-5)
    assert float(out.metrics["distill.hard"]) == pytest.approx(ce.item(), rel=1e-5)
    assert out.cross_entropy.item() == pytest.approx(ce.item(), rel=1e-5)
    out.total.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(not p.requires_grad for p in teacher.parameters()) and not teacher.training
    assert student.lm_head.weight.grad is not None
    # alpha 0 is the hard objective exactly; its gradient does not depend on the teacher.
    hard = Distillation(Objective(), teacher, temperature=2.0, alpha=0.0)(student, x, y)
    assert hard.loss.item() == pytest.approx(ce.item(), rel=1e-6)


def test_no_teacher_activation_is_kept_for_backward():
    student, teacher = models()
    seen: list[bool] = []
    teacher.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.requires_grad))
    x = torch.randint(0, 64, (2, 16))
    Distillation(Objective(), teacher, temperature=2.5, alpha=0.5)(student, x, x)
    assert seen == [False]


def test_padding_rows_on_either_side_are_left_out_of_the_kl():
    # A padded vocabulary (an imported checkpoint's) on one side: the KL is over the ids
    # both predict, whichever side has more rows.
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    y = torch.randint(0, 11, (2, 5))
    want = distillation_kl(s, t, y, 2.0)
    padded = torch.cat([s, torch.randn(2, 5, 3)], -1)
    assert float(distillation_kl(padded, t, y, 2.0)) == pytest.approx(float(want), rel=1e-6)
    padded = torch.cat([t, torch.randn(2, 5, 3)], -1)
    assert float(distillation_kl(s, padded, y, 2.0)) == pytest.approx(float(want), rel=1e-6)


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("teacher")
    spec = write_train_spec(tmp, CORPUS, max_steps=40, eval_interval=20)
    data = yaml.safe_load(spec.read_text())
    data["model"]["n_layers"] = 3
    spec.write_text(yaml.safe_dump(data))
    train(spec, run_dir=tmp / "run", **quiet())
    return tmp / "run"


def test_a_distilled_run_logs_both_parts_and_takes_the_teachers_tokenizer(teacher_run, tmp_path):
    spec = write_train_spec(tmp_path / "s", CORPUS, max_steps=4, eval_interval=4)
    data = yaml.safe_load(spec.read_text())
    data["tokenizer"] = {"kind": "bpe", "vocab_size": 300}  # the teacher's is char-level
    spec.write_text(yaml.safe_dump(data))
    result = train(
        spec,
        run_dir=tmp_path / "run",
        overrides=[f"train.distill.teacher={teacher_run}"],
        **quiet(),
    )
    assert result.tokenizer.kind == "char"
    records = read_metrics(tmp_path / "run")
    steps = [m for m in records if "loss" in m]
    assert all("metric/distill.kl" in m and "metric/distill.hard" in m for m in steps)
    val = [m for m in records if "val_loss" in m][-1]
    assert "val_ce" in val and math.isfinite(val["val_ce"])
    saved = yaml.safe_load((tmp_path / "run" / "spec.yaml").read_text())
    assert saved["train"]["distill"]["teacher"] == str(teacher_run.absolute())
    assert saved["train"]["distill"]["temperature"] == 2.5


def test_a_distilled_run_is_reported_and_compared_by_its_cross_entropy(
    teacher_run, tmp_path, capsys
):
    """The mixed objective (α·T²·KL + (1−α)·CE) is no cross-entropy: the done line, the
    evaluation line and ``llmkit compare`` lead with val_ce and label the objective, and
    compare ranks a distilled student against one trained alone by cross-entropy."""
    import json
    import re

    from llmkit.experiments.trial import stop_reason

    spec = write_train_spec(tmp_path / "s", CORPUS, max_steps=4, eval_interval=4)
    alone, distilled = tmp_path / "alone", tmp_path / "distilled"
    common = ["--no-sample", "--no-progress"]
    tokenizer = f"tokenizer.path={teacher_run / 'tokenizer.json'}"
    assert main(["train", str(spec), "--out", str(alone), "--set", tokenizer, *common]) == 0
    capsys.readouterr()
    teacher = f"train.distill.teacher={teacher_run}"
    assert main(["train", str(spec), "--out", str(distilled), "--set", teacher, *common]) == 0
    out = capsys.readouterr().out
    (val,) = [m for m in read_metrics(distilled) if "val_loss" in m]
    assert abs(val["val_loss"] - val["val_ce"]) > 1e-3  # the objective is another number
    number = r"([\d.]+)"
    (done,) = [line for line in out.splitlines() if line.startswith("done: ")]
    pattern = (
        rf"\(max_steps\); val loss: ce {number} \(ppl {number}\), objective distill {number}; "
    )
    found = re.search(pattern, done)
    assert found, done
    assert float(found[1]) == pytest.approx(val["val_ce"], abs=1e-4)
    assert float(found[2]) == pytest.approx(val["val_ppl"], abs=0.01)
    assert float(found[3]) == pytest.approx(val["val_loss"], abs=1e-4)
    line = rf"^step 4: val ce {number} \(ppl {number}\), objective distill {number} \(best\)$"
    assert re.search(line, out, re.M), out
    assert stop_reason(out.splitlines()) == "max_steps"

    assert main(["compare", str(alone), str(distilled), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    table = report["metrics"]
    assert list(table)[:3] == ["val_ce", "val_ppl", "best_val_ce"]
    (alone_val,) = [m for m in read_metrics(alone) if "val_loss" in m]
    assert table["val_ce"] == [alone_val["val_ce"], val["val_ce"]]
    assert table["val_loss"] == [alone_val["val_loss"], val["val_loss"]]  # the objectives
    assert table["objective"] == ["cross_entropy", "distill"]
    best = "alone" if alone_val["val_ce"] < val["val_ce"] else "distilled"
    assert report["best"] == {"metric": "val_ce", "run": best}
    assert main(["compare", str(alone), str(distilled)]) == 0
    text = capsys.readouterr().out
    rows = [ln.split()[0] for ln in text.splitlines() if ln.strip().startswith(("val", "best"))]
    assert rows[:3] == ["val_ce", "val_ppl", "best_val_ce"], text
    assert "val_loss (objective)" in text and "distill" in text
    assert f"best by val_ce (cross-entropy): {best} (" in text


def test_teacher_and_student_must_share_a_tokenizer(teacher_run, tmp_path):
    other = write_train_spec(tmp_path / "o", CORPUS.upper(), max_steps=2, eval_interval=2)
    train(other, run_dir=tmp_path / "other", **quiet())
    spec = write_train_spec(tmp_path / "s", CORPUS, max_steps=2, eval_interval=2)
    with pytest.raises(LlmkitError, match="uses another tokenizer") as info:
        train(
            spec,
            run_dir=tmp_path / "run",
            overrides=[
                f"train.distill.teacher={teacher_run}",
                f"tokenizer.path={tmp_path / 'other' / 'tokenizer.json'}",
            ],
            **quiet(),
        )
    assert "\n" not in str(info.value)


def test_a_teacher_must_read_the_students_blocks(teacher_run, tmp_path):
    spec = write_train_spec(tmp_path / "s", CORPUS, max_steps=2, eval_interval=2)
    data = yaml.safe_load(spec.read_text())
    data["model"]["max_seq_len"] = 64
    data["data"] = {**data["data"], "block_size": 64}  # the teacher reads 32
    spec.write_text(yaml.safe_dump(data))
    with pytest.raises(LlmkitError, match=r"reads at most 32 tokens.*hold 64") as info:
        train(spec, run_dir=tmp_path / "run",
              overrides=[f"train.distill.teacher={teacher_run}"], **quiet())  # fmt: skip
    assert "\n" not in str(info.value)


def test_a_distilled_run_resumes_exactly(teacher_run, tmp_path):
    spec = write_train_spec(
        tmp_path / "s",
        CORPUS,
        max_steps=24,
        eval_interval=12,
        checkpoint_interval=4,
        distill={"teacher": str(teacher_run), "temperature": 2.0, "alpha": 0.7},
    )
    full, run, killed_at = train_killed_and_resumed(spec, tmp_path, kill_at=8)
    assert killed_at < 24
    assert losses(run) == losses(full) and len(losses(full)) == 24
    assert val_losses(run) == val_losses(full)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("train.distill.temperature=0", "temperature"),
        ("train.distill.temperature=inf", "temperature"),
        ("train.distill.alpha=1.5", "alpha"),
        ("train.distill.weights=middle", "weights"),
        ("train.distill.teacher=/nonexistent/run", "train.distill.teacher"),
    ],
)
def test_bad_values_are_one_line_errors(teacher_run, tmp_path, capsys, setting, message):
    spec = write_train_spec(tmp_path / "s", CORPUS, max_steps=2, eval_interval=2)
    args = ["train", str(spec), "--out", str(tmp_path / "run"), "--no-progress", "--no-sample"]
    sets = ["--set", f"train.distill.teacher={teacher_run}", "--set", setting]
    assert main([*args, *sets]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0
    assert not (tmp_path / "run" / "data").exists()  # refused before any data was read
