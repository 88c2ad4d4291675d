"""llmkit's modules depend on each other one way, and plugins use only the public API.

Imports are read with ``ast``; nothing is imported. Every import counts: at module level,
inside functions, under ``TYPE_CHECKING``. Strings (registry targets, ``import_module``) are
not imports and are not checked.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "llmkit"
PLUGINS = ROOT / "plugins"

#: The layers, lowest first. A module may import its own layer and every layer below it.
LAYERS: list[tuple[str, ...]] = [
    # contracts: what components, kernels, the model and plugins rely on; options: the
    # torch-free bases of every component's options; hardware: device choice (imports only
    # errors, files); files: atomic writes, full disks; dropout: the CPU dropout of 16-bit
    # masks; messages: the chat message contract
    (
        "contracts",
        "options",
        "ops",
        "optim",
        "errors",
        "files",
        "hookspecs",
        "hardware",
        "records",
        "dropout",
        "messages",
        "parallel",  # the mesh layout and the parallel styles components declare plans with
    ),
    ("registry",),  # the plugin host
    ("components", "kernels"),
    ("spec", "model"),
    ("data", "runs"),
    # The wings above, in order: what runs a model and what moves it in and out (generation,
    # HF interop) and the plugin authors' tools; then evaluation (perplexity, downstream
    # tasks), which the trainer's validation uses; then training, which samples as it goes;
    # then what measures and compares trainings (benchmarks, experiments); the CLI last.
    # Serving (the OpenAI API over the generation engine) loads runs and HF directories.
    ("inference", "interop", "testing", "scaffold"),
    ("evaluation", "serving"),
    ("training",),
    ("bench", "experiments"),
    ("cli",),
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}

#: Narrower than the layers: what these may import (top-level names under ``llmkit``).
ONLY: dict[str, set[str]] = {
    # Kernels sit beside their references but never reach into components (files: the
    # cache directory a compiled kernel is built into; hardware: the CPU flags it is built for).
    "kernels": {"contracts", "ops", "dropout", "kernels", "files", "hardware"},
}

#: What plugins may import from llmkit: the package itself and these public modules.
PUBLIC_MODULES = {"llmkit", "llmkit.testing"}

#: Known violations, (importing file, imported module), each to be fixed by the code, never by
#: adding to this list. The lead empties it; a stale entry fails test_allow_list_is_current.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def _literal(tree: ast.Module, name: str) -> object:
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == name and node.value is not None:
            return ast.literal_eval(node.value)
    raise AssertionError(f"llmkit/__init__.py has no literal {name}")


INIT = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
PUBLIC_NAMES: list[str] = _literal(INIT, "__all__")  # type: ignore[assignment]
LAZY: dict[str, str] = _literal(INIT, "_LAZY")  # type: ignore[assignment]


def _root_name_modules() -> dict[str, str | None]:
    """What each name of ``llmkit/__init__.py`` comes from: its module, or None (a constant)."""
    names: dict[str, str | None] = {k: v.partition(":")[0] for k, v in LAZY.items()}
    for node in INIT.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmkit"):
            names.update((a.asname or a.name, node.module) for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update((t.id, None) for t in targets if isinstance(t, ast.Name))
    return names


ROOT_NAMES = _root_name_modules()
#: The conformance suite's public names (``llmkit/testing/__init__.py``'s ``__all__``).
TESTING_NAMES: list[str] = _literal(  # type: ignore[assignment]
    ast.parse((PACKAGE / "testing" / "__init__.py").read_text(encoding="utf-8")), "__all__"
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> Iterator[tuple[int, str, tuple[str, ...]]]:
    """(line, absolute module, imported names) of every import in the file."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            yield node.lineno, base, tuple(a.name for a in node.names)
        elif isinstance(node, ast.Call) and _dynamic_import(node):
            yield node.lineno, node.args[0].value, ()  # import_module("llmkit.x") counts too


def _dynamic_import(node: ast.Call) -> bool:
    """``importlib.import_module("llmkit...")`` / ``import_target("llmkit...:attr")`` with a
    literal module name: an import spelled as a string is still an import."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name not in ("import_module", "import_target", "__import__") or not node.args:
        return False
    arg = node.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return False
    arg.value = arg.value.partition(":")[0]
    return _is_llmkit(arg.value)


def _is_llmkit(module: str) -> bool:
    return module == "llmkit" or module.startswith("llmkit.")


def _targets(module: str, names: tuple[str, ...]) -> Iterator[str | None]:
    """The llmkit modules an import reaches; ``from llmkit import x`` resolves ``x`` through
    the façade (a submodule, a lazy public name, or None for a constant such as __version__)."""
    if module != "llmkit":
        yield module
        return
    if not names:
        yield "llmkit"  # a bare `import llmkit`: the façade, which reaches every layer
    for name in names:
        if (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file():
            yield f"llmkit.{name}"
        else:
            yield ROOT_NAMES.get(name, "llmkit")


def _top(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _files(base: Path) -> list[Path]:
    skip = ("__pycache__", "build", "dist", ".venv")
    return sorted(
        p
        for p in base.rglob("*.py")
        if not any(part in skip or part.endswith(".egg-info") for part in p.parts)
    )


def _package_violations() -> Iterator[tuple[str, str, str]]:
    for path in _files(PACKAGE):
        if path == PACKAGE / "__init__.py":
            continue  # the façade: its lazy names reach every layer by design
        rel = path.relative_to(ROOT).as_posix()
        here = _top(_module_name(path))
        assert here in LAYER, f"{rel}: llmkit.{here} has no layer; add it to LAYERS"
        for line, module, names in _imports(path):
            if not _is_llmkit(module):
                continue
            for target in _targets(module, names):
                if target is None:
                    continue
                why = _why(here, _top(target))
                if why is not None:
                    yield rel, target, f"{rel}:{line} imports {target}: {why}"


def _why(here: str, there: str) -> str | None:
    """Why a module of ``llmkit.<here>`` may not import ``llmkit.<there>``; None if it may."""
    if there not in LAYER:
        return "the llmkit façade; import the module that defines the name"
    if here in ONLY and there not in ONLY[here]:
        return f"llmkit.{here} may import only {sorted(ONLY[here])}"
    if there == "components" and here != "components":
        return "only components import components: the core reaches them by registry"
    if LAYER[there] > LAYER[here]:
        return f"layer {LAYERS[LAYER[here]]} imports layer {LAYERS[LAYER[there]]}"
    return None


def test_the_rules_refuse_what_they_name():
    """The core never imports a component (even from a layer above), kernels only what
    ONLY allows, and the wings of the top layers go one way:
    inference < evaluation < training < experiments < cli."""
    assert _why("data", "components") is not None
    assert _why("cli", "components") is not None
    assert _why("components", "components") is None and _why("components", "contracts") is None
    assert _why("kernels", "model") is not None
    assert _why("training", "inference") is None and _why("inference", "training") is not None
    assert _why("training", "evaluation") is None and _why("evaluation", "training") is not None
    assert _why("experiments", "training") is None and _why("training", "experiments") is not None
    assert _why("cli", "evaluation") is None and _why("experiments", "cli") is not None


def _plugin_violations() -> Iterator[tuple[str, str, str]]:
    for path in _files(PLUGINS):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [(a.name, ()) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found = [(node.module, tuple(a.name for a in node.names))]
            else:
                continue
            for module, names in found:
                if not _is_llmkit(module):
                    continue
                if module not in PUBLIC_MODULES:
                    yield rel, module, f"{rel}:{node.lineno} imports {module} (not public)"
                elif module == "llmkit":
                    for name in names:
                        if name not in PUBLIC_NAMES and f"llmkit.{name}" not in PUBLIC_MODULES:
                            yield rel, module, f"{rel}:{node.lineno} imports llmkit.{name}"
                elif module == "llmkit.testing":
                    for name in set(names) - set(TESTING_NAMES):
                        yield rel, module, f"{rel}:{node.lineno} imports llmkit.testing.{name}"


def _unexpected(found: Iterator[tuple[str, str, str]]) -> list[str]:
    return [msg for rel, target, msg in found if (rel, target) not in KNOWN_VIOLATIONS]


def test_layer_table_names_every_top_level_module():
    tops = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    assert tops - set(LAYER) == set(), "place every llmkit module in LAYERS"
    assert set(LAYER) - tops == set(), "LAYERS names a module that does not exist"


def test_llmkit_imports_only_downwards():
    problems = _unexpected(_package_violations())
    assert problems == [], "upward imports:\n" + "\n".join(problems)


def test_plugins_import_only_the_public_api():
    problems = _unexpected(_plugin_violations())
    assert problems == [], (
        "plugins may import only `from llmkit import <name in llmkit.__all__>` and "
        f"{sorted(PUBLIC_MODULES - {'llmkit'})}:\n" + "\n".join(problems)
    )


def test_allow_list_is_current():
    found = {(rel, target) for rel, target, _ in (*_package_violations(), *_plugin_violations())}
    stale = KNOWN_VIOLATIONS - found
    assert stale == set(), f"fixed, remove from KNOWN_VIOLATIONS: {sorted(stale)}"


def test_public_names_are_declared_once_and_typed():
    """``__all__`` = the eager names + the lazy map, and TYPE_CHECKING imports each lazy name
    from the module the map names (what type checkers and IDEs see)."""
    eager = set(ROOT_NAMES) - set(LAZY) - {"__all__", "_LAZY"}  # hookimpl, __version__
    assert sorted(PUBLIC_NAMES) == sorted({*LAZY, *eager}), "__all__ vs _LAZY"
    typed: dict[str, str] = {}
    for node in ast.walk(INIT):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.module:
                    typed.update(
                        (a.asname or a.name, f"{stmt.module}:{a.name}") for a in stmt.names
                    )
    spelled = {n: t if ":" in t else f"{t}:{n}" for n, t in LAZY.items()}
    assert typed == spelled


def test_importing_llmkit_is_cheap():
    import subprocess
    import sys

    code = (
        "import sys, llmkit\n"
        "heavy = [m for m in ('torch', 'triton', 'datasets') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert set(dir(llmkit)) >= set(llmkit.__all__)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_every_public_name_resolves():
    import llmkit
    import llmkit.cli

    missing = [name for name in llmkit.__all__ if getattr(llmkit, name, None) is None]
    assert missing == []
    assert llmkit.cli_main is llmkit.cli.main


def test_string_imports_and_private_testing_names_are_caught(tmp_path):
    """The checks see an import spelled as a string, and a plugin reaching past
    ``llmkit.testing.__all__``."""
    lower = tmp_path / "llmkit" / "model" / "m.py"
    lower.parent.mkdir(parents=True)
    lower.write_text('import importlib\nimportlib.import_module("llmkit.training.trainer")\n')
    found = [(line, mod) for line, mod, _ in _imports_at(lower, tmp_path)]
    assert found == [(1, "importlib"), (2, "llmkit.training.trainer")]
    assert "_fail" not in TESTING_NAMES and "check_component" in TESTING_NAMES


def _imports_at(path: Path, root: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    global ROOT
    saved, ROOT = ROOT, root
    try:
        return sorted(_imports(path))
    finally:
        ROOT = saved


def test_test_modules_have_unique_basenames():
    # The suite has no __init__.py files, so pytest imports each test file by its basename:
    # two files of one name in different folders stop collection with "import file mismatch".
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        assert path.name not in seen, f"{path} has the basename of {seen[path.name]}"
        seen[path.name] = path
