"""`llmkit plugin new`: the generated package builds, installs, is found by llmkit, and passes
its own tests as generated — for every kind with a template, including a kind a plugin
declares with ``template=``."""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from llmkit.cli import main
from llmkit.errors import LlmkitError
from llmkit.registry import Registry, get_registry, reset_registry
from llmkit.scaffold import load_template, plugin_names, render, template_kinds
from llmkit.testing import check_component
from tests.conftest import ROOT

RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
BUILTIN_TEMPLATES = [
    "adapter",
    "attention",
    "block",
    "dataset",
    "ffn",
    "logger",
    "norm",
    "optimizer",
    "position",
    "qk_transform",
    "schedule",
]
#: Every built-in kind has a template of its own and generates a package.
GENERATED = BUILTIN_TEMPLATES


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env.pop("LLMKIT_STRICT_PLUGINS", None)
    env.pop("LLMKIT_REGISTRY", None)
    return env


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, capture_output=True, text=True, cwd=cwd, env=_env(**env), timeout=300
    )


def _lint(root: Path) -> None:
    """Generated code is lint- and format-clean under its own ruff settings."""
    if RUFF:
        for args in (["check", "-q", "."], ["format", "--check", "-q", "."]):
            proc = _run([RUFF, *args], root)
            assert proc.returncode == 0, (root.name, proc.stdout, proc.stderr)


def test_the_built_in_kinds_have_templates():
    assert template_kinds() == BUILTIN_TEMPLATES
    assert get_registry().kinds["attention"].template == "llmkit.scaffold:templates/attention"


def test_the_templates_ship_as_package_data():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = meta["tool"]["setuptools"]["package-data"]["llmkit"]
    shipped = {p for pattern in patterns for p in (ROOT / "llmkit").glob(pattern) if p.is_file()}
    templates = ROOT / "llmkit" / "scaffold" / "templates"
    files = {p for p in templates.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert files and files <= shipped, sorted(map(str, files - shipped))


def test_names_are_derived_from_the_distribution_name():
    n = plugin_names("llmkit-foo-bar", "ffn")
    assert (n.distribution, n.package, n.entry_point, n.component) == (
        "llmkit-foo-bar",
        "llmkit_foo_bar",
        "foo_bar",
        "foo_bar",
    )
    assert n.cls == "FooBarFFN" and n.target == "llmkit_foo_bar.foo_bar:FooBarFFN"
    assert n.options_cls == "FooBarOptions"
    assert n.options == "llmkit_foo_bar.options:FooBarOptions"
    n = plugin_names("My.Plugin", "optimizer", component="fancy_sgd")
    assert (n.package, n.entry_point, n.component) == ("my_plugin", "my_plugin", "fancy_sgd")
    assert n.target == "my_plugin.fancy_sgd:build"
    assert n.options == "my_plugin.options:FancySgdOptions"
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
    with pytest.raises(LlmkitError, match=r"'options' is the name of the plugin's options module"):
        plugin_names("llmkit-x", component="options")
    with pytest.raises(
        LlmkitError, match="unknown kind 'loss'; kinds with a plugin template: adapter, att"
    ):
        plugin_names("llmkit-x", "loss")
    with pytest.raises(LlmkitError, match=r"unknown kind 'atention' \(did you mean 'attention'"):
        plugin_names("llmkit-x", "atention")


@pytest.mark.parametrize("kind", BUILTIN_TEMPLATES)
def test_the_generated_pyproject_declares_the_entry_point(kind):
    names = plugin_names(f"llmkit-my-{kind}", kind)
    files = render(names)
    assert list(files) == [
        "pyproject.toml",
        "README.md",
        f"llmkit_my_{kind}/__init__.py",
        f"llmkit_my_{kind}/my_{kind}.py",
        f"llmkit_my_{kind}/options.py",
        f"tests/test_llmkit_my_{kind}.py",
    ]
    meta = tomllib.loads(files["pyproject.toml"])
    assert meta["project"]["name"] == f"llmkit-my-{kind}"
    assert meta["project"]["entry-points"]["llmkit"] == {f"my_{kind}": f"llmkit_my_{kind}"}
    assert meta["project"]["dependencies"] == ["llmkit>=0.1"]
    assert f'"{names.target}"' in files[f"llmkit_my_{kind}/__init__.py"]
    # The options live in a torch-free module, registered as the component's options.
    assert f'options="{names.options}",' in files[f"llmkit_my_{kind}/__init__.py"]
    assert f"class {names.options_cls}(" in files[f"llmkit_my_{kind}/options.py"]
    tree = ast.parse(files[f"llmkit_my_{kind}/options.py"])
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "llmkit", "pydantic"}, imported
    assert (
        "def test_the_options_module_imports_no_torch" in files[f"tests/test_llmkit_my_{kind}.py"]
    )
    for text in files.values():
        assert "$" not in text.replace("$LLMKIT", "")  # every placeholder filled


def test_generated_code_imports_only_the_public_api():
    import llmkit
    import llmkit.testing

    public = {"llmkit": set(llmkit.__all__), "llmkit.testing": set(llmkit.testing.__all__)}
    for kind in GENERATED:
        for rel, text in render(plugin_names(f"llmkit-my-{kind}", kind)).items():
            if not rel.endswith(".py"):
                continue
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Import):
                    assert not [a for a in node.names if a.name.startswith("llmkit.")], rel
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmkit"):
                    if node.module.startswith("llmkit_"):
                        continue  # the generated package itself
                    names = {a.name for a in node.names}
                    assert names <= public.get(node.module, set()), (rel, node.module, names)


def test_every_kind_generates_a_package_that_passes_its_own_tests(tmp_path, capsys):
    roots = []
    for kind in GENERATED:
        code = main(["plugin", "new", f"llmkit-my-{kind}", "--kind", kind, "--dir", str(tmp_path)])
        out = capsys.readouterr().out
        assert code == 0 and f"created llmkit-my-{kind}" in out and "pip install -e" in out
        roots.append(tmp_path / f"llmkit-my-{kind}")
    for root in roots:
        _lint(root)
    proc = _run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
        + [str(r / "tests") for r in roots],
        tmp_path,
        PYTHONPATH=os.pathsep.join(str(r) for r in roots),
        LLMKIT_PLUGINS="",
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # five tests each (one that the options module imports no torch), and a model test for
    # the kinds whose template adds one; the logger kind has no spec section (its spec test
    # skips) and its template adds two
    with_model_test = {"attention", "ffn", "norm", "position", "logger"}
    assert f"{sum(6 if k in with_model_test else 5 for k in GENERATED)} passed" in proc.stdout


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
        for name in ("llmkit_tiny_gelu", "llmkit_tiny_gelu.tiny_gelu", "llmkit_tiny_gelu.options"):
            sys.modules.pop(name, None)
    # Its options come from its torch-free options module: commands that need no model
    # (validate, show, schema) import no torch with it installed.
    code = (
        "import sys\nfrom llmkit.cli import main\n"
        "assert main(['show', 'ffn', 'tiny_gelu']) == 0 and main(['schema']) == 0\n"
        "heavy = [m for m in ('torch', 'triton', 'datasets') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = _run(
        [sys.executable, "-c", code], ROOT, PYTHONPATH=str(site), LLMKIT_PLUGINS="tiny_gelu"
    )
    assert proc.returncode == 0, proc.stderr
    assert "provider: llmkit-tiny-gelu 0.1.0" in proc.stdout and "multiplier" in proc.stdout


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
    assert main(["plugin", "new", "llmkit-y", "--kind", "loss", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "error: unknown kind 'loss'; kinds with a plugin template: adapter, attention,"
    )
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


# -- a kind a plugin declares, with its own template ---------------------------------------------

WIDGETKIT = {
    "__init__.py": """\
from llmkit import hookimpl


@hookimpl
def register_kinds(register):
    register("widget", "A throwaway kind", section="widget", template="widgetkit:templates/widget")
    register("gadget", "A throwaway kind without a template", check="widgetkit:check_gadget")
    register("gizmo", "A throwaway kind with neither a template nor a check", section="gizmo")


def check_gadget(record, options=None, *, device=None):
    pass
""",
    "broken.py": """\
from llmkit import hookimpl


@hookimpl
def register_kinds(register):
    register("nowhere", "Its template is missing", template="widgetkit:templates/nowhere")
    register("typo", "Its template has a typo", template="widgetkit:templates/typo")
    register("nomodule", "Its package does not exist", template="no_such_pkg_xyz:templates/x")
""",
    "templates/widget/template.toml": """\
class_suffix = "Widget"

[values]
summary = "A $kind that shines"

[capabilities]
shiny = true
colours = ["blue", "green"]
""",
    "templates/widget/$pkg/$module.py.tmpl": '''\
"""The widget '$component'."""


class $cls:
    """A widget."""

    def __init__(self, options: object) -> None:
        self.options = options
''',
    "templates/widget/README.md.tmpl": "# $dist\n\nA widget plugin; see `$pkg/$module.py`.\n",
    "templates/widget/NOTES.txt": "copied as it is: $not_a_placeholder\n",
    "templates/typo/$pkg/$module.py.tmpl": "colour = $colour\n",
}


@pytest.fixture
def widgetkit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A throwaway plugin package (on sys.path) declaring the kinds ``widget``, with a template
    directory it ships, and ``gadget``, without one."""
    for rel, text in WIDGETKIT.items():
        path = tmp_path / "src" / "widgetkit" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    yield importlib.import_module("widgetkit")
    for name in [m for m in sys.modules if m == "widgetkit" or m.startswith("widgetkit.")]:
        del sys.modules[name]


def _registry_with(*plugins: tuple[ModuleType, str]) -> Registry:
    reg = Registry()
    reg.load_entry_points([])
    for module, name in plugins:
        info = reg.add_plugin(module, name, f"llmkit-{name}", "0.3.0")
        assert info.error is None, info.error
    return reg


def test_a_kind_with_a_template_gets_plugin_new(widgetkit, tmp_path, capsys):
    reset_registry(_registry_with((widgetkit, "widgets")))
    try:
        out_dir = str(tmp_path / "out")
        assert main(["plugin", "new", "llmkit-blue", "--kind", "widget", "--dir", out_dir]) == 0
        out = capsys.readouterr().out
        assert "created llmkit-blue" in out and "widget 'blue' (llmkit_blue.blue:BlueWidget)" in out
        assert "llmkit show widget blue" in out
        # A kind with its own check but no template: one line naming the kinds with one.
        assert main(["plugin", "new", "llmkit-x", "--kind", "gadget", "--dir", out_dir]) == 2
        assert capsys.readouterr().err == (
            "error: kind 'gadget' (from llmkit-widgets) has its own conformance check but no "
            "plugin template (its provider can name one with register_kinds(..., template=...)); "
            "kinds with one: adapter, attention, block, dataset, ffn, logger, norm, optimizer, "
            "position, qk_transform, schedule, widget\n"
        )
        # Neither a template nor a check: llmkit's generic template, naming the kind's table.
        assert main(["plugin", "new", "llmkit-y", "--kind", "gizmo", "--dir", out_dir]) == 0
        capsys.readouterr()
        module = tmp_path / "out" / "llmkit-y" / "llmkit_y" / "y.py"
        assert "class YGizmo:" in module.read_text()
        readme = (tmp_path / "out" / "llmkit-y" / "README.md").read_text()
        assert '[gizmo]\nname = "y"' in readme
    finally:
        reset_registry()
    root = tmp_path / "out" / "llmkit-blue"
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert files == [
        "NOTES.txt",
        "README.md",
        "llmkit_blue/__init__.py",
        "llmkit_blue/blue.py",
        "pyproject.toml",
        "tests/test_llmkit_blue.py",
    ]
    read = {rel: (root / rel).read_text(encoding="utf-8") for rel in files}
    assert read["NOTES.txt"] == "copied as it is: $not_a_placeholder\n"
    assert read["README.md"] == "# llmkit-blue\n\nA widget plugin; see `llmkit_blue/blue.py`.\n"
    assert "class BlueWidget:" in read["llmkit_blue/blue.py"]
    init = read["llmkit_blue/__init__.py"]
    assert 'summary="A widget that shines"' in init
    # No options module in the template: llmkit finds the options on the target.
    assert (
        "options=" not in init
        and "test_the_options_module" not in read["tests/test_llmkit_blue.py"]
    )
    assert '"shiny": True,' in init and '"colours": ["blue", "green"],' in init
    meta = tomllib.loads(read["pyproject.toml"])
    assert meta["project"]["dependencies"] == ["llmkit>=0.1", "llmkit-widgets>=0.3.0"]
    tests = read["tests/test_llmkit_blue.py"]
    assert 'NEEDS: list[str] = ["widgets"]' in tests and 'KIND = "widget"' in tests
    _lint(root)


def test_broken_templates_are_named(widgetkit):
    broken = importlib.import_module("widgetkit.broken")
    reg = _registry_with((widgetkit, "widgets"), (broken, "broken"))
    with pytest.raises(LlmkitError, match="'widgetkit:templates/nowhere' is not a directory"):
        load_template("nowhere", reg)
    with pytest.raises(LlmkitError, match="ModuleNotFoundError"):
        load_template("nomodule", reg)
    names = plugin_names("llmkit-z", "typo", registry=reg)
    with pytest.raises(LlmkitError, match=r"\$pkg/\$module\.py: unknown placeholder \$colour"):
        render(names, reg)
