"""The command line as a program: one-line errors, --debug, argument ranges, a closed pipe,
and start-up cost (help and listing import no torch)."""

from __future__ import annotations

import os
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
