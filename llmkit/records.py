"""The registry's records: a component (:class:`Component`), a kind and what gives it meaning
(:class:`Kind`), a plugin and what it did (:class:`PluginInfo`), a name clash
(:class:`Conflict`); and importing a ``"module:attr"`` target. :mod:`llmkit.registry`
re-exports them."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from llmkit.errors import RegistryError


def import_target(target: str) -> Any:
    """Import ``"package.module:attr"`` (attr may be dotted)."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise RegistryError(f"bad target {target!r}: expected 'module:attr'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class Component:
    """One registered component."""

    kind: str
    name: str
    target: Any  # a factory, or a lazy "module:attr" string
    summary: str = ""
    #: A pydantic model class, ``"module:attr"`` (imported on first use, without the target:
    #: a torch-free options module keeps spec checks torch-free), or None (the target's
    #: ``Options``, or its module's; importing the target).
    options: Any = None
    capabilities: dict[str, Any] = field(default_factory=dict)
    provider: str = "?"
    version: str = "?"
    #: The record of its kind, set when the registry accepts the component.
    kind_record: Kind | None = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> str:
        return f"{self.kind}.{self.name}"

    @property
    def target_path(self) -> str:
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"

    def _import(self, target: str) -> Any:
        """``import_target``; a failure is a :class:`RegistryError` naming the component and
        its provider (a plugin's module that does not import)."""
        try:
            return import_target(target)
        except Exception as exc:
            raise RegistryError(
                f"{self.kind} {self.name!r} from {self.provider} failed to load: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def load(self) -> Any:
        """The factory, importing it on first use."""
        if isinstance(self.target, str):
            self.target = self._import(self.target)
        return self.target

    def options_model(self) -> type:
        """The pydantic model of this component's options: ``options`` imported, else the
        factory's ``Options`` (its module's ``Options``; :class:`~llmkit.options.NoOptions`
        when neither has one), which imports the factory."""
        if isinstance(self.options, str):
            self.options = self._import(self.options)
        if self.options is None:
            factory = self.load()
            opts = getattr(factory, "Options", None)
            if opts is None:
                module = importlib.import_module(factory.__module__)
                opts = getattr(module, "Options", None)
            if opts is None:
                from llmkit.options import NoOptions

                opts = NoOptions
            self.options = opts
        return self.options

    def parse_options(self, values: dict[str, Any]) -> Any:
        """Validate ``values`` (without ``name``) against the options model."""
        return self.options_model().model_validate(values)


@dataclass
class Kind:
    """A kind of component, and everything that gives it meaning.

    The spec, its JSON Schema, ``llmkit plugin new``, the conformance suite, ``llmkit bench
    kernels`` and ``llmkit info`` read these fields instead of lists of kind names, so a kind
    a plugin declares gets each of them by filling the field in.
    """

    name: str
    summary: str
    contract: str | None = None  # "module:attr" of the base class/protocol components follow
    provider: str = "?"
    #: Dotted spec path of the table that chooses this kind's component: ``"model.ffn"``,
    #: ``"optimizer"``, ``"data.source"``, ``"train.loss"``. None: not chosen in a spec.
    section: str | None = None
    #: The component used when the table is absent or has no ``name``; None makes the
    #: section optional (absent = no component of this kind).
    default: str | None = None
    #: Selectable per layer in ``model.overrides`` (only for ``model.*`` sections).
    per_layer: bool = False
    #: The build signature its components follow, for documentation and ``llmkit show``.
    build: str = ""
    #: ``"module:attr"`` of its conformance check ``check(record, options, *, device)``.
    check: str | None = None
    #: ``"package:relative/dir"`` of its ``llmkit plugin new --kind`` template directory.
    template: str | None = None
    #: ``"module:attr"`` of its ``llmkit bench kernels`` adapter.
    bench: str | None = None

    @property
    def slot(self) -> str | None:
        """The last part of ``section`` (``"ffn"`` for ``"model.ffn"``)."""
        return self.section.rpartition(".")[2] if self.section else None

    def load_check(self) -> Any:
        """The conformance check, or None when the kind has none (imported on use)."""
        return import_target(self.check) if self.check else None

    def load_bench(self) -> Any:
        """The benchmark adapter, or None when the kind has none (imported on use)."""
        return import_target(self.bench) if self.bench else None


@dataclass
class PluginInfo:
    """What one plugin is and what it did."""

    name: str
    distribution: str
    version: str
    registered: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class Conflict:
    key: str
    providers: list[str]
    winner: str | None = None


def check_kind(kind: Kind, others: dict[str, Kind]) -> None:
    """A kind's section must be a dotted identifier path, unique among kinds; per-layer
    kinds live under ``model``."""
    if kind.section is None:
        if kind.per_layer or kind.default is not None:
            raise RegistryError(f"kind {kind.name!r}: per_layer and default need a section")
        return
    parts = kind.section.split(".")
    if not all(p.isidentifier() for p in parts):
        raise RegistryError(f"kind {kind.name!r}: bad section {kind.section!r}")
    if kind.per_layer and (len(parts) != 2 or parts[0] != "model"):
        raise RegistryError(
            f"kind {kind.name!r}: a per-layer kind's section is 'model.<slot>', "
            f"not {kind.section!r}"
        )
    for other in others.values():
        if other.name != kind.name and other.section == kind.section:
            raise RegistryError(
                f"kind {kind.name!r}: section {kind.section!r} is already kind "
                f"{other.name!r}'s ({other.provider})"
            )
