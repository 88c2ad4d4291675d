"""Branching a run at a checkpoint (llmkit.runs.branch): a WSD run's cooldown branch equals
a standalone shorter run, the source is never modified, and bad requests are refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from llmkit.errors import LlmkitError, SpecError
from llmkit.runs.branch import BRANCH_FILE, branch_run
from llmkit.runs.checkpoints import Checkpoints, read_weights
from llmkit.spec import load_spec
from llmkit.training import train
from tests.helpers import write_train_spec

CORPUS = "the quick brown fox jumps over the lazy dog. " * 120
WSD = {"name": "wsd", "warmup_steps": 2, "decay_fraction": 0.25}


def wsd_spec(tmp_path: Path, **train_fields) -> Path:
    spec = write_train_spec(tmp_path, CORPUS, eval_interval=4, **train_fields)
    data = yaml.safe_load(spec.read_text())
    data["schedule"] = dict(WSD)
    spec.write_text(yaml.safe_dump(data))
    return spec


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def digests(run: Path) -> dict[str, str]:
    return {
        p.relative_to(run).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def quiet(_line: str) -> None:
    pass


@pytest.fixture(scope="module")
def long_run(tmp_path_factory) -> Path:
    """A 12-step WSD run with kept checkpoints at step 6, the stable phase's end of an
    8-step run (8 − max(1, round(0.25 · 8))), and at step 9 (its own)."""
    tmp = tmp_path_factory.mktemp("long")
    spec = wsd_spec(tmp, max_steps=12, checkpoint_steps=[6, 9])
    train(spec, run_dir=tmp / "run", log=quiet, progress=False)
    return tmp / "run"


def test_checkpoint_steps_are_saved_and_never_pruned(long_run):
    steps = [int(p.name[5:]) for p in Checkpoints(long_run).steps()]
    assert steps == [6, 8, 9, 12]  # 6 and 9 kept besides the last two (8 and 12)
    assert 4 not in steps  # the others are pruned as before


def test_checkpoint_steps_past_max_steps_are_refused(tmp_path):
    spec = wsd_spec(tmp_path, max_steps=12, checkpoint_steps=[13])
    with pytest.raises(SpecError, match=r"checkpoint_steps: 13 exceeds train\.max_steps"):
        load_spec(spec)
    with pytest.raises(SpecError, match="checkpoint_steps"):
        load_spec(spec, ["train.checkpoint_steps=[0]"])


def test_a_cooldown_branch_equals_a_standalone_shorter_run(long_run, tmp_path):
    before = digests(long_run)
    branch = branch_run(long_run, 6, tmp_path / "branch")
    assert json.loads((branch / BRANCH_FILE).read_text()) == {
        "source": str(long_run.absolute()),
        "step": 6,
    }
    assert max(r["step"] for r in records(branch)) == 6
    assert yaml.safe_load((branch / "spec.yaml").read_text())["train"]["checkpoint_steps"] == [
        6
    ]  # not 9
    lines: list[str] = []
    result = train(
        None,
        run_dir=branch,
        resume=True,
        overrides=["train.max_steps=8"],
        log=lines.append,
        progress=False,
    )
    assert result.step == 8
    assert any("resumed from" in line and "step-000006" in line for line in lines)

    spec = wsd_spec(tmp_path / "alone", max_steps=8)
    alone = train(spec, run_dir=tmp_path / "alone" / "run", log=quiet, progress=False)
    assert result.val_loss == alone.val_loss
    assert result.tokens == alone.tokens

    def strip(rs: list[dict]) -> list[dict]:  # timings differ, numbers must not
        drop = {"tokens_per_s", "elapsed", "mfu"}
        return [{k: v for k, v in r.items() if k not in drop} for r in rs]

    assert strip(records(branch)) == strip(records(tmp_path / "alone" / "run"))
    mine = read_weights(branch / "model.safetensors")
    theirs = read_weights(tmp_path / "alone" / "run" / "model.safetensors")
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert mine[key].equal(theirs[key]), key
    assert digests(long_run) == before  # the source is untouched (its data hard-linked)


def test_branch_refuses_a_missing_step_or_an_existing_destination(long_run, tmp_path):
    before = digests(long_run)
    with pytest.raises(LlmkitError, match=r"no checkpoint at step 5 .*it has: 6, 8, 9, 12"):
        branch_run(long_run, 5, tmp_path / "b")
    assert not (tmp_path / "b").exists()
    (tmp_path / "b").mkdir()
    with pytest.raises(LlmkitError, match="exists"):
        branch_run(long_run, 6, tmp_path / "b")
    with pytest.raises(LlmkitError, match="not a run directory"):
        branch_run(tmp_path / "b", 6, tmp_path / "c")
    assert list(tmp_path.iterdir()) == [tmp_path / "b"]  # no temporary left behind
    assert digests(long_run) == before
