"""The component registry: records, plugin loading, lookup with did-you-mean.

Plugins are loaded one at a time from the ``llmkit`` entry-point group; each hook
implementation is called with a ``register`` callback bound to its provider, so a plugin
that fails to import or to register is recorded by name and the rest still load. The
built-in plugin loads first, and every plugin's ``register_kinds`` runs before any plugin's
``register_components`` (a plugin may use a kind another plugin declares). A plugin that fails
in either hook provides nothing: what it registered is rolled back (with other plugins'
components of the kinds it declared), and lookups of a missing name say which plugins failed.

Environment:
- ``LLMKIT_PLUGINS``: comma-separated entry-point names to load besides the built-in one
  (unset = all installed plugins, ``""`` = none).
- ``LLMKIT_STRICT_PLUGINS=1``: re-raise a plugin's import/registration error.
- ``LLMKIT_REGISTRY``: a TOML file whose ``[winners]`` table settles name clashes.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import importlib.metadata as md
import os
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pluggy

from llmkit import hookspecs
from llmkit.errors import PluginError, RegistryError, first_line
from llmkit.records import Component, Conflict, Kind, PluginInfo, check_kind
from llmkit.records import import_target as import_target  # re-exported

BUILTIN_PLUGIN = "builtin"
#: Plugin names only llmkit's own plugins may use (components; the CLI's built-in commands).
RESERVED_PLUGIN_NAMES = (BUILTIN_PLUGIN, "builtin-cli")
#: The hooks llmkit calls on every plugin, in this order (all plugins' kinds first).
REGISTRATION_HOOKS = ("register_kinds", "register_components")
CATALOGUE = Path(__file__).with_name("registry.toml")


def _dist_of(ep: md.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ep.value.split(":")[0].split(".")[0], "?"
    return dist.metadata["Name"], dist.version


def _load_winners() -> dict[str, str]:
    """The ``[winners]`` tables of the catalogue and ``$LLMKIT_REGISTRY`` (the latter wins);
    a file that cannot be read or a malformed table is a one-line :class:`RegistryError`
    naming the file (and the key)."""
    winners: dict[str, str] = {}
    files = [CATALOGUE]
    if os.environ.get("LLMKIT_REGISTRY"):
        files.append(Path(os.environ["LLMKIT_REGISTRY"]))
    for path in files:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise RegistryError(f"registry file not found: {path}") from exc
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise RegistryError(f"registry file {path}: {why or exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise RegistryError(f"{path}: invalid TOML: {exc}") from exc
        winners.update(_winners_table(data.get("winners", {}), path))
    return winners


def _winners_table(table: Any, path: Path) -> dict[str, str]:
    """``table`` checked: ``"kind.name" = "distribution"`` entries only."""
    if not isinstance(table, dict):
        raise RegistryError(
            f'{path}: [winners] must be a table of "kind.name" = "distribution", got {table!r}'
        )
    for key, value in table.items():
        if not isinstance(value, str) or not value:
            raise RegistryError(
                f'{path}: [winners] "{key}": expected a distribution name (a string, e.g. '
                f'"llmkit-extras"), got {value!r}'
            )
        kind, _, name = key.partition(".")
        if not kind or not name:
            raise RegistryError(
                f'{path}: [winners] "{key}": expected a key "kind.name" (e.g. "norm.dyt")'
            )
    return dict(table)


class Registry:
    """Kinds and components registered by plugins."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.kinds: dict[str, Kind] = {}
        self.components: dict[str, Component] = {}
        self.plugins: dict[str, PluginInfo] = {}
        self.conflicts: dict[str, Conflict] = {}
        self.overridden: list[Component] = []
        self.winners: dict[str, str] = {}
        self.strict = os.environ.get("LLMKIT_STRICT_PLUGINS", "") not in ("", "0")
        #: Every accepted kind and component, in order, with its plugin (for rollbacks).
        self._kind_log: list[tuple[PluginInfo, Kind]] = []
        self._log: list[tuple[PluginInfo, Component]] = []
        #: What failed plugins had registered before they were rolled back: kind names and
        #: ``kind.name`` keys → the plugin (named by lookups of those names).
        self.lost: dict[str, PluginInfo] = {}

    # -- loading ---------------------------------------------------------------------------
    def load_entry_points(self, allow: Iterable[str] | None = None) -> None:
        """Load the built-in plugin and the entry points named in ``allow`` (None = all).

        The built-in plugin comes first. Every plugin's ``register_kinds`` runs before any
        plugin's ``register_components``, so a plugin can register components of a kind that
        llmkit or another plugin declares, whatever the order of their names.
        """
        self.winners = _load_winners()
        eps = sorted(
            md.entry_points(group=hookspecs.PROJECT),
            key=lambda e: (e.name != BUILTIN_PLUGIN, e.name),
        )
        seen = set()
        allowed = None if allow is None else set(allow)
        loaded: list[PluginInfo] = []
        for ep in eps:
            dist, version = _dist_of(ep)
            if ep.name in RESERVED_PLUGIN_NAMES and dist != "llmkit":
                name = f"{ep.name} ({dist})"  # keep the names of llmkit's own plugins free
                self._fail(PluginInfo(name, dist, version), f"reserved plugin name {ep.name!r}")
                continue
            if ep.name in seen:
                continue
            seen.add(ep.name)
            if ep.name != BUILTIN_PLUGIN and allowed is not None and ep.name not in allowed:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                why = first_line(exc, typed=True)
                self._fail(PluginInfo(ep.name, dist, version), why)
                continue
            info = self._register(plugin, ep.name, dist, version)
            if info.error is None:
                loaded.append(info)
        for name in sorted((allowed or set()) - seen - {BUILTIN_PLUGIN}):
            installed = ", ".join(sorted(seen - {BUILTIN_PLUGIN})) or "none"
            self._fail(
                PluginInfo(name, "not installed", ""),
                f"named in LLMKIT_PLUGINS, but no installed package provides it "
                f"(installed plugins: {installed})",
            )
        if BUILTIN_PLUGIN not in self.plugins:  # llmkit's own entry point is missing
            self._fail(
                PluginInfo(BUILTIN_PLUGIN, "llmkit", _own_version()),
                "llmkit's built-in plugin has no entry point: llmkit is not installed "
                "(pip install -e . in its source tree)",
            )
        for hook_name in REGISTRATION_HOOKS:
            for info in loaded:
                if info.error is None:
                    self._call(info, hook_name)
        self._rollback([info for info in loaded if info.error is not None])

    def add_plugin(self, plugin: Any, name: str, distribution: str, version: str) -> PluginInfo:
        """Register one plugin object and run its hooks, isolating its failures (a plugin
        that fails provides nothing)."""
        info = self._register(plugin, name, distribution, version)
        for hook_name in REGISTRATION_HOOKS:
            if info.error is None:
                self._call(info, hook_name)
        if info.error is not None:
            self._rollback([info])
        return info

    def _register(self, plugin: Any, name: str, distribution: str, version: str) -> PluginInfo:
        """Add ``plugin`` to the plugin manager and catch misspelled hooks (check_pending);
        the returned info has ``error`` set if that failed."""
        info = PluginInfo(name, distribution, version)
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except Exception as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            self._fail(info, first_line(exc, typed=True))
            return info
        self.plugins[name] = info
        return info

    def _call(
        self,
        info: PluginInfo,
        hook_name: str,
        bind: Callable[[PluginInfo], Callable[..., Any]] | None = None,
    ) -> None:
        """Run ``info``'s implementation of ``hook_name`` with ``register=bind(info)`` (by
        default the kind or component registrar), recording a failure against ``info``."""
        if bind is None:
            bind = {
                "register_kinds": self._kind_registrar,
                "register_components": self._component_registrar,
            }[hook_name]
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            if impl.plugin_name != info.name:
                continue
            try:
                impl.function(register=bind(info))
            except Exception as exc:
                self._fail(info, f"{hook_name}: {first_line(exc, typed=True)}")

    def _fail(self, info: PluginInfo, error: str) -> None:
        info.error = error
        self.plugins[info.name] = info
        if self.strict:
            self._rollback([info])
            raise PluginError(f"plugin {info.name!r} ({info.distribution}) failed: {error}")

    def _rollback(self, failed: list[PluginInfo]) -> None:
        """Undo everything the ``failed`` plugins registered: kinds and components are
        replayed without theirs, so clashes they caused are undone too; other plugins'
        components of the kinds they declared go as well (whatever the loading order)."""
        if not failed:
            return
        gone = {id(info) for info in failed}
        for info, kind in self._kind_log:
            if id(info) in gone:
                self.lost.setdefault(kind.name, info)
        for info, rec in self._log:
            if id(info) in gone:
                self.lost.setdefault(rec.key, info)
        records = self._log
        self._kind_log = [(i, k) for i, k in self._kind_log if id(i) not in gone]
        self.kinds.clear()
        self.kinds.update({k.name: k for _, k in self._kind_log})
        self._log = []
        self.components.clear()
        self.conflicts.clear()
        self.overridden.clear()
        strict, self.strict = self.strict, False  # clashes kept here were accepted before
        try:
            for info, rec in records:
                if id(info) in gone:
                    continue
                if rec.kind not in self.kinds:  # a kind only a failed plugin declared
                    info.registered.remove(rec.key)
                    continue
                self._add(rec)
                self._log.append((info, rec))
        finally:
            self.strict = strict
        for info in failed:
            info.registered.clear()

    def _kind_registrar(self, info: PluginInfo) -> Callable[..., None]:
        def register(
            name: str,
            summary: str,
            *,
            contract: str | None = None,
            section: str | None = None,
            default: str | None = None,
            per_layer: bool = False,
            build: str = "",
            check: str | None = None,
            template: str | None = None,
            bench: str | None = None,
        ) -> None:
            if name in self.kinds and self.kinds[name].provider != info.distribution:
                raise RegistryError(
                    f"kind {name!r} is declared by both {self.kinds[name].provider} "
                    f"and {info.distribution}"
                )
            kind = Kind(
                name,
                summary,
                contract,
                info.distribution,
                section,
                default,
                per_layer,
                build,
                check,
                template,
                bench,
            )
            check_kind(kind, self.kinds)
            self.kinds[name] = kind
            self._kind_log.append((info, kind))

        return register

    def _component_registrar(self, info: PluginInfo) -> Callable[..., Component]:
        def register(
            kind: str,
            name: str,
            target: Any,
            *,
            summary: str = "",
            options: Any = None,
            capabilities: dict[str, Any] | None = None,
        ) -> Component:
            if not isinstance(name, str) or not name:
                raise RegistryError(f"component names must be non-empty strings, got {name!r}")
            rec = Component(
                kind,
                name,
                target,
                summary or _doc_line(target),
                options,
                dict(capabilities or {}),
                info.distribution,
                info.version,
            )
            self._add(rec)
            self._log.append((info, rec))
            info.registered.append(rec.key)
            return rec

        return register

    def _add(self, rec: Component) -> None:
        if rec.kind not in self.kinds:
            raise RegistryError(
                f"unknown kind {rec.kind!r} for component {rec.name!r}"
                f"{_suggest(rec.kind, self.kinds)}; known kinds: {', '.join(sorted(self.kinds))}"
            )
        rec.kind_record = self.kinds[rec.kind]
        old = self.components.get(rec.key)
        conflict = self.conflicts.get(rec.key)
        if old is None and conflict is None:
            self.components[rec.key] = rec
            return
        if conflict is None:
            conflict = self.conflicts[rec.key] = Conflict(rec.key, [old.provider])
        conflict.providers.append(rec.provider)
        pool = [c for c in (old, rec) if c is not None]
        winner = self.winners.get(rec.key)
        chosen = next((c for c in pool if c.provider == winner), None)
        if chosen is None and old is not None and conflict.winner is not None:
            chosen = old
        if chosen is not None:
            conflict.winner = chosen.provider
            self.components[rec.key] = chosen
            self.overridden.extend(c for c in pool if c is not chosen)
        else:
            self.components.pop(rec.key, None)
            if old is not None:
                self.overridden.append(old)
            self.overridden.append(rec)
            conflict.winner = None
            if self.strict:
                raise RegistryError(self._conflict_message(conflict))

    @staticmethod
    def _conflict_message(conflict: Conflict) -> str:
        return (
            f"{conflict.key} is registered by more than one plugin: "
            f"{' and '.join(conflict.providers)}; choose one in registry.toml "
            f'or $LLMKIT_REGISTRY under [winners], e.g. "{conflict.key}" = '
            f'"{conflict.providers[0]}"'
        )

    # -- lookup ----------------------------------------------------------------------------
    def get(self, kind: str, name: str) -> Component:
        """The component ``kind.name``; a helpful error if it is unknown or contested."""
        if kind not in self.kinds:
            raise RegistryError(
                f"unknown component kind {kind!r}{_suggest(kind, self.kinds)}; "
                f"known kinds: {', '.join(sorted(self.kinds))}{self.failure_hint(kind)}"
            )
        key = f"{kind}.{name}"
        if key in self.components:
            return self.components[key]
        if key in self.conflicts:
            raise RegistryError(self._conflict_message(self.conflicts[key]))
        names = sorted(self.names(kind))
        raise RegistryError(
            f"unknown {kind} {name!r}{_suggest(name, names)}; available: "
            f"{', '.join(names) or 'none (no installed plugin provides one)'}"
            f"{self.failure_hint(kind, name)}"
        )

    def failure_hint(self, kind: str | None = None, name: str | None = None) -> str:
        """``"; plugin 'x' (dist) ... failed to load: error"`` for a message about a missing
        kind or ``kind.name``: the failed plugin that registered it, else every failed plugin
        (any may have provided it); ``""`` when no plugin failed."""
        failed = self.failures()
        if not failed:
            return ""
        key = f"{kind}.{name}" if kind is not None and name is not None else kind
        owner = self.lost.get(key) if key is not None else None
        if owner is None and name is not None and kind not in self.kinds:
            owner = self.lost.get(kind or "")
        if owner is not None and owner.error:
            return f"; plugin {owner.name!r} ({owner.distribution}) provides it but failed " + (
                f"to load: {first_line(owner.error, limit=300)}"
            )
        return "; " + "; ".join(
            f"plugin {p.name!r} ({p.distribution}) failed to load and may provide it: "
            f"{first_line(p.error or '', limit=300)}"
            for p in failed
        )

    def names(self, kind: str) -> list[str]:
        return [c.name for c in self.components.values() if c.kind == kind]

    def list(self, kind: str | None = None, pattern: str | None = None) -> list[Component]:
        """Components sorted by kind then name, filtered by kind and a wildcard pattern."""
        out = [
            c
            for c in self.components.values()
            if (kind is None or c.kind == kind)
            and (pattern is None or fnmatch.fnmatchcase(c.name, pattern))
        ]
        return sorted(out, key=lambda c: (c.kind, c.name))

    def failures(self) -> list[PluginInfo]:
        return [p for p in self.plugins.values() if p.error]

    def unloadable(self) -> list[tuple[Component, str]]:
        """Components whose module (or options model) fails to import, each with the
        import's one-line error. Imports every component module."""
        out = []
        for rec in self.list():
            try:
                rec.options_model()
            except Exception as exc:
                cause = exc.__cause__ if isinstance(exc, RegistryError) and exc.__cause__ else exc
                out.append((rec, first_line(cause, typed=True, limit=300)))
        return out

    def without(self, keys: Iterable[str]) -> Registry:
        """A shallow copy for reading that lacks the components ``keys`` (``kind.name``)."""
        drop = set(keys)
        view = copy.copy(self)
        view.components = {k: c for k, c in self.components.items() if k not in drop}
        return view

    # -- hooks outside the registry (the command line's register_commands) ------------------
    def call_hook(self, hook_name: str, bind: Callable[[PluginInfo], Callable[..., Any]]) -> None:
        """Call every loaded plugin's ``hook_name``, llmkit's own plugins first, each with
        ``register=bind(info)``: a callback bound to that plugin.

        For hooks whose records the caller keeps (``llmkit.cli`` keeps the commands), so
        component loading never runs them. Failures are isolated as in
        :meth:`load_entry_points`: a plugin whose hook raises is recorded as failed (or,
        under ``LLMKIT_STRICT_PLUGINS``, raises :class:`PluginError`); the rest still run.
        """
        for info in sorted(self.plugins.values(), key=lambda p: p.distribution != "llmkit"):
            self._call(info, hook_name, bind)


def _doc_line(target: Any) -> str:
    if isinstance(target, str):
        return ""
    doc = (getattr(target, "__doc__", None) or "").strip()
    return first_line(doc)


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _own_version() -> str:
    try:
        return md.version("llmkit")
    except md.PackageNotFoundError:
        from llmkit import __version__

        return __version__


def allowed_plugins() -> list[str] | None:
    """Plugin names from ``$LLMKIT_PLUGINS`` (None when unset = load all)."""
    raw = os.environ.get("LLMKIT_PLUGINS")
    if raw is None:
        return None
    return [p.strip() for p in raw.split(",") if p.strip()]


_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, loaded on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        reg = Registry()
        reg.load_entry_points(allowed_plugins())
        _REGISTRY = reg
    return _REGISTRY


def failure_hint(kind: str | None = None, name: str | None = None) -> str:
    """:meth:`Registry.failure_hint` of the process-wide registry: append it to an error about
    a kind or component that is missing (``""`` when no plugin failed)."""
    return get_registry().failure_hint(kind, name)


def reset_registry(registry: Registry | None = None) -> None:
    """Drop (or replace) the process-wide registry; used by tests and tools."""
    global _REGISTRY
    _REGISTRY = registry
