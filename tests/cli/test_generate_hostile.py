"""``llmkit generate`` given hostile input answers with one line (``error: …``, exit 2), never
a traceback: arguments and stdin lines that are not UTF-8, sampling flags that are NaN,
infinite or out of range, absurd beam and token counts, a run whose weights hold NaN, and a
run whose ``spec.yaml`` is an alias bomb. The runs are built here with random weights (a
char tokenizer; one with a chat template)."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from llmkit import cli
from llmkit.data.tokenizer import CONFIG_FILE, train_char
from llmkit.model import build_model
from llmkit.runs import SPEC_FILE, TOKENIZER_FILE, save_spec
from llmkit.runs.checkpoints import WEIGHTS, save_weights
from llmkit.spec import load_spec_dict
from tests.helpers import tiny_spec

CORPUS = "the quick brown fox jumps over the lazy dog.\n" * 3
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Tiny tensors: one thread (tests/conftest.py)."""


def _make_run(path: Path, poison: str | None = None) -> Path:
    """A run directory with random weights and a char tokenizer (and a chat template);
    ``poison`` names a weight that gets a NaN at [1, 2]."""
    tok = train_char([CORPUS])
    spec = tiny_spec(vocab_size=tok.vocab_size, position={"name": "rope"}, max_seq_len=64)
    spec["tokenizer"] = {"kind": "char"}
    rs = load_spec_dict(spec)
    torch.manual_seed(0)
    model = build_model(rs)
    if poison is not None:
        with torch.no_grad():
            dict(model.named_parameters())[poison][1, 2] = float("nan")
    path.mkdir(parents=True)
    save_spec(rs, path)
    save_weights(model, path / WEIGHTS)
    tok.save(path / TOKENIZER_FILE)
    (path / CONFIG_FILE).write_text(
        json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"})
    )
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return _make_run(tmp_path_factory.mktemp("hostile") / "run")


def one_line_error(capsys, code: int) -> str:
    """The error line, after checking it is the only line on stderr and the exit status."""
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if not line.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0].removeprefix("error: ")


def not_utf8(raw: bytes) -> str:
    """``raw`` as Python gives it in ``sys.argv`` (bytes that are not UTF-8 escaped as lone
    surrogates)."""
    return os.fsdecode(raw)


def test_the_run_works(run, capsys):
    argv = ["generate", str(run), "--prompt", "the", "--max-new-tokens", "3", "--temperature", "0"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.startswith("the")
    assert cli.main(["generate", str(run), "--chat", "hi", "--max-new-tokens", "2"]) == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--prompt", not_utf8(b"the \xff")],
            "--prompt: not valid UTF-8 (byte 0xff at character 4)",
        ),
        (
            ["--prompt", "the", "--prompt", not_utf8(b"\xfe\xfe")],
            "--prompt 2: not valid UTF-8 (byte 0xfe at character 0)",
        ),
        (["--chat", not_utf8(b"hi \xc3(")], "--chat: not valid UTF-8 (byte 0xc3 at character 3)"),
        (
            ["--chat", "hi", "--system", not_utf8(b"\x80")],
            "--system: not valid UTF-8 (byte 0x80 at character 0)",
        ),
        (["--stop", not_utf8(b"\xff")], "--stop: not valid UTF-8 (byte 0xff at character 0)"),
    ],
)
def test_arguments_that_are_not_utf8_are_one_line(run, capsys, flags, message):
    assert one_line_error(capsys, cli.main(["generate", str(run), *flags])) == message


@pytest.mark.parametrize(
    ("flags", "stdin", "message"),
    [
        (
            ["--interactive"],
            b"the\n\xffab\n",
            "stdin line 2: not valid UTF-8 (byte 0xff at byte 0: invalid start byte)",
        ),
        (
            ["--chat"],
            b"hi\nok \xe2\x82\nbye\n",
            "stdin line 2: not valid UTF-8 (byte 0xe2 at byte 3: invalid continuation byte)",
        ),
    ],
)
@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_stdin_lines_that_are_not_utf8_are_one_line(
    run, capsys, monkeypatch, flags, stdin, message, errors
):
    """Whatever stdin's error handler (strict in a UTF-8 locale: the read fails, for a whole
    buffer at once; surrogateescape in the C locale or with PYTHONIOENCODING: encoding the
    text fails later), the line that is not UTF-8 is named, after the lines before it."""
    monkeypatch.setattr(
        "sys.stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8", errors=errors)
    )
    argv = ["generate", str(run), *flags, "--max-new-tokens", "2", "--temperature", "0"]
    code = cli.main(argv)
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 1  # the first line was answered
    assert one_line_error(_Replay(out), code) == message


def test_stdin_text_holding_escaped_bytes_is_one_line(run, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("the\n\udcffab\n"))
    argv = ["generate", str(run), "--interactive", "--max-new-tokens", "2"]
    message = one_line_error(capsys, cli.main(argv))
    assert message == "stdin line 2: not valid UTF-8 (byte 0xff at character 0)"


class _Replay:
    """What ``capsys.readouterr()`` gave, to read again."""

    def __init__(self, captured) -> None:
        self.captured = captured

    def readouterr(self):
        return self.captured


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--repetition-penalty", "nan"], "repetition_penalty must be a finite number, got nan"),
        (["--repetition-penalty", "inf"], "repetition_penalty must be a finite number, got inf"),
        (["--repetition-penalty", "-1"], "repetition_penalty must be > 0, got -1.0"),
        (["--repetition-penalty", "0"], "repetition_penalty must be > 0, got 0.0"),
        (
            ["--num-beams", "2", "--length-penalty", "nan"],
            "length_penalty must be a finite number, got nan",
        ),
        (
            ["--num-beams", "2", "--length-penalty=-inf"],
            "length_penalty must be a finite number, got -inf",
        ),
        (["--temperature", "nan"], "temperature must be a finite number, got nan"),
        (["--temperature", "inf"], "temperature must be a finite number, got inf"),
        (["--temperature", "-0.1"], "temperature must be ≥ 0 (0 = greedy), got -0.1"),
        (["--num-beams", "2", "--temperature", "nan"], "temperature must be a finite number"),
        (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
        (["--top-p", "1.01"], "top_p must be in (0, 1], got 1.01"),
        (["--top-p", "nan"], "top_p must be a finite number, got nan"),
        (["--top-k", "-5"], "top_k must be ≥ 1, got -5"),
        (["--min-p", "nan"], "min_p must be a finite number, got nan"),
        (["--num-beams", str(10**9)], "num_beams must be in [1, 256], got 1000000000"),
        (["--max-new-tokens", str(10**20)], "max_new_tokens must be in [0, 1,000,000], got 1"),
        (["--max-new-tokens", "-1"], "max_new_tokens must be in [0, 1,000,000], got -1"),
        (["--temperature", "1e-45"], "no finite sampling probabilities (step 1, prompt 1)"),
    ],
)
def test_impossible_sampling_flags_are_one_line(run, capsys, flags, message):
    argv = ["generate", str(run), "--prompt", "the", "--max-new-tokens", "3", *flags]
    if "--max-new-tokens" in flags:
        argv = ["generate", str(run), "--prompt", "the", *flags]
    assert one_line_error(capsys, cli.main(argv)).startswith(message)


def test_a_run_whose_weights_hold_nan_is_refused_naming_the_tensor(tmp_path, capsys):
    name = "layers.1.ffn.out_proj.weight"
    bad = _make_run(tmp_path / "nan", poison=name)
    for flags in ([], ["--temperature", "0"], ["--num-beams", "2"], ["--chat", "hi"]):
        argv = ["generate", str(bad), "--max-new-tokens", "2", *flags]
        message = one_line_error(capsys, cli.main(argv))
        assert message == (
            f"{bad / WEIGHTS}: weight {name}[1, 2] is nan, not a finite number; use another "
            "checkpoint (--weights best or latest) or train again"
        )


def test_a_run_whose_spec_is_an_alias_bomb_names_the_spec_file(run, tmp_path, capsys):
    bomb = tmp_path / "bomb"
    shutil.copytree(run, bomb)
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]" for p, n in zip("abcdefgh", "bcdefghi")]
    (bomb / SPEC_FILE).write_text("\n".join(lines) + "\n")
    message = one_line_error(capsys, cli.main(["generate", str(bomb)]))
    assert message.startswith(f"{bomb / SPEC_FILE}: invalid YAML: aliases expand to more than")
