"""The hooks a plugin implements. ``llmkit.hookimpl`` marks the implementations.

A plugin is a module (or object) exposed through the ``llmkit`` entry-point group. It
implements any of the hooks below; each receives a ``register`` callback rather than
returning values, so one plugin can register any number of things.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "llmkit"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_kinds(register: Callable[..., None]) -> None:
    """Declare new component kinds.

    Call ``register(name, summary, **fields)`` once per kind. ``name`` is the kind's
    identifier used in ``llmkit list``; ``summary`` one line for listings. The optional fields
    give the kind its meaning everywhere in llmkit (see :class:`llmkit.registry.Kind`):

    - ``section``: dotted spec path of the table choosing the component, e.g. ``"train.loss"``
      (the spec and its JSON Schema gain that table);
    - ``default``: the component used when the table names none (None: the table is optional);
    - ``per_layer``: selectable per layer in ``model.overrides`` (``model.<slot>`` sections);
    - ``build``: the build signature its components follow (shown by ``llmkit show``);
    - ``contract``: ``"module:attr"`` of a base class or protocol its components follow;
    - ``check``: ``"module:attr"`` of its conformance check ``check(record, options, *, device)``;
    - ``template``: ``"package:dir"`` of its ``llmkit plugin new --kind`` template;
    - ``bench``: ``"module:attr"`` of its ``llmkit bench kernels`` adapter.

    Built-in kinds (attention, ffn, norm, position, optimizer, schedule, dataset) are
    declared through this same hook by llmkit's built-in plugin.
    """


@hookspec
def register_components(register: Callable[..., Any]) -> None:
    """Register components.

    Call ``register(kind, name, target, *, summary, options=None, capabilities=None)``
    once per component:

    - ``kind``: a declared kind (``"attention"``, ``"ffn"``, ...).
    - ``name``: the name specs use (``{ name = "..." }``).
    - ``target``: the factory (usually a class), or a lazy ``"module:attr"`` string imported
      on first use so that listing components never imports torch.
    - ``summary``: one line shown by ``llmkit list``.
    - ``options``: a pydantic model of the component's options (extra keys forbidden), or a
      ``"module:attr"`` string imported on first use; when omitted, the target's ``Options``
      attribute is used (or its module's ``Options``), which imports the target. Naming a
      module that imports no torch lets ``llmkit validate``, ``show`` and ``schema`` check
      specs without importing the component (as llmkit's own components do).
    - ``capabilities``: a dict of what the component needs or supports
      (e.g. ``{"positions": ["embedding", "qk", "score_bias"], "kv_cache": True}``).

    The provider (distribution name and version) is filled in by llmkit.
    """


@hookspec
def register_commands(register: Callable[..., Any]) -> None:
    """Add commands to the ``llmkit`` command line (argparse).

    Call ``register(name, run=None, *, help, configure=None, description=None, aliases=(),
    group=None)`` once per command:

    - ``name``: the command (``llmkit NAME``), unique among commands (aliases included).
    - ``run``: the handler, ``run(args: argparse.Namespace) -> int | None`` (None = 0); it
      raises :class:`llmkit.errors.LlmkitError` for a user error (one line, exit 2). A command
      without ``run`` prints its help: a group whose subcommands do the work.
    - ``help``: one line for ``llmkit --help``; ``description``: the longer text of
      ``llmkit NAME --help`` (default: ``help``).
    - ``configure``: ``configure(parser: argparse.ArgumentParser) -> None`` adds the command's
      arguments; called when the parser is built, so it imports nothing heavy.
    - ``aliases``: other names for the command.
    - ``group``: makes it a subcommand, ``llmkit GROUP NAME``, of a command registered before
      it (llmkit's ``bench`` and ``plugin``, or one of your own).

    Only the command line calls this hook. llmkit's own commands are registered through it
    by its built-in command plugin; a name already taken is an error, reported like any
    plugin failure, and every other command still works.
    """
