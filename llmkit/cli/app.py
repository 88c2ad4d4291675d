"""``main()``: the parser assembled from the registered commands, and error handling.

Listing and help import neither torch nor triton nor datasets; commands that build models
import them on demand. A user error prints one line and exits 2 (``--debug`` shows the
traceback); a reader that closes the pipe ends the command quietly (exit 141).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from llmkit.cli.commands import Command, CommandTable, load_commands
from llmkit.cli.common import EXIT_USER_ERROR, reset_warnings, warn_failures
from llmkit.errors import LlmkitError


def commands() -> tuple[CommandTable, Any, BaseException | None]:
    """The registered commands, the registry they came from, and the error that kept the
    registry from loading (None when it loaded).

    A registry that cannot load (a bad ``$LLMKIT_REGISTRY``, a broken plugin under
    ``LLMKIT_STRICT_PLUGINS``) leaves the built-in commands, so ``--help`` and argument
    errors still work; the chosen command then reports the error.
    """
    from llmkit.registry import Registry, get_registry

    try:
        reg = get_registry()
        return load_commands(reg), reg, None
    except Exception as exc:
        reg = Registry()
        return load_commands(reg), reg, exc


def build_parser(cmds: Iterable[Command], failures: Sequence[Any] = ()) -> argparse.ArgumentParser:
    """The ``llmkit`` parser: one subparser per command, subcommands under their group.

    Each command's parser sets ``_command`` (its record) and ``_parser`` (itself) as defaults;
    ``failures`` (plugins that failed) are named at the end of ``llmkit --help``.
    """
    epilog = None
    if failures:
        names = ", ".join(f"{p.name!r} ({p.distribution})" for p in failures)
        epilog = f"warning: plugins that failed: {names}; `llmkit plugins` says why"
    parser = argparse.ArgumentParser(
        prog="llmkit",
        description="Build language models from interchangeable components.",
        epilog=epilog,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=_version())
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    parsers: dict[str, argparse.ArgumentParser] = {}
    groups: dict[str, Any] = {}
    for cmd in cmds:
        if cmd.group is None:
            where = top
        elif cmd.group in groups:
            where = groups[cmd.group]
        else:
            where = groups[cmd.group] = parsers[cmd.group].add_subparsers(
                dest=f"{cmd.group}_command", metavar="COMMAND"
            )
        p = where.add_parser(
            cmd.name,
            aliases=list(cmd.aliases),
            help=cmd.help,
            description=cmd.description or cmd.help,
        )
        p.set_defaults(_command=cmd, _parser=p)
        if cmd.configure is not None:
            cmd.configure(p)
        if cmd.group is None:
            parsers[cmd.name] = p
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``llmkit`` with ``argv`` (default: the process arguments); the exit status."""
    table, reg, problem = commands()
    parser = build_parser(table.commands, reg.failures())
    args = parser.parse_args(argv)
    cmd: Command | None = getattr(args, "_command", None)
    if cmd is None:
        parser.print_help()
        return 0
    _log_to_stderr()
    reset_warnings()
    try:
        if problem is not None:
            raise problem
        if cmd.name != "plugins":  # every command names the plugins that failed (once)
            warn_failures(reg)
        if cmd.run is None:  # a group named without a subcommand
            args._parser.print_help()
            code = 0
        else:
            code = int(cmd.run(args) or 0)
    except LlmkitError as exc:
        if args.debug:
            raise
        code = _error(str(exc))
    except BrokenPipeError:
        if args.debug:
            raise
        # The reader went away (`llmkit generate … | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    except OSError as exc:  # a path that cannot be used, a full disk, a permission
        if args.debug:
            raise
        where = f": {exc.filename}" if exc.filename else ""
        code = _error(f"{exc.strerror or exc}{where}")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    dist = sys.modules.get("llmkit.training.distributed")  # imported only by a training run
    if dist is not None:
        dist.exit_process(code)  # returns unless this process joined a process group
    return code


def _version() -> str:
    from llmkit import __version__

    return f"llmkit {__version__}"


def _log_to_stderr() -> None:
    """Show llmkit's INFO log lines (e.g. a kernel falling back to its reference) as notes."""
    import logging

    logger = logging.getLogger("llmkit")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("note: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _error(message: str) -> int:
    """Print a user error as one line (naming the rank in a multi-process run)."""
    multi = os.environ.get("WORLD_SIZE", "1") not in ("", "1")
    where = f"[rank {os.environ.get('RANK', '?')}] " if multi else ""
    print(f"error: {where}{message}", file=sys.stderr)
    return EXIT_USER_ERROR
