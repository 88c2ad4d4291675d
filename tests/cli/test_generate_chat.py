"""``llmkit generate --chat`` on a tiny chat run trained here: the user turn is formatted with
the run's template, the reply stops at the end-of-turn token, a conversation keeps its
history; a run without a chat template is refused in one line."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import yaml

from llmkit import cli
from llmkit.data.tokenizer import CONFIG_FILE
from llmkit.inference import Generator
from llmkit.runs import load_run
from llmkit.training import train

END = "<|im_end|>"


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny tensors: one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    """A tiny model that learned to answer "hi" with "ok" and "bye" with "ciao" (chatml,
    padded rows, masked prompts)."""
    tmp = tmp_path_factory.mktemp("chat")
    pairs = [("hi", "ok"), ("bye", "ciao")] * 10
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs))
    spec = {
        "name": "chat-unit",
        "model": {
            "vocab_size": 64,
            "d_model": 32,
            "n_layers": 1,
            "n_heads": 2,
            "max_seq_len": 48,
            "position": {"name": "rope"},
        },
        "tokenizer": {"kind": "char"},
        "data": {
            "source": {
                "name": "chat",
                "paths": [str(data)],
                "template": "chatml",
                "val_fraction": 0.25,
            },
            "sampling": "padded",
            "block_size": 40,
        },
        "optimizer": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.0},
        "schedule": {"name": "constant"},
        "train": {
            "batch_size": 8,
            "max_steps": 40,
            "eval_interval": 40,
            "eval_batches": 1,
            "log_interval": 40,
            "precision": "fp32",
            "sample_tokens": 0,
        },
    }
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = train(path, run_dir=tmp / "run", log=lambda _m: None, progress=False)
    assert result.val_loss is not None and result.val_loss < 0.5  # masked eval ran
    return tmp / "run"


def test_the_run_carries_its_template(chat_run: Path) -> None:
    config = json.loads((chat_run / CONFIG_FILE).read_text())
    assert config["eos_token"] == END and "<|im_start|>" in config["chat_template"]
    tok = load_run(chat_run).tokenizer
    assert tok.chat_template == config["chat_template"]
    assert tok.token_to_id(END) in tok.stop_ids


def test_chat_replies_and_stops_at_the_end_of_turn(chat_run: Path, capsys) -> None:
    argv = ["generate", str(chat_run), "--chat", "hi", "--temperature", "0"]
    assert cli.main([*argv, "--json", "--max-new-tokens", "20"]) == 0
    out = json.loads(capsys.readouterr().out)
    tok = load_run(chat_run).tokenizer
    assert out["reply"] == "ok" and out["finish_reason"] == "eos"
    assert out["ids"][-1] == tok.token_to_id(END)
    assert out["messages"] == [{"role": "user", "content": "hi"}]
    # the same as formatting the turn by hand with the template and generating from it
    gen = Generator(str(chat_run))
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt[-11:] == [tok.token_to_id("<|im_start|>"), *tok.encode("assistant\n")]
    same = gen.generate([prompt], temperature=0, max_new_tokens=20, eos_id=tok.stop_ids)[0]
    assert same.ids == out["ids"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == "ok\n"
    assert cli.main([*argv, "--stream"]) == 0
    assert capsys.readouterr().out == "ok\n"


def test_chat_conversation_from_stdin(chat_run: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n\nbye\nexit\nhi\n"))
    argv = ["generate", str(chat_run), "--chat", "--temperature", "0", "--system", "s"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.splitlines() == ["ok", "ciao"]


def test_chat_conversation_as_json_lines(chat_run: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nbye\n"))
    argv = ["generate", str(chat_run), "--chat", "--temperature", "0", "--json"]
    assert cli.main(argv) == 0
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(t["message"], t["reply"]) for t in turns] == [("hi", "ok"), ("bye", "ciao")]


def test_chat_needs_a_template_and_fits_the_other_flags(chat_run: Path, capsys, tmp_path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(chat_run, plain, ignore=shutil.ignore_patterns("checkpoints", "data"))
    (plain / CONFIG_FILE).unlink()
    assert cli.main(["generate", str(plain), "--chat", "hi"]) == 2
    err = capsys.readouterr().err
    assert "the run has no chat template" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["generate", str(chat_run), "--chat", "hi", "--prompt", "x"]) == 2
    assert "--chat" in capsys.readouterr().err
    assert cli.main(["generate", str(chat_run), "--system", "x"]) == 2
    assert "--system goes with --chat" in capsys.readouterr().err
