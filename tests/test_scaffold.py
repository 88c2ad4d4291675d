"""`llmkit plugin new`: the generated package builds, installs, is found by llmkit, and passes
its own tests as generated — for every kind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from llmkit.cli import main
from llmkit.errors import LlmkitError
from llmkit.registry import get_registry, reset_registry
from llmkit.scaffold import KINDS, plugin_names, render
from llmkit.testing import check_component
from tests.conftest import ROOT

RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env.pop("LLMKIT_STRICT_PLUGINS", None)
    env.pop("LLMKIT_REGISTRY", None)
    return env


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, capture_output=True, text=True, cwd=cwd, env=_env(**env), timeout=300
    )


def test_names_are_derived_from_the_distribution_name():
    n = plugin_names("llmkit-foo-bar", "ffn")
    assert (n.distribution, n.package, n.entry_point, n.component) == (
        "llmkit-foo-bar",
        "llmkit_foo_bar",
        "foo_bar",
        "foo_bar",
    )
    assert n.cls == "FooBarFFN" and n.target == "llmkit_foo_bar.foo_bar:FooBarFFN"
    n = plugin_names("My.Plugin", "optimizer", component="fancy_sgd")
    assert (n.package, n.entry_point, n.component) == ("my_plugin", "my_plugin", "fancy_sgd")
    assert n.target == "my_plugin.fancy_sgd:build"
    for bad, match in [
        ("llmkit", "reserved"),
        ("llmkit-builtin", "reserved"),
        ("-x", "not a valid distribution name"),
        ("my plugin", "not a valid distribution name"),
        ("9lives", "not an identifier"),
    ]:
        with pytest.raises(LlmkitError, match=match):
            plugin_names(bad)
    with pytest.raises(LlmkitError, match="component name 'Bad-Name'"):
        plugin_names("llmkit-x", component="Bad-Name")
    with pytest.raises(LlmkitError, match="unknown kind 'loss'"):
        plugin_names("llmkit-x", "loss")


@pytest.mark.parametrize("kind", KINDS)
def test_the_generated_pyproject_declares_the_entry_point(kind):
    names = plugin_names(f"llmkit-my-{kind}", kind)
    files = render(names)
    assert set(files) == {
        "pyproject.toml",
        "README.md",
        f"llmkit_my_{kind}/__init__.py",
        f"llmkit_my_{kind}/my_{kind}.py",
        f"tests/test_llmkit_my_{kind}.py",
    }
    meta = tomllib.loads(files["pyproject.toml"])
    assert meta["project"]["name"] == f"llmkit-my-{kind}"
    assert meta["project"]["entry-points"]["llmkit"] == {f"my_{kind}": f"llmkit_my_{kind}"}
    assert "llmkit>=0.1" in meta["project"]["dependencies"]
    assert f'"{names.target}"' in files[f"llmkit_my_{kind}/__init__.py"]
    for text in files.values():
        assert "$" not in text.replace("$LLMKIT", "")  # every placeholder filled


def test_every_kind_generates_a_package_that_passes_its_own_tests(tmp_path, capsys):
    roots = []
    for kind in KINDS:
        code = main(["plugin", "new", f"llmkit-my-{kind}", "--kind", kind, "--dir", str(tmp_path)])
        out = capsys.readouterr().out
        assert code == 0 and f"created llmkit-my-{kind}" in out and "pip install -e" in out
        roots.append(tmp_path / f"llmkit-my-{kind}")
    if RUFF:  # generated code is lint- and format-clean under its own ruff settings
        for root in roots:
            for args in (["check", "-q", "."], ["format", "--check", "-q", "."]):
                proc = _run([RUFF, *args], root)
                assert proc.returncode == 0, (root.name, proc.stdout, proc.stderr)
    proc = _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
        + [str(r / "tests") for r in roots],
        tmp_path,
        PYTHONPATH=os.pathsep.join(str(r) for r in roots),
        LLMKIT_PLUGINS="",
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{5 * len(KINDS) - 2} passed" in proc.stdout  # no model test for optimizer/schedule


def test_a_generated_package_builds_installs_and_joins_llmkit(tmp_path, capsys, monkeypatch):
    assert main(["plugin", "new", "llmkit-tiny-gelu", "--dir", str(tmp_path)]) == 0
    capsys.readouterr()
    root = tmp_path / "llmkit-tiny-gelu"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    proc = _run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", "dist", str(root)],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("llmkit_tiny_gelu-0.1.0-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        eps = zf.read("llmkit_tiny_gelu-0.1.0.dist-info/entry_points.txt").decode()
    assert "[llmkit]" in eps and "tiny_gelu = llmkit_tiny_gelu" in eps
    site = tmp_path / "site"
    proc = _run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], ROOT
    )
    assert proc.returncode == 0, proc.stderr
    # Installed (on sys.path, found through its dist-info): llmkit lists and shows it.
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("LLMKIT_PLUGINS", "tiny_gelu")
    reset_registry()
    try:
        assert main(["plugins"]) == 0
        assert "tiny_gelu" in capsys.readouterr().out
        assert main(["show", "ffn", "tiny_gelu"]) == 0
        out = capsys.readouterr().out
        assert "provider: llmkit-tiny-gelu 0.1.0" in out and "multiplier" in out
        check_component(get_registry().get("ffn", "tiny_gelu"))
    finally:
        reset_registry()
        sys.modules.pop("llmkit_tiny_gelu", None)
        sys.modules.pop("llmkit_tiny_gelu.tiny_gelu", None)


def test_plugin_new_refuses_what_cannot_work(tmp_path, capsys):
    assert main(["plugin", "new", "llmkit-dup", "--dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["plugin", "new", "llmkit-dup", "--dir", str(tmp_path)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert main(["plugin", "new", "bad name!", "--dir", str(tmp_path)]) == 2
    assert "not a valid distribution name" in capsys.readouterr().err
    code = main(["plugin", "new", "llmkit-x", "--component", "mlp", "--dir", str(tmp_path)])
    assert code == 2
    assert "ffn 'mlp' already exists (from llmkit); choose another" in capsys.readouterr().err
    assert not (tmp_path / "llmkit-x").exists()
    with pytest.raises(SystemExit) as exit_:
        main(["plugin", "new", "llmkit-y", "--kind", "loss"])
    assert exit_.value.code == 2
    assert main(["plugin"]) == 0 and "new" in capsys.readouterr().out


def test_plugin_new_stays_import_light(tmp_path):
    code = (
        "import sys\nfrom llmkit.cli import main\n"
        f"assert main(['plugin', 'new', 'llmkit-light', '--kind', 'attention', '--dir', "
        f"{str(tmp_path)!r}]) == 0\n"
        "heavy = [m for m in ('torch', 'triton', 'datasets') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = _run([sys.executable, "-c", code], ROOT, LLMKIT_PLUGINS="")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "llmkit-light" / "llmkit_light" / "light.py").is_file()
