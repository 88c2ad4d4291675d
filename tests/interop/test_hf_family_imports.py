"""No Hugging Face family module imports another: what families share lives in
:mod:`llmkit.interop.family_common` (and the other non-family interop modules).

The family modules are the ones the package itself registers (``convert.FAMILIES``, each
family's class module); their imports are read with ``ast``, at module level and inside
functions alike, absolute and relative.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from llmkit.interop import families as families_package
from llmkit.interop.convert import FAMILIES

PACKAGE = families_package.__name__
#: Every family module, as the package registers them.
FAMILY_MODULES: frozenset[str] = frozenset(type(f).__module__ for f in FAMILIES)
COMMON = "llmkit.interop.family_common"


def _path(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    return Path(spec.origin)


def _imported(module: str, source: str) -> set[str]:
    """Every module ``module`` (whose text is ``source``) imports; ``from P import N``
    counts as P and P.N."""
    tree = ast.parse(source)
    package = module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}
    return out


def _family_imports(module: str, source: str | None = None) -> set[str]:
    """The family modules (or the families package) ``module`` imports, itself aside."""
    if source is None:
        source = _path(module).read_text(encoding="utf-8")
    return {
        name
        for name in _imported(module, source)
        if name != module and (name in FAMILY_MODULES or name == PACKAGE)
    }


def test_every_family_module_is_registered():
    assert FAMILY_MODULES, "no family registered"
    assert all(m.startswith(PACKAGE + ".") for m in FAMILY_MODULES)


@pytest.mark.parametrize("module", sorted(FAMILY_MODULES))
def test_family_imports_no_other_family(module):
    found = _family_imports(module)
    assert not found, f"{module} imports {sorted(found)}: move what families share to {COMMON}"


def test_common_helpers_import_no_family():
    assert not _family_imports(COMMON)


def test_the_check_sees_a_cross_family_import():
    """The reader catches the forms a cross-family import takes."""
    other = sorted(FAMILY_MODULES)[0]
    short = other.rpartition(".")[2]
    for source in (
        f"from {other} import FAMILY\n",
        f"import {other}\n",
        f"from {PACKAGE} import {short}\n",
        f"def f():\n    from .{short} import FAMILY\n",
        f"from . import {short}\n",
    ):
        assert other in _family_imports(f"{PACKAGE}.fake", source), source
