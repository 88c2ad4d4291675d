"""Every hook in llmkit.hookspecs is documented in docs/plugins/hooks.md with its exact
signature (and the exact signature of the callback it receives), and is exercised by a test
(datasette's meta-tests)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest

from llmkit import hookimpl, hookspecs
from llmkit.cli.commands import load_commands
from llmkit.registry import Registry
from tests.conftest import ROOT

DOC = ROOT / "docs" / "plugins" / "hooks.md"
TEST_DIRS = [ROOT / "tests", *sorted((ROOT / "plugins").glob("*/tests"))]


class _Text:
    """An annotation kept as written (``from __future__ import annotations`` makes them
    strings, which inspect would quote)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def signature_text(name: str, fn: Callable[..., Any]) -> str:
    """``name(param: Annotation = default, ...) -> Return`` as written in the source."""
    sig = inspect.signature(fn)

    def ann(a: Any) -> Any:
        return _Text(a) if isinstance(a, str) else a

    params = [p.replace(annotation=ann(p.annotation)) for p in sig.parameters.values()]
    sig = sig.replace(parameters=params, return_annotation=ann(sig.return_annotation))
    return f"{name}{sig}"


def hookspec_functions() -> dict[str, Callable[..., Any]]:
    marker = f"{hookspecs.PROJECT}_spec"  # what pluggy's HookspecMarker sets
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if inspect.isfunction(fn) and hasattr(fn, marker)
    }


HOOKS = hookspec_functions()


def callbacks() -> dict[str, dict[str, Callable[..., Any]]]:
    """The callables each hook receives (e.g. ``register``), captured from a real registry
    and, for ``register_commands``, from the command line's loading of it."""
    seen: dict[str, dict[str, Callable[..., Any]]] = {}

    def capture(hook: str) -> Callable[..., None]:
        params = list(inspect.signature(HOOKS[hook]).parameters)

        def impl(**kwargs: Any) -> None:
            seen[hook] = {k: v for k, v in kwargs.items() if callable(v)}

        impl.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params]
        )
        return hookimpl(specname=hook)(impl)

    plugin = type("Capture", (), {f"_impl_{h}": staticmethod(capture(h)) for h in HOOKS})()
    reg = Registry()
    info = reg.add_plugin(plugin, "capture", "llmkit-capture", "0")
    load_commands(reg)
    assert info.error is None, info.error
    assert set(seen) == set(HOOKS), f"hooks no caller ran: {set(HOOKS) - set(seen)}"
    return seen


def sections() -> dict[str, str]:
    """hooks.md split at its second-level headings: heading text (backticks removed) → body."""
    out: dict[str, str] = {}
    current = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            current = line[3:].replace("`", "").strip()
            out[current] = ""
        elif current is not None:
            out[current] += line.replace("`", "") + "\n"
    return out


def test_there_are_hooks():
    assert {"register_kinds", "register_components", "register_commands"} <= set(HOOKS)


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hook_is_documented_with_its_exact_signature(name):
    want = signature_text(name, HOOKS[name])
    assert want in sections(), f"docs/plugins/hooks.md needs a heading '## {want}'"
    assert (HOOKS[name].__doc__ or "").strip(), f"hookspec {name} has no docstring"


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_the_callbacks_a_hook_receives_are_documented_exactly(name):
    body = sections()[signature_text(name, HOOKS[name])]
    for arg, fn in callbacks().get(name, {}).items():
        want = signature_text(arg, fn)
        assert want in body, f"the section of {name} must show the callback as '{want}'"


def test_no_section_documents_a_hook_that_does_not_exist():
    for heading in sections():
        match = re.match(r"(\w+)\(", heading)
        if match:
            assert match.group(1) in HOOKS, f"hooks.md documents unknown hook {heading!r}"


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hook_is_exercised_by_a_test(name):
    """Some test implements the hook (``def <name>(``) and so runs it through a registry."""
    implementation = re.compile(rf"\bdef {name}\(")
    found = [
        path
        for d in TEST_DIRS
        for path in d.rglob("*.py")
        if path.name != "test_hooks_documented.py"
        and implementation.search(path.read_text(encoding="utf-8"))
    ]
    assert found, f"no test implements the hook {name}"
