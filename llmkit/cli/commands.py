"""The commands plugins register through the ``register_commands`` hook.

llmkit's own commands come from its built-in command plugin (:mod:`llmkit.cli.builtin`),
asked first; then every other loaded plugin is asked, each with a ``register`` bound to it.
A plugin that registers a taken name, a bad group, or whose hook (or ``configure``) raises is
recorded as failed by the registry, like any plugin failure, and the other commands work.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llmkit.errors import RegistryError

#: The plugin name of llmkit's own commands (``llmkit plugins`` lists it).
BUILTIN_COMMANDS = "builtin-cli"


@dataclass(frozen=True)
class Command:
    """One registered command (see ``llmkit.hookspecs.register_commands``)."""

    name: str
    run: Callable[[argparse.Namespace], int | None] | None
    help: str
    configure: Callable[[argparse.ArgumentParser], None] | None = None
    description: str | None = None
    aliases: tuple[str, ...] = ()
    group: str | None = None
    plugin: str = "?"
    provider: str = "?"

    @property
    def key(self) -> str:
        """``"name"``, or ``"group name"`` for a subcommand."""
        return f"{self.group} {self.name}" if self.group else self.name


class CommandTable:
    """The commands in registration order, and the names taken at each level."""

    def __init__(self) -> None:
        self.commands: list[Command] = []
        self._taken: dict[tuple[str | None, str], Command] = {}

    def get(self, key: str) -> Command | None:
        """The command ``"name"`` or ``"group name"`` (not by alias)."""
        return next((c for c in self.commands if c.key == key), None)

    def registrar(self, info: Any) -> Callable[..., Command]:
        """The ``register`` callback handed to the plugin ``info`` (a ``PluginInfo``)."""

        def register(
            name: str,
            run: Callable[[argparse.Namespace], int | None] | None = None,
            *,
            help: str,
            configure: Callable[[argparse.ArgumentParser], None] | None = None,
            description: str | None = None,
            aliases: Sequence[str] = (),
            group: str | None = None,
        ) -> Command:
            cmd = Command(
                name,
                run,
                help,
                configure,
                description,
                tuple(aliases),
                group,
                info.name,
                info.distribution,
            )
            self.add(cmd)
            return cmd

        return register

    def add(self, cmd: Command) -> None:
        """Check ``cmd`` (names, group, a dry run of ``configure``) and keep it."""
        for name in (cmd.name, *cmd.aliases):
            bad = not isinstance(name, str) or not name or name.startswith("-")
            if bad or any(ch.isspace() for ch in name):
                raise RegistryError(f"bad command name {name!r}: a word, not starting with '-'")
        if not isinstance(cmd.help, str):
            raise RegistryError(f"command {cmd.name!r}: help must be a string")
        for what in ("run", "configure"):
            if getattr(cmd, what) is not None and not callable(getattr(cmd, what)):
                raise RegistryError(f"command {cmd.name!r}: {what} must be callable or None")
        if cmd.group is not None:
            parent = self._taken.get((None, cmd.group))
            if parent is None or parent.name != cmd.group:
                raise RegistryError(
                    f"command {cmd.key!r}: no command group {cmd.group!r} registered before it"
                )
            if parent.group is not None:
                raise RegistryError(f"command {cmd.key!r}: groups nest one level only")
        for name in (cmd.name, *cmd.aliases):
            other = self._taken.get((cmd.group, name))
            if other is not None:
                where = f"llmkit {cmd.group} {name}" if cmd.group else f"llmkit {name}"
                raise RegistryError(
                    f"command '{where}' already exists (from {other.provider}, plugin "
                    f"{other.plugin!r})"
                )
        if cmd.configure is not None:  # a broken configure fails its plugin, not the CLI
            cmd.configure(argparse.ArgumentParser(prog=f"llmkit {cmd.key}"))
        for name in (cmd.name, *cmd.aliases):
            self._taken[(cmd.group, name)] = cmd
        self.commands.append(cmd)


def load_commands(reg: Any) -> CommandTable:
    """Ask every plugin of ``reg`` (a ``Registry``) for its commands, llmkit's first.

    The built-in command plugin is added to ``reg`` on first use. Plugins are asked afresh on
    every call (registering commands is cheap), so a plugin added later is asked too.
    """
    from llmkit import __version__
    from llmkit.cli import builtin

    if not reg.pm.has_plugin(BUILTIN_COMMANDS):
        reg.add_plugin(builtin, BUILTIN_COMMANDS, "llmkit", __version__)
    table = CommandTable()
    reg.call_hook("register_commands", table.registrar)
    return table
