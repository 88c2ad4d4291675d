"""Opening a run directory: one loader (``open_run``/``load_run``) for a run or a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from llmkit.data.tokenizer import train_char
from llmkit.errors import LlmkitError
from llmkit.model import build_model
from llmkit.runs import SPEC_FILE, TOKENIZER_FILE, find_weights, load_run, open_run, save_spec
from llmkit.runs.checkpoints import WEIGHTS, Checkpoints, save_weights
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run made by hand: spec, tokenizer, final weights and one checkpoint (step 2)."""
    path = tmp_path / "run"
    path.mkdir()
    tok = train_char(["hello world\n"])
    spec = tiny_spec(vocab_size=tok.vocab_size)
    spec["tokenizer"] = {"kind": "char", "special_tokens": ["<|endoftext|>"]}
    rs = load_spec_dict(spec)
    save_spec(rs, path)
    tok.save(path / TOKENIZER_FILE)
    torch.manual_seed(0)
    save_weights(build_model(rs), path / WEIGHTS)
    torch.manual_seed(1)
    Checkpoints(path).save(2, build_model(rs), {"step": 2}, {"val_loss": 1.0}, best=True)
    return path


def test_a_run_opens_from_its_directory_or_a_checkpoint(run_dir):
    run = open_run(run_dir)
    assert run.dir == run_dir and run.checkpoint is None
    assert run.raw == yaml.safe_load((run_dir / SPEC_FILE).read_text())
    assert run.weights() == run_dir / WEIGHTS
    ckpt = run_dir / "checkpoints" / "step-000002"
    assert run.weights("latest") == run.weights("best") == ckpt / WEIGHTS
    inside = open_run(ckpt)
    assert inside.dir == run_dir and inside.checkpoint == ckpt
    assert inside.weights("final") == ckpt / WEIGHTS  # the checkpoint it was opened at
    assert find_weights(ckpt) == (run_dir, ckpt / WEIGHTS)


def test_resolve_applies_overrides_and_names_the_spec_file(run_dir):
    rs = open_run(run_dir).resolve(["optimizer.lr=0.5"])
    assert rs.optimizer.options.lr == 0.5 and rs.source == str(run_dir / SPEC_FILE)


def test_load_run_gives_model_tokenizer_and_weights(run_dir):
    run = load_run(run_dir)
    assert not run.model.training and run.weights == run_dir / WEIGHTS
    assert run.tokenizer.eos_id is not None
    latest = load_run(run_dir, which="latest")
    assert latest.weights.parent.name == "step-000002"
    a, b = run.model.state_dict(), latest.model.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)  # two different sets of weights


def test_what_is_not_a_run_is_one_line(tmp_path, run_dir):
    with pytest.raises(LlmkitError, match="run not found"):
        open_run(tmp_path / "nope")
    with pytest.raises(LlmkitError, match=r"not a run directory or checkpoint \(no spec.yaml\)"):
        open_run(tmp_path)
    (run_dir / WEIGHTS).unlink()
    for p in (run_dir / "checkpoints").iterdir():
        if p.is_dir():
            for f in p.iterdir():
                f.unlink()
            p.rmdir()
    with pytest.raises(LlmkitError, match="the run has no weights yet"):
        open_run(run_dir).weights()
