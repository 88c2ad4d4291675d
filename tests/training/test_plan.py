"""The run plan: the spec read and resolved once, every edit a run makes to it settled in one
place before data is read, and saved once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import llmkit.training.plan as plan_mod
from llmkit.errors import LlmkitError
from llmkit.runs import SPEC_FILE
from llmkit.training import train
from llmkit.training.plan import RunPlan, plan_run
from tests.helpers import write_train_spec

CORPUS = "The cat sat on the mat. The dog sat on the log.\n" * 60


def quiet() -> dict:
    return {"log": lambda _m: None, "progress": False}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("source")
    spec = write_train_spec(tmp, CORPUS, max_steps=4, eval_interval=4)
    train(spec, run_dir=tmp / "run", **quiet())
    return tmp / "run"


def test_the_spec_is_read_and_resolved_once(monkeypatch, tmp_path):
    spec = write_train_spec(tmp_path, CORPUS, max_steps=20)
    calls = {"load_raw": 0, "resolve": 0}
    for name in calls:
        real = getattr(plan_mod, name)

        def counting(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(plan_mod, name, counting)
    plan = plan_run(spec, run_dir=tmp_path / "run", overrides=["train.seed=3"], max_steps=1)
    assert calls == {"load_raw": 1, "resolve": 1}
    t = plan.rs.spec.train
    assert (t.max_steps, t.seed) == (1, 3)
    assert plan.rs.schedule.options.warmup_steps == 1  # 2 of 20 steps, scaled to fit 1
    assert plan.notes and "warmup scaled to 1 step" in plan.notes[0]
    assert not (tmp_path / "run").exists()  # planning writes nothing


def test_a_warmup_that_fits_is_left_alone(tmp_path):
    plan = plan_run(write_train_spec(tmp_path, CORPUS), run_dir=tmp_path / "r", max_steps=10)
    assert plan.rs.schedule.options.warmup_steps == 2 and plan.notes == []


def test_init_from_settles_the_weights_tokenizer_and_vocabulary(source, tmp_path):
    spec = write_train_spec(tmp_path, CORPUS)
    rel = Path("..") / source.relative_to(source.parent.parent)
    plan = plan_run(
        spec,
        run_dir=tmp_path / "run",
        overrides=[f"train.init_from={tmp_path / rel}", 'tokenizer.kind="bpe"'],
    )
    assert plan.init is not None and plan.init.weights.parent.resolve() == source.resolve()
    assert Path(plan.rs.spec.train.init_from).is_absolute()  # the spec names it absolutely
    assert plan.tokenizer_source.resolve() == (source / "tokenizer.json").resolve()
    assert plan.rs.spec.tokenizer.kind == "char"  # the adopted tokenizer's kind
    from llmkit.data.tokenizer import Tokenizer

    tok = Tokenizer.load(source / "tokenizer.json")
    line = plan.settle_vocabulary(tok)
    assert plan.rs.model.vocab_size == tok.vocab_size
    assert (line is None) == (tok.vocab_size == 64)


def test_the_trainer_saves_the_settled_spec_once(monkeypatch, tmp_path):
    saves: list[int] = []
    real = RunPlan.save

    def counting(self):
        saves.append(self.rs.model.vocab_size)
        real(self)

    monkeypatch.setattr(RunPlan, "save", counting)
    result = train(
        write_train_spec(tmp_path, CORPUS, max_steps=2), run_dir=tmp_path / "r", **quiet()
    )
    saved = yaml.safe_load((tmp_path / "r" / SPEC_FILE).read_text())
    assert saves == [saved["model"]["vocab_size"]] == [result.model.config.vocab_size]


def test_resume_plans_from_the_run_and_refuses_another_optimizer(source, tmp_path):
    plan = plan_run(run_dir=source, resume=True, max_steps=8)
    assert plan.resume and plan.edited and plan.rs.spec.train.max_steps == 8
    assert plan.run_dir == source and plan.init is None and plan.tokenizer_source is None
    with pytest.raises(LlmkitError, match="trained with optimizer 'adamw'"):
        plan_run(run_dir=source, resume=True, overrides=['optimizer={name="sgd", lr=0.1}'])
    assert not plan_run(run_dir=source, resume=True).edited
    with pytest.raises(LlmkitError, match="a checkpoint; resume its run"):
        plan_run(run_dir=source / "checkpoints" / "step-000004", resume=True)


def test_a_new_run_refuses_a_used_directory_before_reading_data(source, tmp_path):
    with pytest.raises(LlmkitError, match="already holds a run"):
        plan_run(write_train_spec(tmp_path, CORPUS), run_dir=source)
