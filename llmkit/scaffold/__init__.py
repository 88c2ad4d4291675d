"""``llmkit plugin new``: generate a plugin package that installs and passes its own tests.

The template comes from the kind's record: ``Kind.template = "package:relative/dir"`` names a
directory of package data (resolved with :mod:`importlib.resources`), so a plugin that
declares a kind with ``template=`` gets ``llmkit plugin new --kind`` for free. A kind with
neither a template nor a conformance check of its own gets ``templates/generic``. The package
written is llmkit's skeleton (``templates/skeleton``: a pyproject.toml declaring the ``llmkit``
entry point, the hook module, tests running the kind's conformance check, a README) overlaid
with the kind's directory, which holds at least the component module.

A template directory:

- Every file is written at its relative path. ``$name`` placeholders (:class:`string.Template`;
  ``$$`` is a dollar sign) are filled in in paths and in ``*.tmpl`` files, which lose the
  suffix; other files are copied as they are. A kind's file replaces the skeleton's file of
  the same path.
- ``template.toml`` (optional) is read, not written: ``class_suffix`` (the component class is
  ``<Component><suffix>``; default: the kind's name in CamelCase), ``target_attr`` (the module
  attribute registered; default: the class), ``test_imports`` (extra names the tests import
  from :mod:`llmkit.testing`), ``[values]`` (text for placeholders, which may itself use the
  placeholders below) and ``[capabilities]`` (registered with the component).
- An options module (optional): a template whose package has ``options.py`` (the file
  ``$pkg/options.py.tmpl``) keeps the component's pydantic options there, as the class
  ``$options_cls``, in a module that imports no torch. The component is then registered with
  ``options="<pkg>.options:<class>"``, so ``llmkit validate``, ``show`` and ``schema`` check
  specs without importing the component module (or torch), and the generated tests check
  that the module stays torch-free. Every llmkit template has one; without it, llmkit finds
  ``Options`` on the registered target.

Placeholders: ``dist``, ``pkg``, ``ep``, ``kind``, ``component``, ``module``, ``cls``,
``target`` (``"pkg.module:attr"``), ``options_cls`` (the options class: ``<Component>Options``),
``summary``, ``capabilities`` (the ``register`` argument, or empty), ``options`` (the
``register`` argument naming the options module, or empty without one), ``options_doc``,
``options_tests`` and ``options_readme`` (text about it for the hook module's docstring, the
tests and the README, or what fits a template without one), ``dependencies`` (a TOML array:
llmkit, and the kind's provider if it is a plugin), ``needs`` (a Python list of the entry
points to load for the kind), ``testing_imports``, ``spec_example`` (TOML choosing the
component where the kind's section is), ``extra_tests``, ``kind_summary``, ``kind_build``,
``kind_contract`` (from the kind's record), and every key of ``[values]``.

Nothing here imports torch: ``llmkit plugin new`` stays fast.
"""

from __future__ import annotations

import difflib
import json
import keyword
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from string import Template
from typing import Any

from llmkit.errors import LlmkitError
from llmkit.registry import Kind, Registry, get_registry

SKELETON = "llmkit.scaffold:templates/skeleton"
#: The template of a kind that names none and has no check of its own (check_generic applies).
GENERIC = "llmkit.scaffold:templates/generic"
MANIFEST = "template.toml"
_MANIFEST_KEYS = {"class_suffix", "target_attr", "test_imports", "values", "capabilities"}
#: The torch-free module of a generated package that holds the component's options (when the
#: kind's template ships ``$pkg/options.py.tmpl``).
OPTIONS_MODULE = "options"

_DIST_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
_COMPONENT_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_RESERVED = {"llmkit", "builtin"}


@dataclass(frozen=True)
class PluginNames:
    """Every name a generated plugin uses, derived from the distribution name."""

    distribution: str  # llmkit-foo            (pip install, requires = [...])
    package: str  # llmkit_foo                  (the import name)
    entry_point: str  # foo                     (LLMKIT_PLUGINS, llmkit plugins)
    kind: str  # ffn
    component: str  # foo                       (what specs name: { name = "foo" })
    module: str  # foo                          (llmkit_foo/foo.py)
    cls: str  # FooFFN                          (the component's class, or the optimizer's)
    target: str  # llmkit_foo.foo:FooFFN        (what register_components names)
    options_cls: str = ""  # FooOptions         (the component's options class)
    #: llmkit_foo.options:FooOptions (registered as its options), or None: the template has no
    #: options module, and llmkit finds ``Options`` on the target.
    options: str | None = None


@dataclass
class KindTemplate:
    """A kind's template directory and its manifest (``template.toml``)."""

    kind: Kind
    root: Traversable
    class_suffix: str
    target_attr: str | None = None  # None: the class
    test_imports: list[str] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)
    capabilities: dict[str, Any] = field(default_factory=dict)

    @property
    def has_options_module(self) -> bool:
        """Whether the template writes ``$pkg/options.py``, the component's options module."""
        package = self.root.joinpath("$pkg")
        return any(
            package.joinpath(f"{OPTIONS_MODULE}.py{suffix}").is_file() for suffix in ("", ".tmpl")
        )


def _registry(registry: Registry | None) -> Registry:
    return get_registry() if registry is None else registry


def template_kinds(registry: Registry | None = None) -> list[str]:
    """The kinds ``llmkit plugin new --kind`` can generate: those whose record names a
    template."""
    return sorted(name for name, kind in _registry(registry).kinds.items() if kind.template)


def _resolve(ref: str, what: str) -> Traversable:
    """The directory ``"package:relative/dir"`` names."""
    package, _, rel = ref.partition(":")
    try:
        root = resources.files(package).joinpath(rel) if rel else resources.files(package)
    except Exception as exc:  # the package does not import
        raise LlmkitError(f"{what}: template {ref!r}: {type(exc).__name__}: {exc}") from exc
    if not root.is_dir():
        raise LlmkitError(f"{what}: template {ref!r} is not a directory in package {package!r}")
    return root


def load_template(kind: str, registry: Registry | None = None) -> KindTemplate:
    """The template of ``kind``: the one its record names, else llmkit's generic template
    when the kind has no conformance check of its own. An unknown kind, or one with its own
    check and no template, is a :class:`LlmkitError` listing the kinds that have one."""
    reg = _registry(registry)
    with_template = ", ".join(template_kinds(reg)) or "none"
    record = reg.kinds.get(kind)
    if record is None:
        close = difflib.get_close_matches(kind, list(reg.kinds), n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise LlmkitError(
            f"unknown kind {kind!r}{hint}; kinds with a plugin template: {with_template}"
        )
    if not record.template and record.check:
        raise LlmkitError(
            f"kind {kind!r} (from {record.provider}) has its own conformance check but no plugin "
            f"template (its provider can name one with register_kinds(..., template=...)); "
            f"kinds with one: {with_template}"
        )
    what = f"kind {kind!r} (from {record.provider})"
    root = _resolve(record.template or GENERIC, what)
    manifest: dict[str, Any] = {}
    if root.joinpath(MANIFEST).is_file():
        try:
            manifest = tomllib.loads(root.joinpath(MANIFEST).read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise LlmkitError(f"{what}: {MANIFEST}: invalid TOML: {exc}") from exc
    unknown = sorted(set(manifest) - _MANIFEST_KEYS)
    if unknown:
        raise LlmkitError(
            f"{what}: {MANIFEST}: unknown keys {', '.join(unknown)} "
            f"(known: {', '.join(sorted(_MANIFEST_KEYS))})"
        )
    camel = "".join(part.capitalize() for part in re.split(r"[_\W]+", kind) if part)
    return KindTemplate(
        record,
        root,
        str(manifest.get("class_suffix", camel)),
        manifest.get("target_attr"),
        [str(name) for name in manifest.get("test_imports", [])],
        {str(k): str(v) for k, v in manifest.get("values", {}).items()},
        dict(manifest.get("capabilities", {})),
    )


def plugin_names(
    name: str,
    kind: str = "ffn",
    component: str | None = None,
    *,
    registry: Registry | None = None,
) -> PluginNames:
    """Derive and validate the names of a plugin called ``name`` (its distribution name, e.g.
    ``llmkit-foo``). Raises :class:`LlmkitError` for a name that cannot work."""
    template = load_template(kind, registry)
    if not _DIST_RE.match(name):
        raise LlmkitError(
            f"{name!r} is not a valid distribution name: use letters, digits, '-', '_' and "
            "'.', starting and ending with a letter or digit (e.g. llmkit-my-ffn)"
        )
    package = re.sub(r"[-_.]+", "_", name).lower()
    entry_point = package.removeprefix("llmkit_") or package
    if package in _RESERVED or entry_point in _RESERVED:
        raise LlmkitError(f"{name!r} is reserved by llmkit; choose another name")
    if not package.isidentifier() or keyword.iskeyword(package) or package[0].isdigit():
        raise LlmkitError(
            f"{name!r} gives the Python package name {package!r}, which is not an identifier; "
            "start the name with a letter"
        )
    comp = component if component is not None else entry_point
    if not _COMPONENT_RE.match(comp) or keyword.iskeyword(comp):
        raise LlmkitError(
            f"component name {comp!r}: use lowercase letters, digits and '_', starting with a "
            "letter (set it with --component)"
        )
    camel = "".join(part.capitalize() for part in comp.split("_") if part)
    cls = camel + template.class_suffix
    target = f"{package}.{comp}:{template.target_attr or cls}"
    options_cls = f"{camel}Options" if f"{camel}Options" != cls else f"{cls}Options"
    options = None
    if template.has_options_module:
        if comp == OPTIONS_MODULE:
            raise LlmkitError(
                f"component name {comp!r} is the name of the plugin's options module "
                f"({package}.{OPTIONS_MODULE}); choose another name with --component"
            )
        options = f"{package}.{OPTIONS_MODULE}:{options_cls}"
    return PluginNames(
        name, package, entry_point, kind, comp, comp, cls, target, options_cls, options
    )


def _py(value: Any) -> str:
    """``value`` as Python source in the style ``ruff format`` keeps (double quotes)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py(str(k))}: {_py(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _capabilities(capabilities: dict[str, Any]) -> str:
    """The ``capabilities=`` argument of the generated ``register`` call, one key a line."""
    if not capabilities:
        return ""
    lines = "".join(f'\n            "{k}": {_py(v)},' for k, v in capabilities.items())
    return f"\n        capabilities={{{lines}\n        }},"


_OPTIONS_TEST = '''

def test_the_options_module_imports_no_torch():
    """`llmkit validate`, `show` and `schema` read the options from the module registered as
    the component's `options`, without importing the component: keep that module torch-free."""
    import os
    import subprocess
    import sys

    options = plugin_registry().get(KIND, COMPONENT).options
    assert isinstance(options, str), "register the component with options='module:Class'"
    module = options.partition(":")[0]
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'it imports torch'"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
'''


def _options(names: PluginNames) -> dict[str, str]:
    """The placeholders about the options module: ``options`` (the ``options=`` argument of
    the generated ``register`` call), ``options_doc`` (the hook module's docstring),
    ``options_tests`` (a test that the module imports no torch) and ``options_readme`` (the
    README's line on the modules). Without an options module, no argument and no test."""
    if names.options is None:
        readme = (
            "- `$pkg/$module.py` holds the component and its pydantic `Options` (unknown keys "
            "are\n  rejected, so a misspelled option in a spec is an error)."
        )
        return {"options": "", "options_doc": "", "options_tests": "", "options_readme": readme}
    doc = (
        "\nSo is its options model, in a module that imports no torch: ``llmkit validate``, "
        "``show``\nand ``schema`` check specs without importing the component."
    )
    readme = (
        "- `$pkg/$module.py` holds the component.\n"
        "- `$pkg/options.py` holds its pydantic options, `$options_cls` (unknown keys are\n"
        "  rejected, so a misspelled option in a spec is an error). It imports no torch and is\n"
        "  registered as the component's `options`, so `llmkit validate`, `show` and `schema`\n"
        "  check specs without importing the component or torch (about 0.2 s instead of 1.3 s\n"
        "  or more); a test keeps it torch-free."
    )
    return {
        "options": f'\n        options="{names.options}",',
        "options_doc": doc,
        "options_tests": _OPTIONS_TEST,
        "options_readme": readme,
    }


def _spec_example(kind: Kind) -> str:
    """TOML choosing ``$component`` in the kind's spec table."""
    if kind.section is None:
        return f"# the {kind.name} kind has no spec section: build its components from Python"
    parent, _, slot = kind.section.rpartition(".")
    if not parent:
        return f'[{slot}]\nname = "$component"'
    return f'[{parent}]\n{slot} = {{ name = "$component" }}'


def _provider(kind: Kind, registry: Registry) -> tuple[list[str], list[str]]:
    """The entry points to load for ``kind`` and the requirements of a generated package."""
    deps = ["llmkit>=0.1"]
    if kind.provider == "llmkit":
        return [], deps
    plugins = [
        p for p in registry.plugins.values() if p.distribution == kind.provider and not p.error
    ]
    version = plugins[0].version if plugins else "?"
    deps.append(kind.provider if version == "?" else f"{kind.provider}>={version}")
    return [p.name for p in plugins], deps


def _fill(text: str, values: dict[str, str], where: str) -> str:
    try:
        return Template(text).substitute(values)
    except KeyError as exc:
        known = ", ".join(sorted(values))
        raise LlmkitError(f"{where}: unknown placeholder ${exc.args[0]} (known: {known})") from exc
    except ValueError as exc:
        raise LlmkitError(f"{where}: {exc} (write a dollar sign as $$)") from exc


def _walk(root: Traversable, prefix: str = "") -> Iterator[tuple[str, Traversable]]:
    """(relative path, file) of every file under ``root``, sorted."""
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name == "__pycache__" or entry.name.endswith(".pyc"):
            continue
        rel = f"{prefix}{entry.name}"
        if entry.is_dir():
            yield from _walk(entry, f"{rel}/")
        elif rel != MANIFEST:
            yield rel, entry


def _order(rel: str) -> tuple[bool, bool, bool, str]:
    """pyproject.toml, the other top-level files, the package, then the tests."""
    return ("/" in rel, rel != "pyproject.toml", rel.startswith("tests/"), rel)


def render(names: PluginNames, registry: Registry | None = None) -> dict[str, str]:
    """The generated files: relative path → text."""
    reg = _registry(registry)
    template = load_template(names.kind, reg)
    needs, deps = _provider(template.kind, reg)
    testing = {"check_component", "conformance_params", *template.test_imports}
    values = {
        "dist": names.distribution,
        "pkg": names.package,
        "ep": names.entry_point,
        "kind": names.kind,
        "component": names.component,
        "module": names.module,
        "cls": names.cls,
        "target": names.target,
        "summary": f"A {names.kind} component (a starting point)",
        "options_cls": names.options_cls,
        "capabilities": _capabilities(template.capabilities),
        **_options(names),
        "dependencies": _py(deps),
        "needs": _py(needs),
        "testing_imports": ", ".join(sorted(testing)),
        "spec_example": _spec_example(template.kind),
        "kind_summary": template.kind.summary.rstrip("."),
        "kind_build": template.kind.build or "(the kind's record gives no build signature)",
        "kind_contract": template.kind.contract or "none named",
        "extra_tests": "",
    }
    values.update(template.values)
    where = f"template of kind {names.kind!r} ({template.kind.template})"
    values = {k: _fill(v, values, f"{where}: [values] {k}") for k, v in values.items()}
    files: dict[str, Traversable] = dict(_walk(_resolve(SKELETON, "llmkit's skeleton")))
    files.update(_walk(template.root))
    out = {}
    for rel, entry in files.items():
        text = entry.read_text(encoding="utf-8")
        if rel.endswith(".tmpl"):
            rel = rel.removesuffix(".tmpl")
            text = _fill(text, values, f"{where}: {rel}")
        out[_fill(rel, values, f"{where}: file name {rel}")] = text
    return {rel: out[rel] for rel in sorted(out, key=_order)}


def new_plugin(
    name: str,
    kind: str = "ffn",
    directory: str | Path = ".",
    component: str | None = None,
    *,
    registry: Registry | None = None,
) -> tuple[Path, PluginNames, list[Path]]:
    """Write the plugin ``name`` into ``directory/name``; return its root, names and files.

    Refuses to write into an existing, non-empty directory.
    """
    names = plugin_names(name, kind, component, registry=registry)
    root = Path(directory) / names.distribution
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise LlmkitError(f"{root} already exists and is not empty; choose another --dir or name")
    files = []
    for rel, text in render(names, registry).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        files.append(path)
    return root, names, files
