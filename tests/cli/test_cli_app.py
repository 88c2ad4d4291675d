"""The command line as a program: one-line errors, --debug, argument ranges, a closed pipe,
and start-up cost (help and listing import no torch)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from llmkit.cli import main
from tests.conftest import ROOT


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "LLMKIT_PLUGINS": "", **env},
        timeout=120,
    )


def test_help_lists_every_builtin_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in ("list", "show", "plugins", "plugin", "validate", "schema", "info", "train"):
        assert f"\n    {name} " in out
    assert main([]) == 0 and "eval" in capsys.readouterr().out


def test_a_group_without_a_subcommand_prints_its_help(capsys):
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "generate" in out and "kernels" in out


def test_unusable_paths_are_one_line_errors(capsys, tmp_path):
    assert main(["schema", "-o", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: Is a directory: {tmp_path}\n"
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["schema", "-o", str(afile / "x.json")]) == 2
    assert capsys.readouterr().err == f"error: Not a directory: {afile / 'x.json'}\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "RUN", "--batch-size", "0"],
        ["eval", "RUN", "--batch-size", "-1"],
        ["generate", "RUN", "--seed", "-1"],
        ["generate", "RUN", "--seed", str(2**64)],
        ["train", "SPEC", "--max-time", "0"],
        ["train", "SPEC", "--max-time", "nan"],
        ["train", "SPEC", "--max-steps", "0"],
        ["info", "SPEC", "--seq-len", "-5"],
        ["bench", "kernels", "--threads", "-2"],
        ["bench", "generate", "RUN", "--threads", "0"],
    ],
    ids=" ".join,
)
def test_out_of_range_arguments_are_refused_before_anything_runs(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_a_closed_pipe_ends_quietly(tmp_path):
    """`llmkit … | head -c1`: the reader is gone before anything is written; no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmkit.cli", "schema"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and err.decode() == "", err.decode()


def test_a_broken_pipe_while_training_is_an_error(monkeypatch, capsys):
    """Training writes no pipe of its own: a broken pipe there is not a reader leaving."""
    import llmkit.cli.train as train_cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(train_cli, "_train", broken)
    assert main(["train", "SPEC"]) == 2
    assert capsys.readouterr().err.startswith("error: broken pipe:")
    with pytest.raises(BrokenPipeError):
        main(["--debug", "train", "SPEC"])


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["list"], ["list", "attention"], ["bench", "--help"], ["plugin", "new", "-h"]],
    ids=" ".join,
)
def test_help_and_list_do_not_import_heavy_libraries(argv):
    code = (
        "import sys\nfrom llmkit.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'triton', 'datasets') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr


def test_user_errors_exit_2_without_traceback_and_debug_shows_it(tmp_path):
    missing = str(tmp_path / "nope.toml")
    proc = subprocess.run(
        [sys.executable, "-m", "llmkit.cli", "validate", missing],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "spec file not found" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "llmkit.cli", "--debug", "info", missing],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_a_registry_that_cannot_load_leaves_help_working(tmp_path):
    """A bad $LLMKIT_REGISTRY: --help still lists the built-in commands; a command that
    needs the registry reports the problem in one line."""
    missing = tmp_path / "winners.toml"
    code = (
        "from llmkit.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "assert main(['list']) == 2\n"
    )
    proc = _python(code, LLMKIT_REGISTRY=str(missing))
    assert proc.returncode == 0, proc.stderr
    assert "validate" in proc.stdout
    assert proc.stderr == f"error: registry file not found: {missing}\n"


LONG_PATH = "/data/" + "/".join(f"directory-{i:02d}" for i in range(12)) + "/corpus.jsonl"


def _print_table(monkeypatch, columns: str | None) -> None:
    from llmkit.cli.common import console, table

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    out = table("option", "value", title="options")
    out.add_row("data.source.paths", LONG_PATH)
    out.add_row("model.attention.sliding_window.window", "128")
    console().print(out)


@pytest.mark.parametrize("columns", [None, "80", "40"])
def test_a_table_printed_to_a_pipe_keeps_each_row_on_one_line(monkeypatch, capsys, columns):
    """Off a terminal rich lays out 80 columns (or $COLUMNS): llmkit's tables do not, so a
    long path or key is never split over lines, and no line ends in the cells' padding."""
    _print_table(monkeypatch, columns)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "options"
    assert lines[1].split() == ["option", "value"]
    assert lines[2].split() == ["data.source.paths", LONG_PATH]
    assert lines[3].split() == ["model.attention.sliding_window.window", "128"]
    assert len(lines) == 4
    assert all(line == line.rstrip() for line in lines)


def test_a_table_on_a_terminal_still_folds_to_its_width(monkeypatch, capsys):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: the output is a terminal
    _print_table(monkeypatch, "60")
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # bold, italic
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 60
    assert LONG_PATH not in out and "corpus.jsonl" in out  # folded within its column


def test_a_command_piped_prints_whole_rows():
    """`llmkit show dataset text | cat`: each option's row, description included, is one
    line (folded continuation lines would start with spaces)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run(
        [sys.executable, "-m", "llmkit.cli", "show", "dataset", "text"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "LLMKIT_PLUGINS": ""},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = lines[lines.index("options") + 2 :]
    assert rows and all(not line.startswith(" ") for line in rows), proc.stdout
    assert any(len(line) > 80 for line in rows)
