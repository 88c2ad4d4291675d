"""The ``llmkit`` command line: one module per command group, each registering its
commands (argparse definitions and handlers) through the ``register_commands`` hook, as
third-party plugins do (:mod:`llmkit.cli.builtin`); :mod:`llmkit.cli.app` assembles the
parser and runs ``main``."""

from llmkit.cli.app import main

__all__ = ["main"]
