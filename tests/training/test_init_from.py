"""A new run started from another run's weights: fresh optimizer and schedule, the source's
tokenizer, the source untouched, exact resume, and the command line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from llmkit.cli import main
from llmkit.errors import LlmkitError
from llmkit.training import train
from tests.helpers import write_train_spec
from tests.training.kill_resume import losses, read_metrics, train_killed_and_resumed, val_losses

CORPUS = "The cat sat on the mat. The dog sat on the log. A bird sang in a tree.\n" * 120


def quiet() -> dict:
    return {"log": lambda _m: None, "progress": False}


def digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` with its content hash (and so its presence)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("source")
    spec = write_train_spec(tmp, CORPUS, max_steps=30, eval_interval=15)
    train(spec, run_dir=tmp / "run", **quiet())
    return tmp / "run"


def test_a_new_run_starts_from_the_weights_with_fresh_optimizer_and_schedule(source, tmp_path):
    before = digest(source)
    spec = write_train_spec(tmp_path / "s", CORPUS, max_steps=6, eval_interval=6)
    logs: list[str] = []
    result = train(
        spec,
        run_dir=tmp_path / "ft",
        overrides=[f"train.init_from={source}"],
        log=logs.append,
        progress=False,
    )
    assert digest(source) == before  # the source is never modified
    assert any(m.startswith("init_from: ") and str(source) in m for m in logs)
    first = read_metrics(tmp_path / "ft")[0]
    assert first["step"] == 1 and first["lr"] == pytest.approx(3e-3 / 2)  # warmup from step 0
    fresh = train(spec, run_dir=tmp_path / "fresh", **quiet())
    src_last = [m["loss"] for m in read_metrics(source) if "loss" in m][-1]
    assert abs(first["loss"] - src_last) < 0.3  # it continues from the source's level
    assert first["loss"] < read_metrics(tmp_path / "fresh")[0]["loss"] - 0.5
    assert result.val_loss < fresh.val_loss
    saved = yaml.safe_load((tmp_path / "ft" / "spec.yaml").read_text())
    assert saved["train"]["init_from"] == str(source.absolute())
    assert (tmp_path / "ft" / "tokenizer.json").read_bytes() == (
        source / "tokenizer.json"
    ).read_bytes()


def test_the_source_tokenizer_is_used_even_when_the_spec_would_train_another(source, tmp_path):
    spec = write_train_spec(tmp_path / "s", CORPUS.upper(), max_steps=2, eval_interval=2)
    data = yaml.safe_load(spec.read_text())
    data["tokenizer"] = {"kind": "bpe", "vocab_size": 300}  # the source's is char-level
    data["train"]["init_from"] = str(source)
    spec.write_text(yaml.safe_dump(data))
    result = train(spec, run_dir=tmp_path / "ft", **quiet())
    assert result.tokenizer.kind == "char"
    assert yaml.safe_load((tmp_path / "ft" / "spec.yaml").read_text())["tokenizer"]["kind"] == (
        "char"
    )


def test_a_checkpoint_is_a_source_too(source, tmp_path):
    ckpt = sorted((source / "checkpoints").glob("step-*"))[0]
    spec = write_train_spec(tmp_path / "s", CORPUS, max_steps=2, eval_interval=2)
    logs: list[str] = []
    train(
        spec,
        run_dir=tmp_path / "ft",
        overrides=[f"train.init_from={ckpt}"],
        log=logs.append,
        progress=False,
    )
    assert any(str(ckpt / "model.safetensors") in m for m in logs)


def test_a_run_started_from_weights_resumes_exactly_without_its_source(source, tmp_path):
    spec = write_train_spec(
        tmp_path / "s",
        CORPUS,
        max_steps=24,
        eval_interval=12,
        checkpoint_interval=4,
        init_from=str(source),
    )
    full, run, killed_at = train_killed_and_resumed(spec, tmp_path, kill_at=8)
    assert killed_at < 24
    assert losses(run) == losses(full) and len(losses(full)) == 24
    assert val_losses(run) == val_losses(full)


def test_resume_does_not_need_the_source(source, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    spec = write_train_spec(tmp_path / "s", CORPUS, max_steps=4, eval_interval=2)
    run = tmp_path / "ft"
    train(spec, run_dir=run, overrides=[f"train.init_from={copy}", "train.max_steps=2"], **quiet())
    shutil.rmtree(copy)
    result = train(None, run_dir=run, resume=True, overrides=["train.max_steps=4"], **quiet())
    assert result.step == 4


def test_command_line_flag_and_errors(source, tmp_path, capsys):
    spec = write_train_spec(tmp_path / "s", CORPUS, max_steps=2, eval_interval=2)
    out = tmp_path / "ft"
    args = ["train", str(spec), "--out", str(out), "--no-sample", "--no-progress"]
    assert main([*args, "--init-from", str(source)]) == 0
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
    capsys.readouterr()
    assert main([*args[:3], str(tmp_path / "x"), "--init-from", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.init_from" in err and "not found" in err
    assert not (tmp_path / "x" / "data").exists()  # refused before any data was read
    assert main(["train", "--resume", str(out), "--init-from", str(source)]) == 2
    assert "--init-from" in capsys.readouterr().err


def test_a_different_architecture_is_refused_naming_the_parameter(source, tmp_path):
    spec = write_train_spec(tmp_path / "s", CORPUS, max_steps=2, eval_interval=2)
    with pytest.raises(LlmkitError, match=r"layers\.0\.attn\.qkv\.weight is \(96, 32\) in the"):
        train(
            spec,
            run_dir=tmp_path / "ft",
            overrides=[f"train.init_from={source}", "model.n_heads=4", "model.n_kv_heads=1"],
            **quiet(),
        )
