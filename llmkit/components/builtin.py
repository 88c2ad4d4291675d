"""llmkit's built-in plugin: registers every entry of the ``registry.toml`` catalogue.

It is loaded through the ``llmkit`` entry-point group like any third-party plugin and
imports no component module until a component is built: each entry names its options model
(``options``) in a torch-free module, so a spec is read, validated and given its schema
without the components' code.
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Callable
from typing import Any

from llmkit.hookspecs import hookimpl
from llmkit.registry import CATALOGUE


@functools.cache
def catalogue() -> dict[str, Any]:
    """The parsed catalogue (read once per process)."""
    return tomllib.loads(CATALOGUE.read_text(encoding="utf-8"))


@hookimpl
def register_kinds(register: Callable[..., None]) -> None:
    for name, fields in catalogue()["kinds"].items():
        register(name, **fields)


@hookimpl
def register_components(register: Callable[..., Any]) -> None:
    for entry in catalogue()["component"]:
        register(
            entry["kind"],
            entry["name"],
            entry["target"],
            summary=entry["summary"],
            options=entry.get("options"),
            capabilities=entry.get("capabilities", {}),
        )
