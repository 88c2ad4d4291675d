"""Fixtures of the serving tests: one thread, a character tokenizer, a tiny random model, a
run directory with random weights and a tiny trained chat run (helpers:
tests/serving/serve_helpers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from llmkit.data.tokenizer import train_char
from llmkit.model import build_model
from llmkit.runs import TOKENIZER_FILE, save_spec
from llmkit.runs.checkpoints import WEIGHTS, save_weights
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec
from tests.serving.serve_helpers import CORPUS, random_lm


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs on one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def char_tok():
    return train_char([CORPUS])


@pytest.fixture(scope="module")
def lm(char_tok):
    """A random tiny model with a context of 64 tokens."""
    return random_lm(char_tok)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, char_tok) -> Path:
    """A run directory with random weights (no training needed to serve it)."""
    path = tmp_path_factory.mktemp("run")
    spec = tiny_spec(vocab_size=char_tok.vocab_size, position={"name": "rope"}, max_seq_len=64)
    spec["tokenizer"] = {"kind": "char"}
    rs = load_spec_dict(spec)
    torch.manual_seed(0)
    save_spec(rs, path)
    save_weights(build_model(rs), path / WEIGHTS)
    char_tok.save(path / TOKENIZER_FILE)
    return path


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    """A tiny model that learned to answer "hi" with "ok" and "bye" with "ciao" (chatml;
    the spec of tests/cli/test_generate_chat.py)."""
    from llmkit.training import train

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
    assert result.val_loss is not None and result.val_loss < 0.5
    return tmp / "run"
