"""Fixtures of the generation tests: one thread, a character tokenizer, a tiny random model
and a run directory with random weights."""

from __future__ import annotations

import pytest
import torch

from llmkit.data.tokenizer import train_char
from llmkit.model import build_model
from llmkit.runs import TOKENIZER_FILE, save_spec
from llmkit.runs.checkpoints import WEIGHTS, save_weights
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

CORPUS = "the quick brown fox jumps over the lazy dog.\n" * 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs on one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def char_tok():
    return train_char([CORPUS])


@pytest.fixture(scope="module")
def lm(char_tok):
    """A random tiny model over a character vocabulary (rope, so batches may be padded)."""
    torch.manual_seed(0)
    spec = tiny_spec(
        vocab_size=char_tok.vocab_size, position={"name": "rope"}, max_seq_len=64, init_std=0.2
    )
    return build_model(load_spec_dict(spec)).eval()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, char_tok):
    """A run directory with random weights (no training needed to test the commands)."""
    path = tmp_path_factory.mktemp("run")
    spec = tiny_spec(vocab_size=char_tok.vocab_size, position={"name": "rope"}, max_seq_len=64)
    spec["tokenizer"] = {"kind": "char"}
    rs = load_spec_dict(spec)
    torch.manual_seed(0)
    save_spec(rs, path)
    save_weights(build_model(rs), path / WEIGHTS)
    char_tok.save(path / TOKENIZER_FILE)
    return path
