"""The command line: listing, showing, validation, info, errors and start-up cost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmkit.cli import main
from tests.conftest import ROOT, SPECS


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_with_kind_and_wildcards(capsys):
    code, out, _ = run(capsys, "list", "attention")
    assert code == 0 and "sdpa" in out and "mlp" not in out
    code, out, _ = run(capsys, "list", "position", "r*")
    assert "rope" in out and "learned" not in out
    code, out, _ = run(capsys, "list", "*norm")
    assert "rmsnorm" in out and "layernorm" in out and "sdpa" not in out


def test_unknown_kind_is_a_one_line_error(capsys):
    code, _, err = run(capsys, "list", "atention")
    assert code == 2
    assert err.strip().count("\n") == 0 and "did you mean 'attention'" in err


def test_show_prints_options_provider_and_capabilities(capsys):
    code, out, _ = run(capsys, "show", "attention", "sliding_window")
    assert code == 0
    for text in ("window", "256", "llmkit", "causal_only", "capabilities"):
        assert text in out
    code, _, err = run(capsys, "show", "ffn", "swigl")
    assert code == 2 and "did you mean 'swiglu'" in err


def test_show_names_a_component_whose_module_fails_to_import(capsys, monkeypatch):
    from tests.test_conformance import fake_registry

    reg = fake_registry({"kind": "norm", "name": "ghost", "target": "llmkit.no_such_module:Ghost"})
    monkeypatch.setattr("llmkit.cli._registry", lambda: reg)
    code, out, err = run(capsys, "show", "norm", "ghost")
    assert code == 2 and not out
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert "norm 'ghost' from llmkit-fake failed to load: ModuleNotFoundError" in err


def test_unusable_paths_are_one_line_errors(capsys, tmp_path):
    code, _, err = run(capsys, "schema", "-o", str(tmp_path))
    assert code == 2 and err == f"error: Is a directory: {tmp_path}\n"
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _, err = run(capsys, "schema", "-o", str(afile / "x.json"))
    assert code == 2 and err == f"error: Not a directory: {afile / 'x.json'}\n"


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


def test_plugins_lists_the_builtin_plugin(capsys):
    code, out, _ = run(capsys, "plugins", "-v")
    assert code == 0 and "builtin" in out and "attention.sdpa" in out


def test_validate_good_and_bad(capsys, tmp_path):
    code, out, err = run(capsys, "validate", str(SPECS / "tiny.toml"), "--resolved")
    assert code == 0 and "valid" in err
    assert json.loads(out)["model"]["layers"]  # stdout is the JSON alone
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nd_model = 8\nn_layers = 1\nn_heads = 2\nffn = { name = "mpl" }\n')
    code, _, err = run(capsys, "validate", str(bad))
    assert code == 2 and "model.ffn.name" in err and "did you mean 'mlp'" in err


def test_validate_builds_the_model_to_find_what_only_components_know(capsys):
    code, _, err = run(capsys, "validate", str(SPECS / "tiny.toml"), "--set", "model.head_dim=7")
    assert code == 2
    assert "the model does not build: position 'rope'" in err and "rot_dim 7" in err


def test_info_reports_gpt2_small_exactly(capsys):
    code, out, _ = run(capsys, "info", str(SPECS / "gpt2-small.toml"), "--json")
    assert code == 0
    assert "124,439,808" in out
    for text in ("FLOPs/token", "KV cache", "training step memory", "layer"):
        assert text in out


def test_info_shows_every_layer_component(capsys):
    code, out, _ = run(capsys, "info", str(SPECS / "local-global.yaml"))
    assert code == 0
    assert out.count("sliding_window(window=128)") == 3
    assert out.count("mlp(activation=relu2)") == 2


def test_schema_writes_json(capsys, tmp_path):
    target = tmp_path / "schema.json"
    assert main(["schema", "-o", str(target)]) == 0
    assert json.loads(target.read_text())["title"] == "llmkit spec"


def _python(code: str, *env_pairs: tuple[str, str]) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "LLMKIT_PLUGINS": "", **dict(env_pairs)}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize("argv", [["--help"], ["list"], ["list", "attention"]])
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
