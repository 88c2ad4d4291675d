"""Plugin authoring: the ``plugin`` group and ``plugin new``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from llmkit.cli.common import console, registry
from llmkit.errors import LlmkitError


def register_commands(register: Callable[..., Any]) -> None:
    register("plugin", help="plugin authoring: `llmkit plugin new NAME`")
    register(
        "new",
        run_new,
        group="plugin",
        help="generate a plugin package that installs and passes its own tests",
        description="Generate a plugin package in DIR/NAME: pyproject.toml declaring the "
        "llmkit entry point, one component of KIND with its options model, tests running the "
        "conformance suite, and a README.",
        configure=configure_new,
    )


def configure_new(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="distribution name, e.g. llmkit-my-ffn")
    p.add_argument(  # no fixed choices: the scaffold says which kinds have a template
        "--kind", default="ffn", help="a component kind with a plugin template (default: ffn)"
    )
    p.add_argument("--dir", default=".", help="where to create NAME/ (default: here)")
    p.add_argument(
        "--component", help="the name specs use (default: NAME without 'llmkit-', '-' → '_')"
    )


def run_new(args: argparse.Namespace) -> int:
    from llmkit.scaffold import new_plugin, plugin_names

    names = plugin_names(args.name, args.kind, args.component)  # validates the kind
    reg = registry()
    key = f"{names.kind}.{names.component}"
    if names.component in reg.names(names.kind) or key in reg.conflicts:
        owner = reg.components.get(key)
        by = f" (from {owner.provider})" if owner is not None else ""
        raise LlmkitError(
            f"{names.kind} {names.component!r} already exists{by}; choose another component "
            "name with --component"
        )
    root, names, files = new_plugin(args.name, args.kind, args.dir, args.component)
    con = console()
    con.print(
        f"created {names.distribution} in {root}: {names.kind} {names.component!r} "
        f"({names.target}), entry point {names.entry_point!r}",
        markup=False,
    )
    for path in files:
        con.print(f"  {path.relative_to(root)}", markup=False)
    con.print(
        f"next:\n  pip install -e {root}\n  pytest {root}\n"
        f"  llmkit show {names.kind} {names.component}",
        markup=False,
    )
    return 0
