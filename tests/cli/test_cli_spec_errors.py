"""Hostile or mistaken specs on the command line: ``validate`` and ``train`` refuse them in
one line naming the path, exit 2, before any data is read; ``--max-steps`` shorter than the
warmup scales it; ``eval``/``generate`` say what the tokenizer could not read."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from llmkit.cli import main
from llmkit.errors import LlmkitError

SPEC = """
[model]
vocab_size = 64
d_model = 32
n_layers = 2
n_heads = 4
max_seq_len = 32

[tokenizer]
kind = "char"

[data]
source = {{ name = "text", paths = ["{corpus}"] }}

[schedule]
name = "cosine"
warmup_steps = 40

[train]
max_steps = 100
device = "cpu"
"""


@pytest.fixture
def spec_file(tmp_path):
    """A spec whose corpus does not exist: an error about the spec proves no data was read."""
    path = tmp_path / "spec.toml"
    path.write_text(SPEC.format(corpus=tmp_path / "missing.txt"))
    return path


HOSTILE = [
    ("model.overrides=[{layers=1.5}]", "model.overrides[0].layers: expected a list of"),
    ("model.n_layers=1000000000", "model.n_layers: Input should be less than or equal to 1024"),
    (f"model.d_model={2**70}", "model.d_model: Input should be less than or equal to 65536"),
    (f"model.vocab_size={2**40}", "model.vocab_size: Input should be less than or equal to"),
    ('train.device="meta"', "train.device: 'meta' is not a device training can use"),
    ("optimizer.lr=inf", "optimizer.lr: Input should be a finite number"),
    ("train.max_steps=20", "schedule.warmup_steps: 40 exceeds train.max_steps (20)"),
    ('tokenizer.kind="bpe"', "model.vocab_size: 64 is too small for byte-level BPE"),
    ('model.adapter={name="lora"}', "model.adapter: adapters need train.init_from"),
]


@pytest.mark.parametrize(("assignment", "expected"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_validate_refuses_in_one_line(capsys, spec_file, assignment, expected):
    assert main(["validate", str(spec_file), "--set", assignment]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(spec_file) in err and expected in err, err


@pytest.mark.parametrize(("assignment", "expected"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_train_refuses_before_reading_data(capsys, tmp_path, spec_file, assignment, expected):
    out = tmp_path / "run"
    assert main(["train", str(spec_file), "--out", str(out), "--set", assignment]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert str(spec_file) in err and expected in err and "missing.txt" not in err
    assert not out.exists()


def test_validate_refuses_a_yaml_alias_bomb_and_duplicate_keys(capsys, tmp_path):
    bomb = tmp_path / "bomb.yaml"
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    bomb.write_text("\n".join(lines))
    dup = tmp_path / "dup.yaml"
    dup.write_text("model:\n  d_model: 32\n  d_model: 64\n")
    for path, expected in ((bomb, "aliases expand to more than"), (dup, "duplicate key")):
        assert main(["validate", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err


def test_max_steps_below_the_warmup_scales_it_with_a_note(monkeypatch, caplog, spec_file):
    """Only ``--max-steps`` caps the warmup (in the run plan, the spec read once); the
    resulting spec is valid."""
    import llmkit.training
    from llmkit.training.plan import log_notes, plan_run

    seen: dict[str, Any] = {}

    def fake_train(spec: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        log_notes(plan_run(spec, **{k: kwargs[k] for k in ("overrides", "max_steps")}))
        return SimpleNamespace(rank=1)  # another rank: nothing is printed

    monkeypatch.setattr(llmkit.training, "train", fake_train)
    with caplog.at_level(logging.INFO, logger="llmkit"):
        assert main(["train", str(spec_file), "--max-steps", "10", "--no-sample"]) == 0
    assert seen["overrides"] == [] and seen["max_steps"] == 10
    assert (
        "--max-steps 10 is shorter than schedule.warmup_steps (40): warmup scaled to 4 steps "
        "(the spec warms up for 40 of 100 steps)"
    ) in caplog.messages


# -- eval and generate ---------------------------------------------------------------------


def test_eval_data_that_is_a_directory_says_so(tmp_path):
    from llmkit.evaluation.perplexity import file_text

    with pytest.raises(LlmkitError) as err:
        file_text(SimpleNamespace(), tmp_path)
    assert str(err.value) == f"--data: {tmp_path} is a directory; expected a text file"


@pytest.fixture
def char_tokenizer():
    from llmkit.data.tokenizer import train_char

    return train_char(["hello world"])


def test_eval_says_how_many_characters_were_unknown(tmp_path, caplog, char_tokenizer):
    from llmkit.evaluation.perplexity import file_text

    text = tmp_path / "text.txt"
    text.write_text("héllo wörld ZZ")
    with caplog.at_level(logging.INFO, logger="llmkit"):
        got = file_text(SimpleNamespace(tokenizer=char_tokenizer), text)
    assert got.tokens.numel() == 14 and got.is_text
    assert caplog.messages == [
        f"--data: 4 characters of {text} are not in the tokenizer's vocabulary and became <unk>"
    ]


def test_generate_says_how_many_characters_of_a_prompt_were_unknown(caplog, char_tokenizer):
    from llmkit.cli.generate import note_unknown

    with caplog.at_level(logging.INFO, logger="llmkit"):
        note_unknown(char_tokenizer, "hello", "the prompt")
        note_unknown(char_tokenizer, "hé!", "the prompt")
    assert caplog.messages == [
        "2 characters of the prompt are not in the tokenizer's vocabulary and became <unk>"
    ]
