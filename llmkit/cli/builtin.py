"""llmkit's built-in command plugin: registers every ``llmkit`` command through the
``register_commands`` hook, exactly as a third-party plugin adds its own.

Each command module holds its commands' argparse definitions and handlers, and registers
them with ``register_commands(register)``. The modules import nothing heavy at module level,
so ``llmkit --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmkit.cli import (
    adapters,
    bench,
    catalogue,
    compare,
    data,
    evaluate,
    generate,
    harness,
    info,
    interop,
    plugin,
    scaling,
    search,
    serve,
    sweep,
    train,
)
from llmkit.hookspecs import hookimpl

#: In the order ``llmkit --help`` lists them.
MODULES = (
    catalogue,
    plugin,
    info,
    data,
    train,
    sweep,
    search,
    scaling,
    compare,
    adapters,
    interop,
    evaluate,
    harness,
    generate,
    bench,
    serve,
)


@hookimpl
def register_commands(register: Callable[..., Any]) -> None:
    for module in MODULES:
        module.register_commands(register)
