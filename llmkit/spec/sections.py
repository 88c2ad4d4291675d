"""Where kinds live in a spec: the component tables each registered kind declares.

A kind's record (:class:`llmkit.registry.Kind`) names its ``section`` — ``"model.ffn"``,
``"optimizer"``, ``"data.source"``, ``"train.loss"`` — its ``default`` component and whether it
is chosen ``per_layer``. This module turns those records into fields of the spec's pydantic
models (for pass one and for the JSON Schema) and fills in default component names, so a
kind a plugin declares gets its spec table without any edit here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field, create_model

from llmkit.errors import SpecError
from llmkit.spec.models import (
    ComponentRef,
    DataSpec,
    LayerOverride,
    ModelSpec,
    Spec,
    TokenizerSpec,
    TrainSpec,
)

#: The spec tables a kind's section may sit in ("" = the top level).
PARENTS: dict[str, type[BaseModel]] = {
    "": Spec,
    "model": ModelSpec,
    "data": DataSpec,
    "train": TrainSpec,
    "tokenizer": TokenizerSpec,
}

#: ``ref(kind, optional)`` → ``(annotation, FieldInfo)`` of one component table, or None to
#: leave the kind's section out.
RefField = Callable[[Any, bool], tuple[Any, Any] | None]


def spec_kinds(registry: Any) -> list[Any]:
    """Kinds chosen in a spec (those with a section), by name."""
    kinds = getattr(registry, "kinds", {})
    return [k for _, k in sorted(kinds.items()) if getattr(k, "section", None)]


def layer_kinds(registry: Any) -> list[Any]:
    """Kinds chosen per layer (``model.<slot>`` sections with ``per_layer``)."""
    return [k for k in spec_kinds(registry) if k.per_layer]


def default_component(path: list[str] | tuple[str, ...], registry: Any = None) -> str | None:
    """The default component of the kind whose section is the table at ``path`` (a
    per-layer override's ``model.overrides.<i>.<slot>`` counts as ``model.<slot>``); None
    when no kind with a default has that section."""
    parts = list(path)
    if len(parts) == 4 and parts[:2] == ["model", "overrides"]:
        parts = ["model", parts[3]]
    section = ".".join(parts)
    if registry is None:
        from llmkit.registry import get_registry

        registry = get_registry()
    for kind in spec_kinds(registry):
        if kind.section == section:
            return kind.default
    return None


def check_sections(registry: Any) -> list[str]:
    """Problems with the kinds' sections: a parent that is no spec table, or a section that
    is already a plain field of the spec."""
    problems = []
    for kind in spec_kinds(registry):
        parent, _, slot = kind.section.rpartition(".")
        where = f"kind {kind.name!r} ({kind.provider})"
        if parent not in PARENTS:
            tables = ", ".join(p or "(top level)" for p in PARENTS)
            problems.append(
                f"{where}: section {kind.section!r} is not inside a spec table ({tables})"
            )
        elif slot in PARENTS[parent].model_fields or (parent == "" and slot in PARENTS):
            problems.append(f"{where}: section {kind.section!r} is already a spec setting")
    return problems


def get_at(data: Any, section: str) -> Any:
    """The value at a dotted ``section`` of a raw spec dict (None when absent)."""
    node = data
    for part in section.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def set_at(data: dict[str, Any], section: str, value: Any) -> None:
    """Set the dotted ``section`` of ``data`` to ``value``, creating tables on the way."""
    *parents, last = section.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def default_names(data: dict[str, Any], registry: Any) -> None:
    """Give absent component tables of kinds with a default, and tables without ``name``,
    the kind's default component. Tables whose parent is not a table are left for pass one
    to report."""
    for kind in spec_kinds(registry):
        if kind.default is None:
            continue
        *parents, slot = kind.section.split(".")
        node: Any = data
        for part in parents:
            if not isinstance(node, dict):
                break
            node = node.setdefault(part, {}) if part != "model" else node.get(part)
        if not isinstance(node, dict):
            continue
        table = node.setdefault(slot, {})
        if isinstance(table, dict):
            table.setdefault("name", kind.default)


def component_ref(kind: Any, optional: bool) -> tuple[Any, Any]:
    """Pass one's field for a component table: ``{ name = ..., <options> }``."""
    desc = f"{kind.summary} (see `llmkit list {kind.name}`)."
    if optional:
        return ComponentRef | None, Field(None, description=desc)
    name = kind.default
    return ComponentRef, Field(default_factory=lambda: ComponentRef(name=name), description=desc)


def spec_model(
    registry: Any,
    ref: RefField = component_ref,
    prefix: str = "",
    extra: dict[str, dict[str, Any]] | None = None,
) -> type[Spec]:
    """:class:`Spec` with one field per kind's section, typed by ``ref``, and the fields of
    ``extra`` (``{"train": {"loggers": (type, FieldInfo)}}``); a section that cannot be
    placed is a :class:`SpecError`."""
    problems = check_sections(registry)
    if problems:
        raise SpecError(problems)
    fields: dict[str, dict[str, Any]] = {parent: {} for parent in PARENTS}
    for parent, more in (extra or {}).items():
        fields[parent].update(more)
    overrides: dict[str, Any] = {}
    for kind in spec_kinds(registry):
        parent, _, slot = kind.section.rpartition(".")
        field_ = ref(kind, kind.default is None)
        if field_ is None:  # e.g. the schema of a kind nothing provides yet
            continue
        fields[parent][slot] = field_
        if kind.per_layer:
            overrides[slot] = ref(kind, True)
    override = create_model(f"{prefix}LayerOverride", __base__=LayerOverride, **overrides)
    fields["model"]["overrides"] = (
        list[override],  # type: ignore[valid-type]
        Field(default_factory=list, description="Per-layer component replacements."),
    )
    tables: dict[str, type[BaseModel]] = {
        parent: create_model(f"{prefix}{base.__name__}", __base__=base, **fields[parent])
        for parent, base in PARENTS.items()
        if parent
    }
    root = create_model(
        f"{prefix}Spec",
        __base__=Spec,
        model=(tables["model"], ...),
        data=(tables["data"], Field(default_factory=tables["data"])),
        train=(tables["train"], Field(default_factory=tables["train"])),
        tokenizer=(tables["tokenizer"], Field(default_factory=tables["tokenizer"])),
        **fields[""],
    )
    tables[""], tables["overrides"] = root, override
    for table, cls in tables.items():
        _TABLES[cls] = (root, table)
        cls.__reduce__ = _reduce_table  # type: ignore[method-assign]
    _ROOT_TABLES[root] = tables
    return root


#: The classes :func:`spec_model` builds are not importable by name, so pickle (``torch.save``
#: of a model holding its spec, ``multiprocessing``) cannot find them: their instances pickle
#: as (key, table, values) and are rebuilt in the spec model of the same kinds.
_TABLES: dict[type, tuple[type, str]] = {}
_OTHER_KINDS = (
    "this spec was saved where other component kinds were installed; "
    "install the same plugins to load it"
)
_ROOT_TABLES: dict[type, dict[str, type[BaseModel]]] = {}


def _reduce_table(self: BaseModel) -> tuple[Any, ...]:
    root, table = _TABLES[type(self)]
    key = next((k for k, v in _MODELS.items() if v is root), None)
    if key is None:
        raise TypeError(f"{type(self).__name__} (a schema's model) cannot be pickled")
    return _rebuild_table, (key, table, self.model_dump(mode="python", round_trip=True))


def _rebuild_table(key: tuple[Any, ...], table: str, values: dict[str, Any]) -> BaseModel:
    """A spec table from :func:`_reduce_table`: in the spec model of this process's registry,
    which must declare the same kind sections."""
    root = _MODELS.get(key)
    if root is None:
        from llmkit.registry import get_registry

        root = cached_spec_model(get_registry())
        if _model_key(get_registry()) != key:
            raise SpecError([_OTHER_KINDS])
    return _ROOT_TABLES[root][table].model_validate(values)


_MODELS: dict[tuple[Any, ...], type[Spec]] = {}


def cached_spec_model(registry: Any) -> type[Spec]:
    """:func:`spec_model` with :func:`component_ref`, built once per set of kind sections."""
    key = _model_key(registry)
    if key not in _MODELS:
        _MODELS[key] = spec_model(registry)
    return _MODELS[key]


def _model_key(registry: Any) -> tuple[Any, ...]:
    """What :func:`spec_model` builds from: each spec kind's name, summary and section."""
    return tuple(
        (k.name, k.summary, k.section, k.default, k.per_layer) for k in spec_kinds(registry)
    )
