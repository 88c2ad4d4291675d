"""The hooks a plugin implements. ``llmkit.hookimpl`` marks the implementations.

A plugin is a module (or object) exposed through the ``llmkit`` entry-point group. It
implements one or both hooks below; each receives a ``register`` callback rather than
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

    Call ``register(name, summary, *, contract=None)`` once per kind: ``name`` is the kind's
    identifier used in specs and ``llmkit list``; ``summary`` one line for listings;
    ``contract`` an optional ``"module:attr"`` naming a base class or protocol that the kind's
    components follow. Built-in kinds (attention, ffn, norm, position, optimizer, schedule,
    dataset) are declared through this same hook by llmkit's built-in plugin.
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
      ``"module:attr"`` string; when omitted, the target's ``Options`` attribute is used.
    - ``capabilities``: a dict of what the component needs or supports
      (e.g. ``{"positions": ["embedding", "qk", "score_bias"], "kv_cache": True}``).

    The provider (distribution name and version) is filled in by llmkit.
    """
